# ruff: noqa: B023  (benchmark lambdas are consumed inside the loop iteration that defines them)
"""H200 check + benchmark of the NVFP4 dense GEMMs. Run on a CUDA machine:

    python experiments/bench/bench_gemm.py [--quick] [--sections correctness,w4a4,decode,linear,cache] [--sweep]
    (other sections: decode-shapes, decode-groups, decode-variants, decode-cold, w4a16-prefill,
    dense-mid, decode-mid, floor, dense-tma)

1. correctness vs the torch reference (dequantize, fp64 matmul) on real shapes, every backend (decode,
   dense-on-expanded, cuBLAS alpha, fused), per-tensor and per-row scales, a NaN block scale, and the
   quantizer's ``emit_expanded`` output bit-identical to ``expand(quantize(x))``;
2. W4A4 forward vs cuBLAS bf16 at (M, N, K) = (16384, 4096, 4096), (16384, 12288, 4096), (16384, 4096, 12288):
   operands quantized (activation with ``emit_expanded``), weight expansion cached; the cuBLAS alpha path
   with a static activation scale (no sync) and with a dynamic one (one ``.item()`` sync), the Triton GEMM
   on expansions (``--sweep``: a few tile configs), and the whole forward (quantize + GEMM);
3. decode M ∈ {1, 16, 64}: W4A16 and W4A4 (packed FP4 weights, decode kernel) vs bf16, CUDA graphs;
   ``decode-shapes``: every distinct Linear shape of Qwen3-0.6B/1.7B/4B/8B at M ∈ {1, 16}, the same three plus
   W4A4 with its activation quantization (per-row scale, fp16 expansion: what a W4A4 layer runs per call);
4. NVFP4Linear forward+backward (bf16-backward, quantization included) vs bf16 nn.Linear and vs a
   fake-quant (quantize → dequantize → bf16 matmul, straight-through gradient).

5. weight cache (``cache``): a plain loop of fused AdamW, foreach AdamW and SGD steps on CUDA NVFP4Linear
   layers (both modes) and NVFP4 MoE experts, each step's output asserted bit-equal to a freshly converted
   layer; the forward with a cached W_q vs one that re-quantizes W (what the per-step cache saves); a NaN
   weight / input gives a NaN output.
6. ``w4a16-prefill``: W4A16 above 64 rows (a sampler's prefill) at Qwen3-4B's shapes, cold L2: bf16
   ``torch.mm``, ``gemm_w4a16``'s ``auto`` route (the decode kernel up to ``W4A16_UNPACK_MAX_M`` rows, expand +
   Triton GEMM above), the expand alone, expand + cuBLAS (fp32
   output, torch epilogue), the ``fused`` kernel; ``dense-mid``: the dense Triton GEMM alone there, its tiles
   against cuBLAS bf16; ``decode-mid``: the decode kernel there (the weight unpacked in registers, M tiled).
7. ``dense-tma``: the dense GEMM's persistent TMA kernel (tile candidates) against its pointer kernel and
   cuBLAS bf16, at the learner's large shapes and Qwen3-4B's prefill rows.
8. ``floor``: the per-launch floor in a CUDA graph (a one-store Triton kernel, a 1×64×64 ``torch.mm``); also
   printed by ``decode-shapes``.

Timings are ``triton.testing.do_bench`` medians (ms) on random (never zero) data. Writes the table to
``$OUT/bench_gemm.md`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import os
import sys
import time
from pathlib import Path


def _ensure_triage() -> None:
    """Import triage.kernels from this checkout even when the package is not pip-installed."""
    try:
        import triage.kernels  # noqa: F401
    except ImportError:
        root = Path(__file__).resolve().parents[2]
        sys.path.insert(0, str(root))
        import triage  # noqa: F401

        for sub in ("kernels", "trainers", "experiments"):
            spec = importlib.util.spec_from_file_location(
                f"triage.{sub}", root / sub / "__init__.py", submodule_search_locations=[str(root / sub)]
            )
            mod = importlib.util.module_from_spec(spec)
            sys.modules[f"triage.{sub}"] = mod
            spec.loader.exec_module(mod)


_ensure_triage()

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.testing import do_bench, do_bench_cudagraph  # noqa: E402

from triage.kernels.nvfp4 import QuantRecipe, gemm_dense, quantize  # noqa: E402
from triage.kernels.nvfp4 import gemm_decode as gd  # noqa: E402
from triage.kernels.nvfp4.matmul import (  # noqa: E402
    expand,
    gemm,
    gemm_reference,
    gemm_w4a16,
    gemm_w4a16_reference,
)

LINES: list[str] = []


def emit(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    y, ref = y.double(), ref.double()
    return float((y - ref).abs().max() / ref.abs().max())


def tflops(M, N, K, ms) -> float:
    return 2 * M * N * K / ms / 1e9


def bench(fn, rep=60) -> float:
    return do_bench(fn, warmup=10, rep=rep, return_mode="median")


def correctness(quick: bool) -> bool:
    emit("## Correctness vs the fp64 reference (out fp32; max|err| / max|ref|)")
    emit("| case | backend | rel err |")
    emit("|---|---|---|")
    ok = True
    shapes = [(1024, 4096, 4096), (5, 4096, 4096), (64, 3000, 1040), (1000, 12288, 4096), (777, 4096, 12288)]
    for M, N, K in shapes[: 3 if quick else None]:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        for recipe in (QuantRecipe(), QuantRecipe(scale="row")):
            a = quantize(x, recipe, emit_expanded=torch.bfloat16)
            b = quantize(w, QuantRecipe(block="16x16") if recipe.scale == "tensor" else recipe)
            same = torch.equal(a.expanded.view(torch.int16), expand(quantize(x, recipe)).view(torch.int16))
            ok &= same
            emit(
                f"| emit_expanded == expand(quantize(x)) {M}x{K} scale={recipe.scale} | - | {'ok' if same else 'FAIL'} |"
            )
            ref = gemm_reference(a, b, out_dtype=torch.float64)
            for backend in ("triton", "cublas", "fused"):
                out = torch.full((M, N), float("nan"), device="cuda")
                y = gemm(a, b, out_dtype=torch.float32, backend=backend, out=out)
                err = rel(y, ref) if not torch.isnan(y).any() else float("nan")
                ok &= err < 1e-5
                emit(f"| W4A4 {M}x{N}x{K} scale={recipe.scale} | {backend} | {err:.2e} |")
            refw = gemm_w4a16_reference(x, b, out_dtype=torch.float64)
            for backend in ("triton", "cublas"):
                y = gemm_w4a16(x, b, out_dtype=torch.float32, backend=backend)
                err = rel(y, refw)
                ok &= err < 1e-5
                emit(f"| W4A16 {M}x{N}x{K} scale={recipe.scale} | {backend} | {err:.2e} |")
    # bf16 output of the alpha path: within one bf16 rounding of the reference
    a = quantize(torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16), QuantRecipe())
    b = quantize(torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16), QuantRecipe())
    ref = gemm_reference(a, b, out_dtype=torch.float64)
    for backend in ("triton", "cublas"):
        y = gemm(a, b, backend=backend).double()
        bad = int(((y - ref).abs() > ref.abs() * 2.0**-8 * 1.01 + 2.0**-20 * ref.abs().max()).sum())
        ok &= bad == 0
        emit(f"| W4A4 bf16 out within 1/2 ulp (+slack) 512x1024x2048 | {backend} | {bad} elements off |")
    # NaN block scale must give a NaN row (GPU cvt e4m3 0x7F -> NaN)
    for M in (32, 100):
        a = quantize(torch.randn(M, 256, device="cuda"), QuantRecipe())
        b = quantize(torch.randn(64, 256, device="cuda"), QuantRecipe())
        sc = a.scale.view(torch.uint8).clone()
        sc[3, 2] = 0x7F
        a.scale = sc.view(torch.float8_e4m3fn)
        for backend in ("triton", "cublas", "fused"):
            y = gemm(a, b, out_dtype=torch.float32, backend=backend)
            good = bool(torch.isnan(y[3]).all()) and not bool(torch.isnan(y[[0, 1, 2, 4]]).any())
            ok &= good
            emit(f"| NaN block scale -> NaN row only, M={M} | {backend} | {'ok' if good else 'FAIL'} |")
    emit(f"CORRECTNESS: {'ok' if ok else 'FAIL'}")
    emit()
    return ok


DENSE_CONFIGS = [
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, SPLIT_K=1, num_warps=8, num_stages=3),
    dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, SPLIT_K=1, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, SPLIT_K=1, num_warps=8, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, SPLIT_K=1, num_warps=4, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, SPLIT_K=1, num_warps=8, num_stages=2),
]


def w4a4_forward(quick: bool, sweep: bool) -> None:
    emit("## W4A4 forward vs cuBLAS bf16 (operands quantized, activation with emit_expanded; weight cached)")
    emit("| M×N×K | impl | ms | TFLOP/s | time / bf16 |")
    emit("|---|---|---|---|---|")
    for M, N, K in [(16384, 4096, 4096), (16384, 12288, 4096), (16384, 4096, 12288)]:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        amax = float(x.float().abs().amax())
        static = QuantRecipe(scale_source="static", static_amax=amax)
        a_dyn = quantize(x, QuantRecipe(), emit_expanded=torch.bfloat16)
        a_st = quantize(x, static, emit_expanded=torch.bfloat16)
        a_row = quantize(x, QuantRecipe(scale="row"), emit_expanded=torch.bfloat16)
        b = quantize(w, QuantRecipe(block="16x16"))
        wb = expand(b)
        gb = float(b.global_scale)
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        ms_bf16 = bench(lambda: torch.mm(x, w.T, out=out))
        rows = [("cuBLAS bf16 (x·wᵀ)", ms_bf16)]
        rows.append(
            ("cublas alpha, static act scale (no sync)",
             bench(lambda: gemm(a_st, b, backend="cublas", b_expanded=wb, b_scale_host=gb, out=out)))
        )  # fmt: skip
        rows.append(
            ("cublas alpha, dynamic act scale (1 sync)",
             bench(lambda: gemm(a_dyn, b, backend="cublas", b_expanded=wb, b_scale_host=gb, out=out)))
        )  # fmt: skip
        rows.append(
            ("triton GEMM on expansions, per-tensor scales",
             bench(lambda: gemm(a_dyn, b, backend="triton", b_expanded=wb, out=out)))
        )  # fmt: skip
        rows.append(
            ("triton GEMM on expansions, per-row act scale",
             bench(lambda: gemm(a_row, b, backend="triton", b_expanded=wb, out=out)))
        )  # fmt: skip
        rows.append(
            (
                "  part: quantize(x) + emit_expanded (dynamic)",
                bench(lambda: quantize(x, QuantRecipe(), emit_expanded=torch.bfloat16)),
            )
        )
        a_plain = quantize(x, QuantRecipe())
        rows.append(
            ("  part: quantize(x) (dynamic, no expansion)", bench(lambda: quantize(x, QuantRecipe())))
        )
        rows.append(("  part: expand(a) (bandwidth kernel)", bench(lambda: expand(a_plain))))
        rows.append(
            ("full fwd: quantize(x, static, expanded) + cublas alpha",
             bench(lambda: gemm(quantize(x, static, emit_expanded=torch.bfloat16), b, backend="cublas",
                                b_expanded=wb, b_scale_host=gb, out=out)))
        )  # fmt: skip
        rows.append(
            ("full fwd: quantize(x, dynamic, expanded) + triton",
             bench(lambda: gemm(quantize(x, QuantRecipe(), emit_expanded=torch.bfloat16), b, backend="triton",
                                b_expanded=wb, out=out)))
        )  # fmt: skip
        if sweep:
            ga, gbt = a_dyn.global_scale.reshape(1), b.global_scale.reshape(1)
            xa = a_dyn.expanded
            for i, cfg in enumerate(DENSE_CONFIGS):
                try:
                    ms = bench(
                        lambda cfg=cfg: gemm_dense.launch_gemm(
                            xa, None, wb, None, K, out, ga, gbt, None, config=cfg
                        )
                    )
                    rows.append(
                        (f"  sweep triton dense {cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} "
                         f"w{cfg['num_warps']}s{cfg['num_stages']}", ms)
                    )  # fmt: skip
                except Exception as e:  # a config that does not compile or fit in shared memory
                    rows.append((f"  cfg{i} failed: {type(e).__name__}: {str(e)[:80]}", float("nan")))
        for name, ms in rows:
            emit(f"| {M}×{N}×{K} | {name} | {ms:.3f} | {tflops(M, N, K, ms):.0f} | {ms / ms_bf16:.2f} |")
    emit()


DECODE_CONFIGS = [
    dict(BN=bn, NB=nb, num_warps=w, num_stages=st, PREFETCH=False)
    for (bn, nb, w) in [(64, 16, 2), (64, 16, 4), (64, 32, 2), (32, 32, 2), (128, 16, 4)]
    for st in (2, 3, 4)
] + [dict(BN=64, NB=8, num_warps=2, num_stages=1, PREFETCH=False)]  # fmt: skip
DECODE_SPLITS = (4, 8, 16, 32)
# (Why these tiles: in a wider sweep, 2-warp mma.sync tiles with a 3-stage cp.async pipeline were fastest;
# the loads-only probe kernel (this script at commit 822f5db, not kept) said the kernel needs more bytes in
# flight, hence the deeper / wider K steps here. With the split-K reduction folded into the kernel a higher
# split costs no second launch, hence splits 4..32 and 4 warps at 64x256.)


@contextlib.contextmanager
def two_kernel_splitk():
    """Decode launches inside take the two-kernel split-K path (the baseline of the fused reduction)."""
    launch = gd.launch_decode
    gd.launch_decode = functools.partial(launch, fused_reduce=False)
    try:
        yield
    finally:
        gd.launch_decode = launch


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    it = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(it), b.view(it))


def decode_graph_replays(x, b, K, gw, replays: int = 50) -> str:
    """The fused split-K decode captured in a CUDA graph and replayed: every replay rewrites the (poisoned)
    output with the two-kernel path's bits, and the ticket counters are back at zero afterwards."""
    M, N = x.shape[0], b.data.shape[0]
    ref = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    with two_kernel_splitk():
        gd.launch_decode(x, b.data, b.scale, K, ref, None, gw, None)
    out = torch.empty_like(ref)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (compiles; allocates the counters)
        gd.launch_decode(x, b.data, b.scale, K, out, None, gw, None)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gd.launch_decode(x, b.data, b.scale, K, out, None, gw, None)
    same = True
    for _ in range(replays):
        out.fill_(float("nan"))
        g.replay()
        same &= same_bits(out, ref)
    zero = not bool(gd.splitk_counters(out.device, 1).any())
    return f"{replays} graph replays == two-kernel bits: {same}, counters zero: {zero} -> {'ok' if same and zero else 'FAIL'}"


