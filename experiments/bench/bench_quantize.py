"""GPU check + benchmark of the NVFP4 Triton quantizers (triage.kernels.nvfp4).

1. Bit-exactness: for every profile and a set of recipes, Triton vs the torch reference (run on the GPU, and
   once on CPU) on >= 1e6 adversarial blocks each: data bytes, scale bytes, outer scales must be identical.
   Also ``emit_expanded`` (bf16 and fp16) bit-identical to ``expand`` of the reference-quantized tensor.
2. Speed: quantize a bf16 16384x4096 tensor (per tensor / per row, 1x16 / 16x16, nearest / stochastic,
   +Hadamard), median of triton.testing.do_bench (host launch overhead included) and of CUDA-graph replays
   (device time only); effective bandwidth = (bytes read once + bytes written) / time, against the measured
   device copy bandwidth. Also quantize + emit_expanded, expand, dequantize, and a small tile sweep.

3. ``--decode`` (alone): decode-sized inputs (M ≤ 256 rows at Qwen3-4B's K), the default tiles (one row per
   program up to ``FEW_ROWS`` rows) beside the bandwidth tiles (8 rows × 512 columns, 4 warps: the default for
   large inputs) in the same run, bytes compared, µs per call (CUDA-graph replay and do_bench), with a bf16
   ``clone`` of the input as the peer (one read + one write of the same bytes).

Usage:  python experiments/bench/bench_quantize.py [--quick] [--skip-exact] [--ab] [--sweep] [--columnwise] [--decode]
        (writes $OUT/bench_quantize.json if $OUT set). ``--ab``: each case also on the general path
        (``pairs=False``, the kernel before the bf16 fast path; +hadamard included), side by side. The exact
        section checks the default (fast, Hadamard included) path and, for five variants per profile (two
        with Hadamard), the general path.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch

warnings.filterwarnings("ignore", category=RuntimeWarning)


def _import():
    from triage.kernels.nvfp4 import PROFILES, QuantRecipe, dequantize, quantize
    from triage.kernels.nvfp4.fuzz import adversarial, midpoint_tensor
    from triage.kernels.nvfp4.quantize_rows import quantize_triton

    return PROFILES, QuantRecipe, dequantize, quantize, adversarial, midpoint_tensor, quantize_triton


def compare(a, b) -> dict:
    def neq(u, v):
        return int((u != v).sum().item())

    out = {
        "data_bytes_differ": neq(a.data, b.data),
        "scale_bytes_differ": neq(a.scale.view(torch.uint8), b.scale.view(torch.uint8)),
    }
    ga, gb = a.global_scale.nan_to_num(-1.0), b.global_scale.nan_to_num(-1.0)
    out["outer_differ"] = neq(ga.to(gb.device), gb)
    return out


def check_exact(quick: bool) -> list[dict]:
    from triage.kernels.nvfp4 import expand

    PROFILES, QuantRecipe, _, quantize, adversarial, midpoint_tensor, quantize_triton = _import()
    rows, k = (256, 16384) if quick else (1024, 16384)  # 262,144 or 1,048,576 blocks
    variants = [
        {},
        {"scale": "row"},
        {"scale": "expert"},
        {"block": "16x16"},
        {"rounding": "stochastic", "seed": 7},
        {"hadamard": True, "scale": "row"},
        {"hadamard": True, "rounding": "stochastic", "seed": 7},
        {"hadamard": True, "scale": "expert"},
        {"hadamard": True, "block": "16x16", "rounding": "stochastic", "seed": 3},
        {"scale_source": "static", "static_amax": 100.0},
    ]
    general = (  # also run on the general (non-pair) path
        {},
        {"block": "16x16"},
        {"rounding": "stochastic", "seed": 7},
        {"hadamard": True, "scale": "row"},
        {"hadamard": True, "rounding": "stochastic", "seed": 7},
    )
    results = []
    for p_i, profile in enumerate(PROFILES):
        x = adversarial(rows, k, seed=1000 + p_i, device="cuda").reshape(8, rows // 8, k)
        for v in variants:
            recipe = QuantRecipe(profile=profile, **v)
            t0 = time.time()
            ref = quantize(x, recipe, backend="torch")
            tri = quantize(x, recipe, backend="triton")
            r = {"profile": profile, "variant": v, "blocks": x.numel() // 16, **compare(ref, tri)}
            r["seconds"] = round(time.time() - t0, 2)
            results.append(r)
            if v in general:
                r = compare(ref, quantize_triton(x, recipe, pairs=False))
                results.append(
                    {"profile": profile, "variant": f"general path {v}", "blocks": x.numel() // 16, **r}
                )
        for v in ({}, {"scale": "row", "rounding": "stochastic"}, {"block": "16x16"},
                  {"hadamard": True, "rounding": "stochastic"}):  # fmt: skip
            recipe = QuantRecipe(profile=profile, **v)
            for dt in (torch.bfloat16, torch.float16):
                t = quantize(x, recipe, backend="triton", emit_expanded=dt)
                want = expand(quantize(x, recipe, backend="torch"), dt)
                nan = torch.isnan(want)  # a NaN block (scale 0x7F) only has to stay NaN
                bad = int((torch.isnan(t.expanded) != nan).sum())
                bad += int((t.expanded.view(torch.int16) != want.view(torch.int16))[~nan].sum())
                results.append(
                    {"profile": profile, "variant": f"emit_expanded {dt} {v}", "blocks": x.numel() // 16,
                     "data_bytes_differ": bad, "scale_bytes_differ": 0, "outer_differ": 0}
                )  # fmt: skip
        # torch reference on CPU vs Triton on GPU (catches CPU/GPU differences in torch itself)
        xs = x[:1, :64].contiguous()
        for had in (False, True):  # hadamard: the GPU's bf16 rounding (cvt.rn) against the CPU's
            recipe = QuantRecipe(profile=profile, scale="row", hadamard=had)
            r = compare(
                quantize(xs.cpu(), recipe, backend="torch"), quantize(xs, recipe, backend="triton").to("cpu")
            )
            name = "cpu-reference-vs-gpu-triton" + (" +hadamard" if had else "")
            results.append({"profile": profile, "variant": name, **r})
        for had in (False, True):  # hadamard: pre-rotated, so the transformed values are the midpoints
            mid = midpoint_tensor(512, 4096, seed=p_i, hadamard=had).cuda()
            recipe = QuantRecipe(profile=profile, hadamard=had)
            r = compare(quantize(mid, recipe, backend="torch"), quantize(mid, recipe, backend="triton"))
            results.append({"profile": profile, "variant": "midpoints" + (" +hadamard" if had else ""), **r})
    return results


def torchao_vs_profile(quick: bool) -> dict | None:
    """How often torchao's own CUDA quantizer differs from the torchao profile (see docs: CUDA's scalar
    division becomes multiplication by a reciprocal)."""
    try:
        from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale
    except Exception as e:  # torchao not installed on the GPU box
        return {"skipped": repr(e)[:200]}
    PROFILES, QuantRecipe, _, quantize, adversarial, _, _ = _import()
    x = adversarial(256 if quick else 1024, 16384, seed=5, specials=False, device="cuda")
    t = quantize(x, QuantRecipe(profile="torchao"), backend="triton")
    pts = per_tensor_amax_to_scale(x.float().abs().amax())
    s, d = nvfp4_quantize(x, per_tensor_scale=pts)
    return {
        "blocks": x.numel() // 16,
        "outer_equal": bool(torch.equal(pts, t.global_scale)),
        "scale_bytes_differ": int((s.view(torch.uint8) != t.scale.view(torch.uint8)).sum()),
        "data_bytes_differ": int((d != t.data).sum()),
    }


def bench(quick: bool, ab: bool = False, sweep: bool = False) -> dict:
    import triton
    from triton.testing import do_bench, do_bench_cudagraph

    from triage.kernels.nvfp4 import expand

    PROFILES, QuantRecipe, dequantize, quantize, _, _, quantize_triton = _import()
    m, k = 16384, 4096
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3
    bytes_io = m * k * 2 + m * k // 2 + m * k // 16  # read bf16 once, write packed data + e4m3 scales
    y = torch.empty_like(x)
    copy_ms = do_bench(lambda: y.copy_(x), return_mode="median")
    copy_gbs = 2 * m * k * 2 / copy_ms / 1e6
    rows = []

    def add(name, fn, nbytes=bytes_io):
        fn()
        ms = do_bench(fn, warmup=10, rep=50, return_mode="median")
        try:
            ms_graph = do_bench_cudagraph(fn, rep=50, return_mode="median")
        except Exception:  # noqa: BLE001 - a path that syncs cannot be captured
            ms_graph = float("nan")
        best = min(ms, ms_graph) if ms_graph == ms_graph else ms
        gbs = nbytes / best / 1e6
        rows.append(
            {
                "case": name,
                "ms": round(ms, 4),
                "ms_graph": round(ms_graph, 4),
                "GB/s": round(gbs, 1),
                "pct_copy": round(100 * gbs / copy_gbs, 1),
            }
        )

    cases = [
        ("tensor 1x16 nearest", {}),
        ("row 1x16 nearest", {"scale": "row"}),
        ("tensor 16x16 nearest", {"block": "16x16"}),
        ("tensor 1x16 stochastic", {"rounding": "stochastic"}),
        ("row 1x16 stochastic", {"scale": "row", "rounding": "stochastic"}),
        ("tensor 16x16 stochastic", {"block": "16x16", "rounding": "stochastic"}),
        ("static 1x16 nearest", {"scale_source": "static", "static_amax": 20.0}),
        ("row 1x16 nearest +hadamard", {"scale": "row", "hadamard": True}),
        ("tensor 1x16 stochastic +hadamard", {"rounding": "stochastic", "hadamard": True}),
    ]
    for name, kw in cases:
        r = QuantRecipe(**kw)
        add(name, lambda r=r: quantize(x, r, backend="triton"))
        if ab:  # the same case on the general path (the kernel before the bf16 fast path)
            add(name + " [general path]", lambda r=r: quantize_triton(x, r, pairs=False))
    for profile in PROFILES[1:]:
        r = QuantRecipe(profile=profile)
        add(f"tensor 1x16 nearest [{profile}]", lambda r=r: quantize(x, r, backend="triton"))
    exp_bytes = bytes_io + m * k * 2
    for name, kw in (
        ("tensor", {}),
        ("static", {"scale_source": "static", "static_amax": 20.0}),
        ("row", {"scale": "row"}),
    ):
        r = QuantRecipe(**kw)
        add(f"{name} 1x16 nearest + emit_expanded bf16",
            lambda r=r: quantize(x, r, emit_expanded=torch.bfloat16), exp_bytes)  # fmt: skip
        if ab:
            add(f"{name} 1x16 nearest + emit_expanded bf16 [general path]",
                lambda r=r: quantize_triton(x, r, emit_expanded=torch.bfloat16, pairs=False), exp_bytes)  # fmt: skip
    t = quantize(x, QuantRecipe(), backend="triton")
    out_bytes = m * k // 2 + m * k // 16 + m * k * 2
    add("expand -> bf16 (reads codes+scales, writes bf16)", lambda: expand(t), out_bytes)
    add("dequantize -> bf16", lambda: dequantize(t, torch.bfloat16, backend="triton"), out_bytes)
    if sweep:  # tile sweep for the two main cases (bf16 fast path)
        for kw in ({"scale_source": "static", "static_amax": 20.0}, {"scale": "row"}, {}, {"block": "16x16"}):
            r = QuantRecipe(**kw)
            for br, bk, nw in ((8, 256, 4), (16, 256, 4), (16, 256, 8), (32, 256, 8), (8, 512, 4), (16, 512, 8),
                               (16, 512, 4), (8, 1024, 4), (8, 1024, 8), (32, 128, 4), (8, 128, 2), (16, 128, 4)):  # fmt: skip
                if r.block == "16x16" and br % 16:
                    continue
                add(
                    f"sweep {kw.get('scale_source', kw.get('scale', kw.get('block', 'tensor')))} BR={br} BK={bk} w{nw}",
                    lambda r=r, br=br, bk=bk, nw=nw: quantize_triton(
                        x, r, block_rows=br, block_k=bk, num_warps=nw
                    ),
                )
    return {"copy_GB/s": round(copy_gbs, 1), "shape": [m, k], "rows": rows, "triton": triton.__version__}


def bench_columnwise(quick: bool) -> dict:
    """``--columnwise``: ``quantize_columnwise`` (1×16 blocks along the tokens, no transposed copy) against
    the baseline ``quantize(<transposed / padded copy>)``: bytes identical? and both times (do_bench medians,
    CUDA-graph replays where capturable). Dense: bf16 x [16384, 4096] (the NVFP4Linear wgrad operands);
    MoE: 131072 routed rows (16384 tokens, top-8, 128 experts) into the 16-aligned segment layout, C=2048,
    x gathered from the tokens (as ``nvfp4_wgrad``) and dy [131072, 1536] without gather. Also a bit-exact
    check on adversarial blocks for every profile and a small tile sweep."""
    from dataclasses import replace

    from triton.testing import do_bench, do_bench_cudagraph

    from triage.kernels.moe import offsets_from_expert_ids
    from triage.kernels.moe.grouped_gemm import pad_segments, padded_segments
    from triage.kernels.nvfp4.quantize_columns import columnwise_matrix, quantize_columnwise

    PROFILES, QuantRecipe, _, quantize, adversarial, _, _ = _import()
    rows, ok = [], True

    def same(a, b) -> bool:
        r = compare(a, b)
        good = r["data_bytes_differ"] == 0 and r["scale_bytes_differ"] == 0 and r["outer_differ"] == 0
        if a.amax is not None or b.amax is not None:
            good &= torch.equal(a.amax.nan_to_num(-1.0), b.amax.nan_to_num(-1.0))
        if a.expanded is not None or b.expanded is not None:
            good &= torch.equal(a.expanded.view(torch.int16), b.expanded.view(torch.int16))
        return bool(good)

    def timed(fn) -> tuple[float, float]:
        fn()
        ms = do_bench(fn, warmup=10, rep=50, return_mode="median")
        try:
            graph = do_bench_cudagraph(fn, rep=50, return_mode="median")
        except Exception:  # noqa: BLE001 - a path that cannot be captured
            graph = float("nan")
        return ms, graph

    def row(case, old, new, nbytes):
        nonlocal ok
        identical = same(old(), new())
        ok &= identical
        t_old, g_old = timed(old)
        t_new, g_new = timed(new)
        best = min(t_new, g_new) if g_new == g_new else t_new
        rows.append({
            "case": case, "identical": identical, "old_ms": round(t_old, 4), "old_graph_ms": round(g_old, 4),
            "new_ms": round(t_new, 4), "new_graph_ms": round(g_new, 4), "new_GB/s": round(nbytes / best / 1e6, 1),
        })  # fmt: skip

    # bit-exactness on adversarial blocks along the tokens (blocks of Y = xᵀ), every profile
    t_adv, c_adv = (1024, 1024) if quick else (4096, 1024)
    # every profile and variant is a new specialization to compile (~3-5 s each for both kernels and both
    # quantizers): --quick checks the default profile only, so the timing rows fit a short GPU run
    for p_i, profile in enumerate(PROFILES[:1] if quick else PROFILES):
        x = adversarial(c_adv, t_adv, seed=2000 + p_i, device="cuda").t().contiguous()  # [T, C]
        for v in ({"hadamard": True, "rounding": "stochastic"}, {"hadamard": True, "scale": "row"}, {}):
            recipe = QuantRecipe(profile=profile, **v)
            y = columnwise_matrix(x)
            got = quantize_columnwise(x, recipe, seed=9, emit_expanded=torch.bfloat16)
            good = same(got, quantize(y, recipe, backend="triton", seed=9, emit_expanded=torch.bfloat16))
            good &= same(replace(got, expanded=None), quantize(y, recipe, backend="torch", seed=9))
            ok &= good
            rows.append({"case": f"exact {profile} {v}", "identical": good})
    # dense wgrad operands: dyᵀ (stochastic) / xᵀ (nearest), Hadamard, per tensor
    m, k = (4096, 4096) if quick else (16384, 4096)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3
    nbytes = m * k * 2 + m * k // 2 + m * k // 16  # read once, write codes + scales
    for name, recipe in (
        (
            "dense 1x16 hadamard stochastic tensor",
            QuantRecipe(hadamard=True, rounding="stochastic", pad=True),
        ),
        ("dense 1x16 hadamard nearest tensor", QuantRecipe(hadamard=True, pad=True)),
        (
            "dense 1x16 hadamard stochastic row",
            QuantRecipe(hadamard=True, rounding="stochastic", scale="row"),
        ),
        ("dense 1x16 nearest tensor (no hadamard)", QuantRecipe()),
    ):
        row(name, lambda r=recipe: quantize(x.t().contiguous(), r, seed=5),
            lambda r=recipe: quantize_columnwise(x, r, seed=5), nbytes)  # fmt: skip
    # MoE wgrad operands: sorted rows into the 16-aligned segment layout
    tokens, experts, top_k = (2048, 128, 8) if quick else (16384, 128, 8)
    torch.manual_seed(0)
    idx = torch.randn(tokens, experts, device="cuda").topk(top_k, dim=-1).indices
    order, offsets = offsets_from_expert_ids(idx, experts)
    gather = order // top_k
    n_rows = gather.numel()
    _, dest, length = padded_segments(offsets, n_rows)
    recipe = QuantRecipe(hadamard=True, rounding="stochastic", pad=True)
    near = QuantRecipe(hadamard=True, pad=True)
    x_tok = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(n_rows, 1536, device="cuda", dtype=torch.bfloat16)
    emit = torch.bfloat16
    for name, src, g, r, c in (
        ("moe x (gather) C=2048 nearest +exp", x_tok, gather, near, 2048),
        ("moe dy C=1536 stochastic +exp", dy, None, recipe, 1536),
    ):
        nb = n_rows * c * 2 + length * c // 2 + length * c // 16 + length * c * 2
        row(
            name,
            lambda src=src, g=g, r=r: quantize(
                pad_segments(src, dest, length, g).t().contiguous(), r, seed=3, emit_expanded=emit
            ),
            lambda src=src, g=g, r=r: quantize_columnwise(
                src, r, seed=3, gather=g, dest=dest, length=length, emit_expanded=emit
            ),
            nb,
        )
    # tile sweep (dense stochastic case)
    recipe = QuantRecipe(hadamard=True, rounding="stochastic", pad=True)
    for bc, bt, nw in ((128, 64, 4), (64, 64, 4), (128, 32, 4), (256, 64, 8), (128, 128, 8), (64, 128, 4),
                       (256, 32, 4), (32, 64, 2)):  # fmt: skip
        try:
            fn = lambda bc=bc, bt=bt, nw=nw: quantize_columnwise(  # noqa: E731
                x, recipe, seed=5, block_c=bc, block_t=bt, num_warps=nw
            )
            t, g = timed(fn)
            rows.append(
                {"case": f"sweep BC={bc} BT={bt} w{nw}", "new_ms": round(t, 4), "new_graph_ms": round(g, 4)}
            )
        except Exception as exc:  # noqa: BLE001 - report and keep sweeping
            rows.append(
                {"case": f"sweep BC={bc} BT={bt} w{nw}", "error": f"{type(exc).__name__}: {exc}"[:120]}
            )
    return {"rows": rows, "identical": ok, "moe_rows": n_rows, "moe_length": length}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer blocks, no tile sweep")
    ap.add_argument("--skip-exact", action="store_true")
    ap.add_argument("--ab", action="store_true", help="also time the general path (pairs=False) per case")
    ap.add_argument("--sweep", action="store_true", help="tile sweep (BR, BK, num_warps) of the fast path")
    ap.add_argument("--decode", action="store_true", help="only decode-sized inputs: default vs bandwidth tiles")
    ap.add_argument("--columnwise", action="store_true",
                    help="only the columnwise (transposed-operand) quantizer vs transpose + quantize")  # fmt: skip
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_quantize.py needs a CUDA device", file=sys.stderr)
        return 2
    if args.columnwise:
        return main_columnwise(args.quick)
    if args.decode:
        return main_decode()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    ok = True
    if not args.skip_exact:
        exact = check_exact(args.quick)
        out["exact"] = exact
        print(
            f"\n{'profile':20s} {'variant':60s} {'blocks':>9s} {'data!=':>7s} {'scale!=':>7s} {'outer!=':>7s}"
        )
        for r in exact:
            print(
                f"{r['profile']:20s} {json.dumps(r['variant'])[:60]:60s} {r.get('blocks', 0):9d} "
                f"{r['data_bytes_differ']:7d} {r['scale_bytes_differ']:7d} {r['outer_differ']:7d}"
            )
            ok &= r["data_bytes_differ"] == 0 and r["scale_bytes_differ"] == 0 and r["outer_differ"] == 0
        print("BIT-EXACT: " + ("yes" if ok else "NO"))
        out["torchao_cuda_vs_profile"] = torchao_vs_profile(args.quick)
        print("torchao's own CUDA quantizer vs our torchao profile:", out["torchao_cuda_vs_profile"])
    perf = bench(args.quick, ab=args.ab, sweep=args.sweep or not args.quick)
    out["perf"] = perf
    print(f"\ncopy bandwidth: {perf['copy_GB/s']} GB/s   (bf16 {perf['shape'][0]}x{perf['shape'][1]})")
    print(
        "ms: do_bench (host launches included); graph: CUDA-graph replay (device only); GB/s from the faster"
    )
    print(f"{'case':52s} {'ms':>8s} {'graph':>8s} {'GB/s':>8s} {'% copy':>7s}")
    for r in perf["rows"]:
        print(f"{r['case']:52s} {r['ms']:8.4f} {r['ms_graph']:8.4f} {r['GB/s']:8.1f} {r['pct_copy']:7.1f}")
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "bench_quantize.json")
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {path}")
    return 0 if ok else 1


def main_decode() -> int:
    """Decode-sized quantize: default tiles vs the bandwidth tiles, same bytes, µs per call."""
    from triton.testing import do_bench, do_bench_cudagraph

    from triage.kernels.nvfp4 import QuantRecipe
    from triage.kernels.nvfp4.quantize_rows import FEW_ROWS, _default_tiles, quantize_triton

    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    br, nb, _ = _default_tiles(QuantRecipe(), 512 * 16, True, FEW_ROWS + 1)  # the many-rows tile (bf16 fast path)
    wide = dict(block_rows=br, block_k=16 * nb, num_warps=4)

    def us(fn) -> tuple[float, float]:
        fn()
        graph = do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3
        return graph, do_bench(fn, warmup=10, rep=30, return_mode="median") * 1e3

    ok, rows = True, []
    print(f"{'recipe':14s} {'M':>4s} {'K':>5s} {'same':>5s} | graph µs: {'clone':>6s} {'wide':>7s} {'default':>7s} "
          f"{'speed-up':>8s} | do_bench µs: {'wide':>7s} {'default':>7s}")  # fmt: skip
    for name, recipe, expanded in (
        ("row +fp16 exp", QuantRecipe(scale="row", profile="compressed-tensors"), torch.float16),
        ("row", QuantRecipe(scale="row"), None),
        ("tensor", QuantRecipe(), None),
    ):
        for m in (1, 16, 64, 256):
            for k in (2560, 4096, 9728):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3
                a = quantize_triton(x, recipe, emit_expanded=expanded)
                b = quantize_triton(x, recipe, emit_expanded=expanded, **wide)
                same = torch.equal(a.data, b.data) and torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))
                same &= torch.equal(a.global_scale, b.global_scale)
                if expanded is not None:
                    same &= torch.equal(a.expanded.view(torch.int16), b.expanded.view(torch.int16))
                ok &= bool(same)
                clone_g, _ = us(lambda x=x: x.clone())
                wide_g, wide_b = us(lambda x=x, r=recipe, e=expanded: quantize_triton(x, r, emit_expanded=e, **wide))
                new_g, new_b = us(lambda x=x, r=recipe, e=expanded: quantize_triton(x, r, emit_expanded=e))
                rows.append(dict(recipe=name, m=m, k=k, same=bool(same), clone_graph_us=clone_g, wide_graph_us=wide_g,
                                 default_graph_us=new_g, wide_us=wide_b, default_us=new_b))  # fmt: skip
                print(f"{name:14s} {m:4d} {k:5d} {'yes' if same else 'NO':>5s} | {clone_g:16.1f} {wide_g:7.1f} "
                      f"{new_g:7.1f} {wide_g / new_g:7.2f}x | {wide_b:20.1f} {new_b:7.1f}")  # fmt: skip
    print("DECODE TILES BYTES IDENTICAL: " + ("yes" if ok else "NO"))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_quantize_decode.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0 if ok else 1


def main_columnwise(quick: bool) -> int:
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    res = bench_columnwise(quick)
    print(f"{'case':58s} {'same':>5s} {'old ms':>8s} {'graph':>8s} {'new ms':>8s} {'graph':>8s} {'GB/s':>8s}")
    for r in res["rows"]:
        if "error" in r:
            print(f"{r['case']:58s} {r['error']}")
            continue
        same = {True: "yes", False: "NO", None: "-"}[r.get("identical")]
        print(
            f"{r['case'][:58]:58s} {same:>5s} {r.get('old_ms', float('nan')):8.4f} "
            f"{r.get('old_graph_ms', float('nan')):8.4f} {r.get('new_ms', float('nan')):8.4f} "
            f"{r.get('new_graph_ms', float('nan')):8.4f} {r.get('new_GB/s', float('nan')):8.1f}"
        )
    print(f"moe layout: {res['moe_rows']} rows -> length {res['moe_length']}")
    print("COLUMNWISE BYTES IDENTICAL: " + ("yes" if res["identical"] else "NO"))
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "bench_quantize_columnwise.json")
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {path}")
    return 0 if res["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
