"""Summary of a mismatch-testbed folder (``experiments/testbed/study.sh``): mean ± std over seeds per
(level, arm), and one small JSON of every run's per-step series for ``docs/results/``.

    python -m triage.experiments.testbed_summary RUN_DIR [--json OUT.json]

``RUN_DIR/runs/<level>/<arm>/seed<k>.json`` are the finished runs and ``seed<k>.partial.json`` the runs a time
budget cut short (both written by ``triage ablate``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

SERIES = ("reward", "accuracy", "entropy", "mean_abs_delta", "suppressed_frac", "completion_length", "kl_k3")


def load_runs(root: Path) -> list[dict]:
    runs = []
    for f in sorted(root.glob("runs/*/*/seed*.json")):
        e = json.loads(f.read_text())
        level, arm, seed = e["level"], e["arm"], e["seed"]
        s = e["series"]
        runs.append({
            "level": level, "arm": arm, "seed": seed, "correction": e.get("correction"),
            "complete": e.get("complete", True), "steps": len(s["step"]), "seconds": e["seconds"],
            "mean_abs_delta_step1": s["mean_abs_delta"][0] if s["mean_abs_delta"] else None,
            "series": {k: s.get(k) for k in ("step", *SERIES)},
            "held_out": {k: e["held_out"][k] for k in ("step", "accuracy")},
        })
    return runs


def _window(values, first: bool, n: int = 10):
    vals = [v for v in (values[:n] if first else values[-n:]) if v is not None]
    return sum(vals) / len(vals) if vals else None


def _ms(values) -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "–"
    if len(vals) == 1:
        return f"{vals[0]:.3f}"
    return f"{statistics.mean(vals):.3f} ± {statistics.stdev(vals):.3f}"


def table(runs: list[dict]) -> str:
    lines = [
        "| level | arm | seeds | steps | \\|δ\\| step 1 | \\|δ\\| run | reward first 10 → last 10 | held-out first → last "
        "| entropy last 10 | s/step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple, list] = {}
    for r in runs:
        groups.setdefault((r["level"], r["arm"]), []).append(r)
    for (level, arm), rs in groups.items():
        s = [r["series"] for r in rs]
        held = [r["held_out"]["accuracy"] for r in rs]
        lines.append(
            f"| {level} | {arm} | {len(rs)} | {'/'.join(str(r['steps']) for r in rs)} "
            f"| {_ms([r['mean_abs_delta_step1'] for r in rs])} "
            f"| {_ms([_window(x['mean_abs_delta'], True, 10**9) for x in s])} "
            f"| {_ms([_window(x['reward'], True) for x in s])} → {_ms([_window(x['reward'], False) for x in s])} "
            f"| {_ms([h[0] for h in held])} → {_ms([h[-1] for h in held])} "
            f"| {_ms([_window(x['entropy'], False) for x in s])} "
            f"| {_ms([r['seconds'] / max(r['steps'], 1) for r in rs])} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--json", default=None, help="write every run's series here (default RUN_DIR/testbed.json)")
    args = ap.parse_args(argv)
    root = Path(args.run_dir)
    runs = load_runs(root)
    print(table(runs))
    missing = sorted(
        str(p) for p in root.glob("runs/*/*/seed*.log") if not any(p.parent.glob(p.stem + "*.json"))
    )
    for m in missing:
        print(f"FAILED (no result): {m}")
    sft = root / "sft" / "sft.json"
    out = {"sft": json.loads(sft.read_text()) if sft.is_file() else None, "runs": runs}
    if out["sft"]:
        out["sft"] = {k: out["sft"].get(k) for k in ("config", "params", "steps_done", "stopped_by", "final", "eval")}
    Path(args.json or root / "testbed.json").write_text(json.dumps(out, separators=(",", ":")) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