#: Qwen3 (hidden, intermediate, query heads, KV heads), head_dim 128
QWEN3 = {"0.6B": (1024, 3072, 16, 8), "1.7B": (2048, 6144, 16, 8), "4B": (2560, 9728, 32, 8), "8B": (4096, 12288, 32, 8)}


def qwen3_shapes():
    """``(model, layer, N, K)`` of each distinct Linear shape of the :data:`QWEN3` models (the first layer of
    each shape named)."""
    seen = set()
    for model, (h, i, nq, nkv) in QWEN3.items():
        for layer, (n, k) in {"q": (nq * 128, h), "k/v": (nkv * 128, h), "o": (h, nq * 128), "gate/up": (i, h),
                              "down": (h, i)}.items():  # fmt: skip
            if (n, k) not in seen:
                seen.add((n, k))
                yield model, layer, n, k


@triton.jit
def _one_store(out_ptr):
    """The smallest useful kernel: one program stores one value (the launch floor of :func:`floor`)."""
    tl.store(out_ptr, 1.0)


def floor() -> None:
    """The per-launch floor inside a CUDA graph, µs: a one-store Triton kernel and cuBLAS's 1×64×64 bf16
    ``torch.mm`` (both timed as the shapes below are). A GEMM cannot take less; a speed-up over bf16 of r at a
    shape needs bf16's time ≥ r × this floor."""
    out = torch.empty(1, device="cuda")
    x = torch.randn(1, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    t_triton = 1e3 * do_bench_cudagraph(lambda: _one_store[(1,)](out))
    t_mm = 1e3 * do_bench_cudagraph(lambda: torch.mm(x, w.T))
    emit(
        f"Launch floor in a CUDA graph: one-store Triton kernel {t_triton:.2f} µs, torch.mm 1×64×64 {t_mm:.2f} µs"
    )


def decode_shapes(sweep: bool = False) -> None:
    """Each distinct (N, K) of the Qwen3 dense models' Linears, M = 1 and 16, CUDA-graph µs; ``sweep``: then
    the W4A16 decode kernel at each shape with every split-K of :data:`SHAPE_SPLITS` and tile rows of
    :data:`SHAPE_BNS` (outputs checked against the reference): the BN = 64 splits with the default marked,
    and the fastest split at each BN."""
    floor()
    emit("## Decode at every Qwen3 0.6B–8B Linear shape (CUDA-graph µs; W4A4 + q = with the activation's quantize)")
    emit("| model | layer | N×K | M | bf16 | W4A16 | W4A4 | W4A4 + q | bf16/W4A16 | bf16/W4A4 | bf16/(W4A4 + q) |")
    emit("|---|---|---|---|---|---|---|---|---|---|---|")
    act = QuantRecipe(scale="row", profile="compressed-tensors")  # the sampler copy's recipe, weights and inputs
    sweeps = []
    for model, layer, n, k in qwen3_shapes():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        b = quantize(w, act)
        for m in (1, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            a = quantize(x, act, emit_expanded=torch.float16)
            err = rel(gemm(a, b, out_dtype=torch.float32), gemm_reference(a, b, out_dtype=torch.float64))
            assert err < 1e-5, (model, layer, m, err)
            t = [
                do_bench_cudagraph(f) * 1e3
                for f in (
                    lambda: torch.mm(x, w.T),
                    lambda: gemm_w4a16(x, b, backend="triton"),
                    lambda: gemm(a, b, backend="triton"),
                    lambda: gemm(quantize(x, act, emit_expanded=torch.float16), b, backend="triton"),
                )
            ]
            emit(f"| {model} | {layer} | {n}×{k} | {m} | " + " | ".join(f"{v:.1f}" for v in t)
                 + f" | {t[0] / t[1]:.2f} | {t[0] / t[2]:.2f} | {t[0] / t[3]:.2f} |")  # fmt: skip
            if sweep:
                sweeps.append((n, k, m, t[0], _split_sweep(x, b)))
    if sweep:
        emit("\n## Split-K and tile rows at each shape (W4A16 decode kernel, CUDA-graph µs; * = the default)")
        emit("| N×K | M | bf16 | " + " | ".join(f"split {s}" for s in SHAPE_SPLITS)
             + " | " + " | ".join(f"best BN={bn}" for bn in SHAPE_BNS) + " | bf16/best |")  # fmt: skip
        emit("|---|---|---|" + "---|" * (len(SHAPE_SPLITS) + len(SHAPE_BNS)) + "---|")
        for n, k, m, t_bf16, (times, default) in sweeps:
            cells = []
            for sp in SHAPE_SPLITS:
                t = times.get((64, sp))
                cells.append("-" if t is None else f"{t:.1f}{'*' if (64, sp) == default else ''}")
            for bn in SHAPE_BNS:
                mine = {sp: t for (b_, sp), t in times.items() if b_ == bn}
                best = min(mine, key=mine.get) if mine else None
                cell = "-" if best is None else f"{mine[best]:.1f} (split {best})"
                if bn != 64 and default[0] == bn and default in times:  # the default outside the BN = 64 columns
                    cell += f"; default split {default[1]}: {times[default]:.1f}*"
                cells.append(cell)
            emit(f"| {n}×{k} | {m} | {t_bf16:.1f} | " + " | ".join(cells)
                 + f" | {t_bf16 / min(times.values()):.2f} |")  # fmt: skip


def decode_groups() -> None:
    """The sibling groups of the Qwen3 dense models (q/k/v, gate/up) at M = 1 and 16, CUDA-graph µs: each
    member its own W4A16 decode launch (summed in one graph) against one group launch
    (``launch_decode_group``), beside bf16 ``torch.mm`` per member and on the concatenated weight (what an
    engine with a fused ``qkv_proj`` runs). Checked first: the group's outputs are the lone launches' bits
    with the group's tiles and split, and within fp32 rounding of the fp64 reference."""
    emit("## Sibling groups: one decode launch per group (CUDA-graph µs, W4A16, the sampler copy's recipe)")
    emit("| model | group | N×K | M | bf16 mm each | bf16 mm fused | W4A16 each | W4A16 group | each/group | "
         "bf16 each/group | check |")  # fmt: skip
    emit("|---|---|---|---|---|---|---|---|---|---|---|")
    act = QuantRecipe(scale="row", profile="compressed-tensors")
    for model, (h, i, nq, nkv) in QWEN3.items():
        for name, widths in (("q/k/v", (nq * 128, nkv * 128, nkv * 128)), ("gate/up", (i, i))):
            ws = [torch.randn(n, h, device="cuda", dtype=torch.bfloat16) * 0.02 for n in widths]
            qs = [quantize(w, act) for w in ws]
            fused_w = torch.cat(ws)
            for m in (1, 16):
                x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
                cfg = gd.decode_config(m, sum(widths), h)
                outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for n in widths]
                members = [(q.data, q.scale, o, q.global_scale.reshape(-1), None) for q, o in zip(qs, outs)]
                gd.launch_decode_group(x, members, h, None)
                same = True
                for q, o in zip(qs, outs):
                    lone = torch.empty_like(o)
                    gd.launch_decode(x, q.data, q.scale, h, lone, None, q.global_scale.reshape(-1), None,
                                     config=dict(cfg))  # fmt: skip
                    same &= same_bits(o, lone)
                err = max(rel(o.float(), gemm_w4a16_reference(x, q, out_dtype=torch.float64))
                          for q, o in zip(qs, outs))  # fmt: skip
                ok = same and err < 1e-2  # bf16 outputs: one rounding

                def each_bf16():
                    for w in ws:
                        torch.mm(x, w.T)

                def each_w4a16():
                    for q in qs:
                        gemm_w4a16(x, q, backend="triton")

                t = [
                    do_bench_cudagraph(f) * 1e3
                    for f in (each_bf16, lambda: torch.mm(x, fused_w.T), each_w4a16,
                              lambda: gd.launch_decode_group(x, members, h, None))
                ]  # fmt: skip
                emit(f"| {model} | {name} | {sum(widths)}×{h} | {m} | " + " | ".join(f"{v:.1f}" for v in t)
                     + f" | {t[2] / t[3]:.2f} | {t[0] / t[3]:.2f} | {'ok' if ok else 'FAIL'} (err {err:.1e}, "
                     f"lone bits {same}) |")  # fmt: skip


#: ``decode_variants``: tile and code variants of the W4A16 decode kernel, as config overrides of the default.
DECODE_VARIANTS = {
    "default": {},
    "4 stages": dict(num_stages=4),
    "BN 32": dict(BN=32),
    "BN 32, 1 warp": dict(BN=32, num_warps=1),
    "BN 128, 4 warps": dict(BN=128, num_warps=4),
}


def decode_variants() -> None:
    """The launches of one Qwen3-4B / 8B decoder layer as the sampler copy runs them (q/k/v and gate/up as
    groups, o and down alone), W4A16, M = 1 and 16, CUDA-graph µs, under each of :data:`DECODE_VARIANTS`:
    every variant's outputs checked first (the default's bits where the split, tile rows and warps are the
    default's, else within bf16 rounding of the fp64 reference). Each launch is timed warm (one weight,
    replayed: it may stay in L2) and per layer cold (:func:`cold_us`: the four launches of distinct layer
    copies back to back, as a model's layers run), beside bf16's seven ``torch.mm`` timed the same ways. Each
    split launch zeroes its own counters (a memset node), unlike the sampler's graph (one memset)."""
    emit("## Decode kernel variants (W4A16, one decoder layer's launches, CUDA-graph µs)")
    emit("| model | M | launch | N×K | bf16 mm | " + " | ".join(DECODE_VARIANTS) + " |")
    emit("|---|---|---|---|---|" + "---|" * len(DECODE_VARIANTS))
    act = QuantRecipe(scale="row", profile="compressed-tensors")
    for model in ("4B", "8B"):
        h, i, nq, nkv = QWEN3[model]
        launches = {"q/k/v": ((nq * 128, nkv * 128, nkv * 128), h), "o": ((h,), nq * 128),
                    "gate/up": ((i, i), h), "down": ((h,), i)}  # fmt: skip
        params = sum(sum(widths) * k for widths, k in launches.values())
        copies_q, copies_bf16 = cold_copies(params * 0.5625), cold_copies(params * 2)
        for m in (1, 16):
            xs = {n: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for n, (_, k) in launches.items()}
            layers = []  # copies_q layer copies: {launch: (qs, outs, members)}
            for _ in range(copies_q):
                layer = {}
                for name, (widths, k) in launches.items():
                    qs = [quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, act)
                          for n in widths]  # fmt: skip
                    outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for n in widths]
                    layer[name] = (qs, outs, [(q.data, q.scale, o, q.global_scale.reshape(-1), None)
                                              for q, o in zip(qs, outs)])  # fmt: skip
                layers.append(layer)

            def call(layer, name, cfg):
                qs, outs, members = layer[name]
                k = launches[name][1]
                if len(qs) == 1:
                    gd.launch_decode(xs[name], qs[0].data, qs[0].scale, k, outs[0], None, members[0][3], None,
                                     config=dict(cfg))  # fmt: skip
                else:
                    gd.launch_decode_group(xs[name], members, k, None, config=dict(cfg))

            bases = {name: gd.decode_config(m, sum(widths), k) for name, (widths, k) in launches.items()}
            cfgs = {}  # variant -> {launch: config}, None where a launch failed
            totals = dict.fromkeys(DECODE_VARIANTS, 0.0)
            total_bf16 = 0.0
            for name, (widths, k) in launches.items():
                qs, outs, _ = layers[0][name]
                x = xs[name]
                call(layers[0], name, bases[name])
                ref = [o.clone() for o in outs]
                cells = []
                for variant, over in DECODE_VARIANTS.items():
                    cfg = dict(bases[name], **over)
                    if cfg["SPLIT_K"] == "x2":
                        cfg["SPLIT_K"] = bases[name]["SPLIT_K"] * 2
                    try:
                        for o in outs:
                            o.fill_(float("nan"))
                        call(layers[0], name, cfg)
                        if all(cfg[c] == bases[name][c] for c in ("SPLIT_K", "BN", "num_warps")):  # same sums
                            ok = all(same_bits(o, r) for o, r in zip(outs, ref))
                        else:
                            ok = max(rel(o.float(), gemm_w4a16_reference(x, q, out_dtype=torch.float64))
                                     for q, o in zip(qs, outs)) < 1e-2  # fmt: skip
                        t = 1e3 * do_bench_cudagraph(lambda cfg=cfg: call(layers[0], name, cfg))
                        totals[variant] += t
                        cells.append(f"{t:.1f}" + ("" if ok else " FAIL"))
                        if cfgs.get(variant, {}) is not None:
                            cfgs.setdefault(variant, {})[name] = cfg
                    except Exception as ex:  # noqa: BLE001
                        totals[variant] = float("nan")
                        cfgs[variant] = None
                        cells.append(f"{type(ex).__name__}: {str(ex)[:60]}")
                ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for n in widths]
                tb = 1e3 * do_bench_cudagraph(lambda: [torch.mm(x, w.T) for w in ws])
                total_bf16 += tb
                emit(f"| {model} | {m} | {name} | {sum(widths)}×{k} | {tb:.1f} | " + " | ".join(cells) + " |")
            emit(f"| {model} | {m} | **layer, warm** | | {total_bf16:.1f} | "
                 + " | ".join(f"**{t:.1f}**" for t in totals.values()) + " |")  # fmt: skip
            bf16_layers = [
                [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for widths, k in launches.values()
                 for n in widths]
                for _ in range(copies_bf16)
            ]  # fmt: skip
            x_bf16 = _bf16_inputs(xs, launches)
            cold_bf16 = cold_us([lambda ws=ws: [torch.mm(x, w.T) for x, w in zip(x_bf16, ws)] for ws in bf16_layers])
            cold = []
            for variant in DECODE_VARIANTS:
                per = cfgs.get(variant)
                if per is None:
                    cold.append("-")
                    continue
                t = cold_us([lambda layer=layer, per=per: [call(layer, n, per[n]) for n in launches] for layer in layers])
                cold.append(f"**{t:.1f}**")
            emit(f"| {model} | {m} | **layer, cold** ({copies_q} / {copies_bf16} copies) | | **{cold_bf16:.1f}** | "
                 + " | ".join(cold) + " |")  # fmt: skip
            layers = bf16_layers = None
            torch.cuda.empty_cache()


