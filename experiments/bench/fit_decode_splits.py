"""Fit the decode kernel's split-K rule to a measured sweep (no GPU needed).

    python experiments/bench/fit_decode_splits.py LOG [--sms 132] [--top 5]

``LOG``: the output of ``bench_gemm.py --sections decode-shapes --sweep`` (its split table: one row per N×K
and M, the BN = 64 times at split 1, 2, 4, 8, 16; ``-`` where a split was not timed). Scores every rule of
the form of :func:`triage.kernels.nvfp4.gemm_decode.decode_config` — split doubles while ``tiles·split <
waves·SMs`` and ``(K/16) // (2·split) ≥ steps·16`` and ``2·split ≤ largest`` — by the summed time of the
splits it picks, over waves × steps × largest, and prints the best rules beside the library's current one
and the fastest split per row (the floor). Rows that ``decode_config`` gives narrow tiles and no split (M ≤ 16,
K ≤ ``NARROW_K``) are left out: the rule does not apply to them.
"""

from __future__ import annotations

import argparse
import itertools
import re

SPLITS = (1, 2, 4, 8, 16)
ROW = re.compile(r"^\| (\d+)×(\d+) \| (\d+) \| ([\d.]+) \|((?: [^|]+ \|){5})")


def read_sweep(path: str) -> list[tuple[int, int, int, dict[int, float], int | None]]:
    """``[(N, K, M, {split: µs}, the split marked * or None)]`` from the sweep table of a ``bench_gemm.py``
    log (``*``: the default split of the library that ran the sweep)."""
    rows = []
    for line in open(path, encoding="utf-8"):
        m = ROW.match(line.strip())
        if not m:
            continue
        raw = [c.strip() for c in m.group(5).strip().strip("|").split("|")]
        times = {s: float(c.rstrip("*")) for s, c in zip(SPLITS, raw, strict=True) if c != "-"}
        marked = next((s for s, c in zip(SPLITS, raw, strict=True) if c.endswith("*")), None)
        rows.append((int(m.group(1)), int(m.group(2)), int(m.group(3)), times, marked))
    if not rows:
        raise SystemExit(f"{path}: no split table rows (run bench_gemm.py --sections decode-shapes --sweep)")
    return rows


def pick(n: int, k: int, waves: float, steps: float, largest: int, sms: int, nb: int = 16, bn: int = 64) -> int:
    """The split the rule picks (``decode_config``'s loop, with a largest split)."""
    tiles, kb, split = -(-n // bn), -(-k // 16), 1
    while tiles * split < waves * sms and kb // (split * 2) >= steps * nb and split * 2 <= largest:
        split *= 2
    return split


def score(rows, waves, steps, largest, sms) -> tuple[float, int] | None:
    """(summed µs, rows where the rule picks the fastest split), or None if it picks an untimed split."""
    total, hits = 0.0, 0
    for n, k, _, times, _ in rows:
        s = pick(n, k, waves, steps, largest, sms)
        if s not in times:
            return None
        total += times[s]
        hits += times[s] == min(times.values())
    return total, hits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("log")
    p.add_argument("--sms", type=int, default=132, help="the swept GPU's SM count (H100, H200: 132)")
    p.add_argument("--top", type=int, default=5)
    args = p.parse_args()
    from triage.kernels.nvfp4 import gemm_decode as gd

    rows = read_sweep(args.log)
    narrow = sum(k <= gd.NARROW_K and m <= 16 for _, k, m, *_ in rows)
    rows = [r for r in rows if not (r[1] <= gd.NARROW_K and r[2] <= 16)]
    if narrow:
        print(f"{narrow} rows with K <= {gd.NARROW_K} left out (narrow tiles, no split: decode_config)")
    floor = sum(min(t.values()) for *_, t, _ in rows)
    print(f"{len(rows)} rows (N×K × M); fastest split per row: {floor:.1f} µs summed")
    if all(marked is not None for *_, marked in rows):
        swept = sum(t[marked] for *_, t, marked in rows)
        hits = sum(t[marked] == min(t.values()) for *_, t, marked in rows)
        print(f"the sweep's own defaults (*): {swept:.1f} µs, fastest at {hits}/{len(rows)}")
    results = []
    for waves, steps, largest in itertools.product((1, 1.5, 2, 3, 4, 6, 8), (1, 2, 3, 4), (4, 8, 16)):
        s = score(rows, waves, steps, largest, args.sms)
        if s is not None:
            results.append((s[0], s[1], waves, steps, largest))
    results.sort()
    for total, hits, waves, steps, largest in results[: args.top]:
        print(f"waves < {waves}, >= {steps} K steps, largest {largest}: {total:.1f} µs, fastest at {hits}/{len(rows)}")
    current = score(rows, gd.WAVES, gd.MIN_SPLIT_STEPS, 1 << 30, args.sms)
    label = f"library rule (waves < {gd.WAVES}, >= {gd.MIN_SPLIT_STEPS} K steps)"
    print(f"{label}: " + ("picks an untimed split" if current is None else f"{current[0]:.1f} µs, fastest at "
                          f"{current[1]}/{len(rows)}"))  # fmt: skip


if __name__ == "__main__":
    main()