def _bf16_inputs(xs: dict, launches: dict) -> list:
    """x of each bf16 Linear of a layer (each member of a group reads its launch's x), in launch order."""
    return [xs[name] for name, (widths, _) in launches.items() for _ in widths]


#: Bytes of distinct weights a cold-L2 timing streams per replay: well above the L2 of an H100 / H200 (50 MB).
COLD_BYTES = 256 << 20


def cold_copies(nbytes: float) -> int:
    """Weight copies of ``nbytes`` each that make a cold-L2 timing stream :data:`COLD_BYTES` (at least 2)."""
    return max(2, int(-(-COLD_BYTES // nbytes)))


def cold_weights(n: int, k: int, recipe) -> tuple[list, list]:
    """Random [n, k] weights for cold-L2 timings: :func:`cold_copies` bf16 copies and as many NVFP4 copies
    (quantized with ``recipe``) as stream :data:`COLD_BYTES` at 0.5625 bytes per weight."""
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(cold_copies(n * k * 2))]
    qs = [quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, recipe)
          for _ in range(cold_copies(n * k * 0.5625))]  # fmt: skip
    return ws, qs


def cold_us(calls) -> float:
    """µs per call of ``calls`` (each on its own weight copy) replayed back to back in one CUDA graph: every
    call finds its weights out of L2, as a model's layers do (``do_bench_cudagraph`` replays one graph; a
    single weight of less than the L2 stays cached from one replay to the next)."""
    return 1e3 * do_bench_cudagraph(lambda: [c() for c in calls]) / len(calls)


def decode_cold() -> None:
    """Each distinct (N, K) of the Qwen3 0.6B–8B Linears, M = 1 and 16, W4A16 decode kernel and bf16
    ``torch.mm``, CUDA-graph µs timed warm (one weight replayed, as ``decode-shapes`` times it: a weight that
    fits in L2 is read from L2) and cold (:func:`cold_us` over :func:`cold_copies` distinct weights: read from
    memory, as in a model). W4A16 outputs checked against the fp64 reference first."""
    emit("## Decode GEMV with warm and cold L2 (CUDA-graph µs; cold = distinct weight copies back to back)")
    emit("| model | layer | N×K | M | bf16 warm | bf16 cold | W4A16 warm | W4A16 cold | bf16/W4A16 warm "
         "| bf16/W4A16 cold |")  # fmt: skip
    emit("|---|---|---|---|---|---|---|---|---|---|")
    act = QuantRecipe(scale="row", profile="compressed-tensors")
    for model, layer, n, k in qwen3_shapes():
        ws, qs = cold_weights(n, k, act)
        for m in (1, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            err = rel(gemm_w4a16(x, qs[0], backend="triton", out_dtype=torch.float32),
                      gemm_w4a16_reference(x, qs[0], out_dtype=torch.float64))  # fmt: skip
            assert err < 1e-5, (model, layer, m, err)
            t = [
                1e3 * do_bench_cudagraph(lambda: torch.mm(x, ws[0].T)),
                cold_us([lambda w=w: torch.mm(x, w.T) for w in ws]),
                1e3 * do_bench_cudagraph(lambda: gemm_w4a16(x, qs[0], backend="triton")),
                cold_us([lambda q=q: gemm_w4a16(x, q, backend="triton") for q in qs]),
            ]
            emit(f"| {model} | {layer} | {n}×{k} | {m} | " + " | ".join(f"{v:.1f}" for v in t)
                 + f" | {t[0] / t[2]:.2f} | {t[1] / t[3]:.2f} |")  # fmt: skip
        ws = qs = None
        torch.cuda.empty_cache()


#: Qwen3-4B's Linear shapes (N, K) and the prompt rows (M > SMALL_M) that ``w4a16-prefill`` times.
PREFILL_SHAPES = {"q": (4096, 2560), "k/v": (1024, 2560), "o": (2560, 4096), "gate/up": (9728, 2560),
                  "down": (2560, 9728)}  # fmt: skip
PREFILL_MS = (64, 128, 256, 512, 1024, 2048)


def w4a16_prefill() -> None:
    """W4A16 above 64 rows (a sampler's prefill: batch × prompt width rows) at Qwen3-4B's shapes, cold L2
    (:func:`cold_us`), CUDA-graph µs: bf16 ``torch.mm``; ``auto`` (the default route: the decode kernel up to
    ``W4A16_UNPACK_MAX_M`` rows; above, expand the weight, then the Triton GEMM with the per-row scales in its
    epilogue); the expand alone; ``cublas``
    (expand, cuBLAS with an fp32 output, the scales applied by torch); ``fused`` (packed weight unpacked in
    the GEMM's inner loop). Outputs checked against the fp64 reference first."""
    emit("## W4A16 at prefill rows, Qwen3-4B shapes (cold L2, CUDA-graph µs)")
    emit("| layer | N×K | M | bf16 | W4A16 auto | expand alone | W4A16 cublas | W4A16 fused | bf16/auto "
         "| bf16/cublas | bf16/fused |")  # fmt: skip
    emit("|---|---|---|---|---|---|---|---|---|---|---|")
    act = QuantRecipe(scale="row", profile="compressed-tensors")
    for layer, (n, k) in PREFILL_SHAPES.items():
        ws, qs = cold_weights(n, k, act)
        for m in PREFILL_MS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = gemm_w4a16_reference(x, qs[0], out_dtype=torch.float64)
            for backend in ("auto", "cublas", "fused"):
                err = rel(gemm_w4a16(x, qs[0], backend=backend, out_dtype=torch.float32), ref)
                assert err < 1e-5, (layer, m, backend, err)
            t = [
                cold_us([lambda w=w: torch.mm(x, w.T) for w in ws]),
                cold_us([lambda q=q: gemm_w4a16(x, q) for q in qs]),
                cold_us([lambda q=q: expand(q) for q in qs]),
                cold_us([lambda q=q: gemm_w4a16(x, q, backend="cublas") for q in qs]),
                cold_us([lambda q=q: gemm_w4a16(x, q, backend="fused") for q in qs]),
            ]
            emit(f"| {layer} | {n}×{k} | {m} | " + " | ".join(f"{v:.1f}" for v in t)
                 + f" | {t[0] / t[1]:.2f} | {t[0] / t[3]:.2f} | {t[0] / t[4]:.2f} |")  # fmt: skip
        ws = qs = None
        torch.cuda.empty_cache()


#: ``dense-mid``: the candidate tiles timed beside the default (each with :func:`gemm_dense.mid_split`'s split-K)
MID_CANDIDATES = {
    "128x128 w8 s3": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    "128x64 w4 s4": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    "64x64 w4 s4": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
}


def dense_mid() -> None:
    """The dense (expanded-operand) Triton GEMM alone at prefill rows, Qwen3-4B shapes, cold L2, CUDA-graph µs:
    cuBLAS bf16 ``torch.mm`` on the same bf16 operands (the peer), the pointer kernel's default tiles
    (``MID_CONFIGS`` up to 2,048 rows, with their split-K; on sm_90+ the library runs the TMA kernel at most of
    these shapes: section ``dense-tma``), the large-M ``DENSE_CONFIG`` (split 1) and :data:`MID_CANDIDATES`.
    Outputs (per-row outer scale in the epilogue) checked against an fp64 matmul first."""
    emit("## Dense Triton GEMM at prefill rows, Qwen3-4B shapes (cold L2, CUDA-graph µs; split-K in brackets)")
    names = ["default", "DENSE_CONFIG", *MID_CANDIDATES]
    emit("| layer | N×K | M | cuBLAS bf16 | " + " | ".join(names) + " | cuBLAS/default | cuBLAS/best |")
    emit("|---|---|---|---|" + "---|" * len(names) + "---|---|")
    for layer, (n, k) in PREFILL_SHAPES.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(cold_copies(n * k * 2))]
        g = torch.rand(n, device="cuda", dtype=torch.float32) + 0.5
        for m in (*PREFILL_MS[1:], 4096):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            default = gemm_dense._tile_config(m, n, k, None)
            configs = {"default": default, "DENSE_CONFIG": dict(gemm_dense.DENSE_CONFIG, SPLIT_K=1)}
            for name, cfg in MID_CANDIDATES.items():
                configs[name] = dict(cfg, SPLIT_K=gemm_dense.mid_split(m, n, k, cfg))
            ref = (x.double() @ ws[0].double().T) * g.double()
            times = {}
            for name, cfg in configs.items():
                out = torch.empty(m, n, device="cuda", dtype=torch.float32)
                gemm_dense.launch_gemm(x, None, ws[0], None, k, out, None, g, None, config=cfg)
                assert rel(out, ref) < 1e-4, (layer, m, name, rel(out, ref))  # fp32 sums of up to 9728 products
                times[name] = cold_us([
                    lambda w=w, cfg=cfg: gemm_dense.launch_gemm(
                        x, None, w, None, k, torch.empty(m, n, device="cuda", dtype=torch.bfloat16), None, g, None,
                        config=cfg,
                    )
                    for w in ws
                ])  # fmt: skip
            peer = cold_us([lambda w=w: torch.mm(x, w.T) for w in ws])
            cells = [f"{times[nm]:.1f} ({configs[nm]['SPLIT_K']})" for nm in names]
            emit(f"| {layer} | {n}×{k} | {m} | {peer:.1f} | " + " | ".join(cells)
                 + f" | {peer / times['default']:.2f} | {peer / min(times.values()):.2f} |")  # fmt: skip
        ws = None
        torch.cuda.empty_cache()


#: ``dense-tma``: tiles of the persistent TMA kernel (``gemm_dense._gemm_tma_kernel``, split 1)
TMA_CANDIDATES = {
    "tma 128x256 w8 s3": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    "tma 128x256 w8 s4": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
    "tma 256x128 w8 s3": dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    "tma 128x128 w8 s4": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
    "tma 128x128 w4 s4": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
}
#: ``dense-tma``: (M, N, K): the learner's large GEMMs (W4A4 GEMM forward), then Qwen3-4B's prefill rows
TMA_SHAPES = [(16384, 4096, 4096), (16384, 12288, 4096), (16384, 4096, 12288), (8192, 2560, 9728),
              (8192, 9728, 2560)] + [(m, n, k) for m in (512, 1024, 2048) for n, k in PREFILL_SHAPES.values()]  # fmt: skip


def dense_tma() -> None:
    """The dense (expanded-operand) GEMM on bf16 operands, per-row outer scale in the epilogue, bf16 output:
    cuBLAS bf16 ``torch.mm`` (the peer), the pointer kernel with its tiles (``_tile_config`` for packed
    operands: masked pointer loads, split-K at mid M) and the persistent TMA kernel with each of
    :data:`TMA_CANDIDATES` (split 1). Every output checked against an fp64 matmul first, and each TMA tile's
    bits against the pointer kernel with the same tiles.
    Large M: ``do_bench`` µs (operands far larger than L2); mid M: cold L2 (:func:`cold_us`)."""
    emit("## Dense GEMM: persistent TMA kernel vs the pointer kernel vs cuBLAS (µs; bits = TMA == pointer, same tiles)")
    names = ["pointer", *TMA_CANDIDATES]
    emit("| M×N×K | cuBLAS bf16 | " + " | ".join(names) + " | cuBLAS/pointer | cuBLAS/best TMA | bits |")
    emit("|---|---|" + "---|" * len(names) + "---|---|---|")
    for m, n, k in TMA_SHAPES:
        cold = m <= 2048
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
              for _ in range(cold_copies(n * k * 2) if cold else 1)]  # fmt: skip
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        g = torch.rand(n, device="cuda", dtype=torch.float32) + 0.5
        ref = (x.double() @ ws[0].double().T) * g.double()
        configs = {"pointer": gemm_dense._tile_config(m, n, k, None)}
        configs.update({nm: dict(c, SPLIT_K=1, TMA=True) for nm, c in TMA_CANDIDATES.items()})
        times, same = {}, True
        for name, cfg in configs.items():
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            try:
                gemm_dense.launch_gemm(x, None, ws[0], None, k, out, None, g, None, config=cfg)
            except Exception as e:  # a configuration that does not compile: reported, skipped
                emit(f"({m}×{n}×{k} {name}: {type(e).__name__}: {str(e)[:160]})")
                continue
            assert rel(out.float(), ref) < 1e-2, (m, n, k, name, rel(out.float(), ref))
            if cfg.get("TMA"):
                twin = torch.empty_like(out)
                gemm_dense.launch_gemm(x, None, ws[0], None, k, twin, None, g, None, config=dict(cfg, TMA=False))
                same &= same_bits(out, twin)

            def run(w, cfg=cfg):
                o = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                gemm_dense.launch_gemm(x, None, w, None, k, o, None, g, None, config=cfg)

            times[name] = cold_us([lambda w=w: run(w) for w in ws]) if cold else 1e3 * do_bench(lambda: run(ws[0]))
        peer = (cold_us([lambda w=w: torch.mm(x, w.T) for w in ws]) if cold
                else 1e3 * do_bench(lambda: torch.mm(x, ws[0].T)))  # fmt: skip
        cells = [f"{times[nm]:.1f}" if nm in times else "-" for nm in names]
        best = min((t for nm, t in times.items() if nm != "pointer"), default=float("nan"))
        emit(f"| {m}×{n}×{k} | {peer:.1f} | " + " | ".join(cells)
             + f" | {peer / times['pointer']:.2f} | {peer / best:.2f} | {'same' if same else 'DIFFER'} |")  # fmt: skip
        ws = None
        torch.cuda.empty_cache()


#: ``decode-mid``: tiles of the decode kernel above 64 rows timed beside the default (``DECODE_CONFIG_MID``),
#: each with ``gemm_decode.decode_split``'s split-K
DECODE_MID_CANDIDATES = {
    "BM128 BN64 w4": dict(BM=128, BN=64, NB=4, num_warps=4, num_stages=1, PREFETCH=True),
    "BM64 BN128 w8": dict(BM=64, BN=128, NB=8, num_warps=8, num_stages=1, PREFETCH=True),
    "BM64 BN64 w4": dict(BM=64, BN=64, NB=8, num_warps=4, num_stages=1, PREFETCH=True),
    # cp.async stages instead of the register prefetch: x reaches the wgmma through shared memory
    "BM64 BN64 w4 s3": dict(BM=64, BN=64, NB=8, num_warps=4, num_stages=3, PREFETCH=False),
    "BM64 BN128 w4 s3": dict(BM=64, BN=128, NB=8, num_warps=4, num_stages=3, PREFETCH=False),
    "BM128 BN64 w4 s3": dict(BM=128, BN=64, NB=8, num_warps=4, num_stages=3, PREFETCH=False),
    "BM128 BN128 w8 s3": dict(BM=128, BN=128, NB=8, num_warps=8, num_stages=3, PREFETCH=False),
    "BM64 BN64 w2 s3": dict(BM=64, BN=64, NB=8, num_warps=2, num_stages=3, PREFETCH=False),  # mma.sync
}


def decode_mid() -> None:
    """W4A16 at prefill rows through the decode kernel (the packed weight unpacked in registers, M in tiles)
    against the default route (expand + dense GEMM) and bf16 ``torch.mm``, Qwen3-4B shapes, cold L2,
    CUDA-graph µs; each configuration's output checked against the fp64 reference first."""
    emit("## W4A16 decode kernel at prefill rows, Qwen3-4B shapes (cold L2, CUDA-graph µs; split-K in brackets)")
    names = ["DECODE_CONFIG_MID", *DECODE_MID_CANDIDATES]
    emit("| layer | N×K | M | bf16 | expand + GEMM | " + " | ".join(names) + " | bf16/expand route | bf16/best |")
    emit("|---|---|---|---|---|" + "---|" * len(names) + "---|---|")
    act = QuantRecipe(scale="row", profile="compressed-tensors")
    for layer, (n, k) in PREFILL_SHAPES.items():
        ws, qs = cold_weights(n, k, act)
        for m in PREFILL_MS[1:-1]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = gemm_w4a16_reference(x, qs[0], out_dtype=torch.float64)
            configs = {"DECODE_CONFIG_MID": gd.decode_config(m, n, k)}
            for name, cfg in DECODE_MID_CANDIDATES.items():
                configs[name] = dict(cfg, SPLIT_K=gd.decode_split(m, n, k, cfg))
            times = {}
            for name, cfg in configs.items():
                out = torch.empty(m, n, device="cuda", dtype=torch.float32)
                try:
                    gd.launch_decode(x, qs[0].data, qs[0].scale, k, out, None, qs[0].global_scale.reshape(-1), None,
                                     config=cfg)  # fmt: skip
                except Exception as e:  # a configuration that does not compile: reported, skipped
                    emit(f"({layer} M={m} {name}: {type(e).__name__}: {str(e)[:120]})")
                    continue
                assert rel(out, ref) < 1e-5, (layer, m, name, rel(out, ref))
                times[name] = cold_us([
                    lambda q=q, cfg=cfg: gd.launch_decode(
                        x, q.data, q.scale, k, torch.empty(m, n, device="cuda", dtype=torch.bfloat16), None,
                        q.global_scale.reshape(-1), None, config=cfg,
                    )
                    for q in qs
                ])  # fmt: skip
            t_bf16 = cold_us([lambda w=w: torch.mm(x, w.T) for w in ws])
            t_route = cold_us([  # the expand route: the weight's bf16 q·s, the dense GEMM with the row scales
                lambda q=q: gemm_dense.launch_gemm(
                    x, None, expand(q), None, k, torch.empty(m, n, device="cuda", dtype=torch.bfloat16), None,
                    q.global_scale.reshape(-1), None,
                )
                for q in qs
            ])  # fmt: skip
            cells = [f"{times[nm]:.1f} ({configs[nm]['SPLIT_K']})" if nm in times else "-" for nm in names]
            best = min(times.values()) if times else float("nan")
            emit(f"| {layer} | {n}×{k} | {m} | {t_bf16:.1f} | {t_route:.1f} | " + " | ".join(cells)
                 + f" | {t_bf16 / t_route:.2f} | {t_bf16 / best:.2f} |")  # fmt: skip
        ws = qs = None
        torch.cuda.empty_cache()


#: The split-K factors and tile rows (BN, the weight rows per program; 2 warps, 1 at BN = 16) that
#: ``decode_shapes(sweep=True)`` times at every shape.
SHAPE_SPLITS = (1, 2, 4, 8, 16)
SHAPE_BNS = (16, 32, 64)


def _split_sweep(x: torch.Tensor, b) -> tuple[dict, tuple]:
    """``({(BN, split): µs}, (BN, split) of the default)`` of the W4A16 decode kernel on ``x`` and W_q ``b``,
    each config's output checked against the reference first (a split that leaves < 1 K step per slice is
    skipped; a config that fails to compile or run is reported and skipped)."""
    M, K = x.shape
    N = b.data.shape[0]
    gw = b.global_scale.reshape(-1)
    ref = gemm_w4a16_reference(x, b, out_dtype=torch.float64)
    c0 = gd.decode_config(M, N, K)
    default = (c0["BN"], c0["SPLIT_K"])
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    times = {}
    for bn in SHAPE_BNS:
        for split in SHAPE_SPLITS:
            c = dict(gd.decode_config(M, N, K, split), BN=bn, num_warps=max(1, min(2, bn // 16)))
            if -(-K // 16) < split * c["NB"]:
                continue
            try:
                out32 = torch.full((M, N), float("nan"), device="cuda")
                gd.launch_decode(x, b.data, b.scale, K, out32, None, gw, None, config=dict(c))
                err = rel(out32, ref)
                assert err < 1e-5, (N, K, M, bn, split, err)
                times[(bn, split)] = 1e3 * do_bench_cudagraph(
                    lambda c=c: gd.launch_decode(x, b.data, b.scale, K, out, None, gw, None, config=c)
                )
            except Exception as ex:  # noqa: BLE001
                if isinstance(ex, AssertionError):
                    raise
                emit(f"  ({N}×{K} M={M} BN={bn} split={split}: {type(ex).__name__} {str(ex)[:80]})")
    return times, default


def decode(quick: bool, sweep: bool) -> None:
    emit("## Decode kernel, adversarial weights (every code, e4m3 scales from subnormal to 448, NaN scale)")
    emit("(default path = fused split-K reduction; forced splits 3 and 8 also compared bit for bit with the "
         "two-kernel path)")  # fmt: skip
    for xdtype in (torch.bfloat16, torch.float16):
        for M, N, K in ((1, 256, 4096), (16, 192, 1024), (7, 200, 1040), (16, 100, 4112), (64, 200, 1040)):
            w = quantize(torch.randn(N, K, device="cuda"), QuantRecipe())
            w.data = torch.randint(0, 256, w.data.shape, device="cuda", dtype=torch.uint8)
            sc = torch.randint(0, 0x7F, w.scale.shape, device="cuda", dtype=torch.uint8)
            sc[7, 3] = 0x7F  # NaN block scale: row 7 of the output must be NaN, the rest finite
            w.scale = sc.view(torch.float8_e4m3fn)
            x = torch.randn(M, K, device="cuda").to(xdtype)
            ref = gemm_w4a16_reference(x, w, out_dtype=torch.float64)
            fin = torch.ones(N, dtype=torch.bool, device="cuda")
            fin[7] = False
            ys = [gemm_w4a16(x, w, out_dtype=torch.float32, backend="triton")]
            with two_kernel_splitk():
                same = same_bits(ys[0], gemm_w4a16(x, w, out_dtype=torch.float32, backend="triton"))
            gw = w.global_scale.reshape(-1)
            for split in (3, 8):
                y_f, y_2 = (torch.full((M, N), float("nan"), device="cuda") for _ in range(2))
                gd.launch_decode(x, w.data, w.scale, K, y_f, None, gw, None, split_k=split)
                gd.launch_decode(
                    x, w.data, w.scale, K, y_2, None, gw, None, split_k=split, fused_reduce=False
                )
                same &= same_bits(y_f, y_2)
                ys.append(y_f)
            good = all(
                bool(torch.isnan(y[:, 7]).all()) and not bool(torch.isnan(y[:, fin]).any()) for y in ys
            )
            e = max(rel(y[:, fin], ref[:, fin]) for y in ys)
            emit(f"decode {xdtype} M={M} N={N} K={K}: rel err {e:.2e}, NaN row only: {good}, fused == two-kernel "
                 f"bits: {same} -> {'ok' if good and same and e < 1e-5 else 'FAIL'}")  # fmt: skip
    emit("## Decode (CUDA-graph timings): packed FP4 weights (decode kernel) vs bf16")
    emit("(W4A16 / W4A4: split-K reduction fused into the kernel, the default; '2-kernel': partials summed by a "
         "second launch)")  # fmt: skip
    emit(
        "| M | N×K | bf16 µs | W4A16 µs | W4A16 2-kernel µs | W4A4 µs | W4A4 2-kernel µs | bf16/W4A16 | bf16/W4A4 |"
    )
    emit("|---|---|---|---|---|---|---|---|---|")
    for N, K in [(4096, 12288), (12288, 4096), (4096, 4096)][: 1 if quick else None]:
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        b = quantize(w, QuantRecipe())
        for M in (1, 16, 64):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            a = quantize(x, QuantRecipe(), emit_expanded=torch.float16)
            err = rel(
                gemm_w4a16(x, b, out_dtype=torch.float32), gemm_w4a16_reference(x, b, out_dtype=torch.float64)
            )
            assert err < 1e-5, err
            ref = gemm_w4a16_reference(x, b, out_dtype=torch.float64)
            t_bf16 = do_bench_cudagraph(lambda: torch.mm(x, w.T))
            t_w4a16 = do_bench_cudagraph(lambda: gemm_w4a16(x, b, backend="triton"))
            t_w4a4 = do_bench_cudagraph(lambda: gemm(a, b, backend="triton"))
            with two_kernel_splitk():
                t_w4a16_2k = do_bench_cudagraph(lambda: gemm_w4a16(x, b, backend="triton"))
                t_w4a4_2k = do_bench_cudagraph(lambda: gemm(a, b, backend="triton"))
            emit(
                f"| {M} | {N}×{K} | {t_bf16 * 1e3:.1f} | {t_w4a16 * 1e3:.1f} | {t_w4a16_2k * 1e3:.1f} | "
                f"{t_w4a4 * 1e3:.1f} | {t_w4a4_2k * 1e3:.1f} | {t_bf16 / t_w4a16:.2f} | {t_bf16 / t_w4a4:.2f} |"
            )
            gw = b.global_scale.reshape(1)
            if M in (1, 16) and (N, K) == (4096, 12288):
                emit(f"|   M={M}: {decode_graph_replays(x, b, K, gw)} | | | | | | | |")
                out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
                c0 = gd.decode_config(M, N, K)
                c = dict(c0, SPLIT_K=1)
                t_nosplit = do_bench_cudagraph(
                    lambda c=c: gd.launch_decode(x, b.data, b.scale, K, out, None, gw, None, config=c)
                )
                emit(f"|   M={M} {c0} without split-K: {t_nosplit * 1e3:.1f} µs | | | | | | | |")
            if sweep and M in (1, 16) and (N, K) == (4096, 12288):
                out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
                best = None
                for cfg in DECODE_CONFIGS:
                    for split in DECODE_SPLITS:
                        c = dict(gd.decode_config(M, N, K, split), **cfg, SPLIT_K=split)
                        try:
                            out32 = torch.full((M, N), float("nan"), device="cuda")
                            gd.launch_decode(x, b.data, b.scale, K, out32, None, gw, None, config=dict(c))
                            e = rel(out32, ref)
                            t = do_bench_cudagraph(
                                lambda c=c: gd.launch_decode(
                                    x, b.data, b.scale, K, out, None, gw, None, config=c
                                )
                            )
                            t2 = ""
                            if (
                                cfg == gd.DECODE_CONFIG_M16
                            ):  # the default tile: the two-kernel path next to it
                                c2 = dict(c, FUSED_REDUCE=False)
                                t2 = do_bench_cudagraph(
                                    lambda c2=c2: gd.launch_decode(
                                        x, b.data, b.scale, K, out, None, gw, None, config=c2
                                    )
                                )
                                t2 = f"{t2 * 1e3:.1f}"
                            emit(
                                f"|   sweep M={M} {cfg} split={split} | err {e:.1e} {'ok' if e < 1e-5 else 'FAIL'}"
                                f" | | {t * 1e3:.1f} | {t2} | | | | |"
                            )
                            if e < 1e-5 and (best is None or t < best[0]):
                                best = (t, cfg, split)
                        except Exception as ex:  # noqa: BLE001
                            emit(
                                f"|   sweep {cfg} split={split} failed: {type(ex).__name__} {str(ex)[:60]} |"
                            )
                if best is not None:
                    emit(
                        f"|   **best M={M}** (fused): {best[1]} split={best[2]}: {best[0] * 1e3:.1f} µs, "
                        f"bf16/W4A16 {t_bf16 / best[0]:.2f} | | | | | | | |"
                    )
    emit()


class _StraightThrough(torch.autograd.Function):
    """Fake quantization with a straight-through gradient: forward dequantize(quantize(t)), backward id."""

    @staticmethod
    def forward(ctx, t, recipe):
        from triage.kernels.nvfp4 import dequantize

        return dequantize(quantize(t.detach(), recipe), t.dtype)

    @staticmethod
    def backward(ctx, g):
        return g, None


def linear(quick: bool) -> None:
    from triage.kernels import NVFP4Linear, NVFP4LinearConfig

    emit("## NVFP4Linear forward+backward (bf16-backward, quantization included) vs bf16 nn.Linear")
    emit("| M×N×K | impl | ms | TFLOP/s (3 GEMMs) | throughput / bf16 |")
    emit("|---|---|---|---|---|")

    def fake_quant_linear(x, w):
        xq = _StraightThrough.apply(x, QuantRecipe())
        wq = _StraightThrough.apply(w, QuantRecipe(block="16x16"))
        return torch.nn.functional.linear(xq, wq)

    for M, N, K in [(16384, 4096, 4096), (16384, 12288, 4096), (16384, 4096, 12288)][: 1 if quick else None]:
        ref = torch.nn.Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16)
        # one layer called on one x again and again: share_inputs=False, so that every call quantizes x
        fp4 = NVFP4Linear.from_linear(ref, NVFP4LinearConfig(share_inputs=False))
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)

        def step(fn):
            x.grad = None
            ref.weight.grad = None
            fn(x).backward(dy)

        ms_bf16 = bench(lambda: step(ref))
        rows = [("bf16 nn.Linear", ms_bf16), ("NVFP4Linear (bf16-backward)", bench(lambda: step(fp4)))]
        # other activation recipes: static outer scale (ModelOpt / compressed-tensors checkpoints carry one:
        # one quantize pass, host-known alpha, no sync) and per-row outer scales (Triton GEMM, no sync)
        amax = float(x.detach().abs().amax())
        for label, recipe in (
            ("static activation scale", QuantRecipe(scale_source="static", static_amax=amax)),
            ("per-row activation scale", QuantRecipe(scale="row")),
        ):
            alt = NVFP4Linear.from_linear(ref, NVFP4LinearConfig(activation=recipe, share_inputs=False))
            rows.append((f"NVFP4Linear (bf16-backward), {label}", bench(lambda alt=alt: step(alt))))
        # TE-style quantized backward (dgrad on the NVFP4 GEMM, wgrad operands quantized along the tokens by
        # quantize_columnwise with the Hadamard transform and stochastic rounding)
        te = NVFP4Linear.from_linear(ref, NVFP4LinearConfig(backward="nvfp4-backward"))
        rows.append(("NVFP4Linear (nvfp4-backward)", bench(lambda: step(te))))
        with torch.no_grad():
            rows.append(("  forward only: bf16", bench(lambda: ref(x))))
            rows.append(("  forward only: NVFP4Linear", bench(lambda: fp4(x))))
        rows.append(
            ("fake-quant (Triton quantize+dequantize, straight-through), bf16 mm",
             bench(lambda: step(lambda t: fake_quant_linear(t, ref.weight))))
        )  # fmt: skip
        for name, ms in rows:
            emit(f"| {M}×{N}×{K} | {name} | {ms:.3f} | {tflops(M, N, K, ms) * 3:.0f} | {ms_bf16 / ms:.2f} |")
    emit()
    emit(nvfp4_backward_check())
    emit()


def nvfp4_backward_check(M: int = 1000, N: int = 384, K: int = 512) -> str:
    """nvfp4-backward gradients with the Triton quantizers (columnwise wgrad operands) against the same layer
    with the torch reference quantizers: identical quantized bytes, so only fp32 accumulation order differs."""
    from triage.kernels import NVFP4Linear, NVFP4LinearConfig

    torch.manual_seed(3)
    ref = torch.nn.Linear(K, N, bias=True, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)  # M % 16 != 0: the wgrad pads the tokens
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    grads = []
    for qb in ("triton", "torch"):
        layer = NVFP4Linear.from_linear(ref, NVFP4LinearConfig(backward="nvfp4-backward", quant_backend=qb))
        xi = x.clone().requires_grad_(True)
        ref.weight.grad = None
        layer(xi).backward(dy)
        grads.append((xi.grad.double(), layer.weight.grad.double()))
    errs = [float((a - b).abs().max() / b.abs().max()) for a, b in zip(grads[0], grads[1])]
    ok = all(e < 1e-5 for e in errs)
    return (
        f"nvfp4-backward {M}×{N}×{K}, Triton vs torch quantizers: dx rel err {errs[0]:.1e}, "
        f"dW rel err {errs[1]:.1e} -> {'ok' if ok else 'FAIL'}"
    )


def cache_check(quick: bool) -> bool:
    """Section 5 (module docstring): the quantized-weight caches follow every optimizer on CUDA."""
    from torch import nn

    from triage.kernels import NVFP4Linear, NVFP4LinearConfig
    from triage.kernels.linear import invalidate_weight_caches
    from triage.kernels.moe.experts import NVFP4MoEConfig, NVFP4MoeExperts

    emit("## Weight cache under optimizers (CUDA; output == freshly converted layer, bit for bit)")
    emit("| layer | optimizer | steps equal |")
    emit("|---|---|---|")
    opts = {
        "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
        "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
        "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    }
    ok = True

    def fresh_linear(layer):
        lin = nn.Linear(layer.in_features, layer.out_features, device="cuda", dtype=layer.weight.dtype)
        with torch.no_grad():
            lin.weight.copy_(layer.weight)
            lin.bias.copy_(layer.bias)
        return NVFP4Linear.from_linear(lin, layer.config)

    class Experts(nn.Module):
        def __init__(self, e=8, h=512, i=256):
            super().__init__()
            self.num_experts, self.hidden_dim, self.intermediate_dim = e, h, i
            self.gate_up_proj = nn.Parameter(torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) * 0.05)
            self.down_proj = nn.Parameter(torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) * 0.05)
            self.act_fn = nn.SiLU()

    def fresh_experts(m):
        e = Experts()
        with torch.no_grad():
            e.gate_up_proj.copy_(m.gate_up_proj)
            e.down_proj.copy_(m.down_proj)
        return NVFP4MoeExperts(e, m.config)

    for backward in ("bf16-backward", "nvfp4-backward"):
        for name, make in opts.items():
            torch.manual_seed(0)
            config = NVFP4LinearConfig(backward=backward)
            layer = NVFP4Linear(1024, 512, config=config, device="cuda", dtype=torch.bfloat16)
            opt = make(layer.parameters())
            x = torch.randn(300, 1024, device="cuda", dtype=torch.bfloat16)  # large-M path (cached expansion)
            xs = x[:8]  # decode path (packed weight)
            equal = []
            for _ in range(3):
                layer(x).float().square().mean().backward()
                opt.step()
                opt.zero_grad()
                with torch.no_grad():
                    ref = fresh_linear(layer)
                    equal.append(torch.equal(layer(x), ref(x)) and torch.equal(layer(xs), ref(xs)))
            ok &= all(equal)
            emit(f"| NVFP4Linear {backward} | {name} | {equal} |")
    idx = torch.randint(0, 8, (256, 2), device="cuda")
    w = torch.rand(256, 2, device="cuda", dtype=torch.bfloat16)
    for backward in ("bf16-backward", "nvfp4-backward"):
        for name, make in opts.items():
            torch.manual_seed(0)
            cfg = NVFP4MoEConfig(backward=backward, weight=QuantRecipe(scale="expert", block="16x16"))
            experts = NVFP4MoeExperts(Experts(), cfg)
            opt = make(experts.parameters())
            x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
            equal = []
            for _ in range(3):
                experts(x, idx, w).float().square().mean().backward()
                opt.step()
                opt.zero_grad()
                with torch.no_grad():
                    equal.append(torch.equal(experts(x, idx, w), fresh_experts(experts)(x, idx, w)))
            ok &= all(equal)
            emit(f"| NVFP4MoeExperts {backward} | {name} | {equal} |")
    emit()
    emit("| forward (bf16, NVFP4Linear) | W_q cached (ms) | W re-quantized (ms) |")
    emit("|---|---|---|")
    shapes = [(16384, 4096, 4096), (1, 4096, 4096)] if not quick else [(16384, 4096, 4096)]
    for M, N, K in shapes:
        layer = NVFP4Linear(K, N, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            hit = bench(lambda: layer(x))
            miss = bench(lambda: (invalidate_weight_caches(), layer(x)))
        emit(f"| M={M} N={N} K={K} | {hit:.3f} | {miss:.3f} |")
    with torch.no_grad():
        layer = NVFP4Linear(1024, 512, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(300, 1024, device="cuda", dtype=torch.bfloat16)
        xb = x.clone()
        xb[3, 7] = float("nan")
        nan_in = bool(layer(xb).isnan().all())
        layer.weight[1, 2] = float("nan")
        nan_w = bool(layer(x).isnan().all()) and bool(layer(x[:4]).isnan().all())
    ok &= nan_in and nan_w
    emit(f"NaN input -> NaN output: {nan_in}; NaN weight -> NaN output (large and decode M): {nan_w}")
    emit(f"cache check: {'ok' if ok else 'FAIL'}")
    assert ok, "weight cache / non-finite check failed"
    return ok


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="first shape of each section only")
    p.add_argument("--sweep", action="store_true", help="also time tile configs")
    p.add_argument("--sections", default="correctness,w4a4,decode,linear,cache")
    args = p.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.manual_seed(0)
    emit(
        f"# bench_gemm on {torch.cuda.get_device_name()} (torch {torch.__version__}, triton {triton.__version__})"
    )
    emit()
    t0 = time.time()
    sections = {
        "correctness": lambda: correctness(args.quick),
        "w4a4": lambda: w4a4_forward(args.quick, args.sweep),
        "decode": lambda: decode(args.quick, args.sweep),
        "decode-shapes": lambda: decode_shapes(args.sweep),
        "decode-groups": decode_groups,
        "decode-variants": decode_variants,
        "decode-cold": decode_cold,
        "w4a16-prefill": w4a16_prefill,
        "dense-mid": dense_mid,
        "decode-mid": decode_mid,
        "floor": floor,
        "dense-tma": dense_tma,
        "linear": lambda: linear(args.quick),
        "cache": lambda: cache_check(args.quick),
    }
    for name in args.sections.split(","):
        t1 = time.time()
        try:
            sections[name]()
        except Exception as e:  # keep going: report which section broke
            import traceback

            emit(f"SECTION {name} FAILED: {type(e).__name__}: {e}")
            emit("```\n" + traceback.format_exc()[-3000:] + "\n```")
        emit(f"({name}: {time.time() - t1:.0f}s)")
    emit(f"total {time.time() - t0:.0f}s")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_gemm.md").write_text("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
