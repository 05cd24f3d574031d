# ruff: noqa: B023  (benchmark lambdas are consumed inside the loop iteration that defines them)
"""H200 check + benchmark of the NVFP4 dense GEMMs (issue 4). Run on a CUDA machine:

    python experiments/bench/bench_gemm.py [--quick]

1. correctness vs the torch reference (dequantize, fp64 matmul) on real shapes, every backend, incl. a
   NaN block scale and per-row outer scales;
2. W4A4 forward vs cuBLAS bf16 at (M, N, K) = (16384, 4096, 4096), (16384, 12288, 4096), (16384, 4096, 12288),
   for each implementation and a few fused-kernel tile configs;
3. decode M ∈ {1, 16, 64}: W4A16 and W4A4 (packed FP4 weights) vs bf16, timed with CUDA graphs;
4. NVFP4Linear forward+backward (bf16-backward, quantization included) vs bf16 nn.Linear and vs a
   fake-quant (quantize → dequantize → bf16 matmul; eager and torch.compile'd).

Timings are ``triton.testing.do_bench`` medians (ms) on random (never zero) data. Writes the table to
``$OUT/bench_gemm.md`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
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
from triage.kernels.nvfp4 import QuantRecipe, quantize  # noqa: E402
from triage.kernels.nvfp4 import gemm_triton as gt  # noqa: E402
from triage.kernels.nvfp4.gemm import (  # noqa: E402
    expand,
    gemm,
    gemm_reference,
    gemm_w4a16,
    gemm_w4a16_reference,
)
from triton.testing import do_bench, do_bench_cudagraph  # noqa: E402

LINES: list[str] = []


def emit(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    y, ref = y.double(), ref.double()
    return float((y - ref).abs().max() / ref.abs().max())


def tflops(M, N, K, ms) -> float:
    return 2 * M * N * K / ms / 1e9


def correctness(quick: bool) -> None:
    emit("## Correctness vs the fp64 reference (out fp32; max|err| / max|ref|)")
    emit("| case | backend | rel err |")
    emit("|---|---|---|")
    shapes = [(1024, 4096, 4096), (1000, 12288, 4096), (777, 4096, 12288), (5, 4096, 4096), (64, 3000, 1040)]
    for M, N, K in shapes[: 3 if quick else None]:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        for recipe in (QuantRecipe(), QuantRecipe(scale="row")):
            a = quantize(x, recipe)
            b = quantize(w, QuantRecipe(block="16x16") if recipe.scale == "tensor" else recipe)
            ref = gemm_reference(a, b, out_dtype=torch.float64)
            for backend in ("triton", "cublas"):
                out = torch.full((M, N), float("nan"), device="cuda")
                y = gemm(a, b, out_dtype=torch.float32, backend=backend, out=out)
                err = rel(y, ref) if not torch.isnan(y).any() else float("nan")
                emit(f"| W4A4 {M}x{N}x{K} scale={recipe.scale} | {backend} | {err:.2e} |")
            refw = gemm_w4a16_reference(x, b, out_dtype=torch.float64)
            for backend in ("triton", "cublas"):
                y = gemm_w4a16(x, b, out_dtype=torch.float32, backend=backend)
                emit(f"| W4A16 {M}x{N}x{K} scale={recipe.scale} | {backend} | {rel(y, refw):.2e} |")
    # NaN block scale must give a NaN row (GPU cvt e4m3 0x7F -> NaN)
    a = quantize(torch.randn(32, 256, device="cuda"), QuantRecipe())
    b = quantize(torch.randn(64, 256, device="cuda"), QuantRecipe())
    sc = a.scale.view(torch.uint8).clone()
    sc[3, 2] = 0x7F
    a.scale = sc.view(torch.float8_e4m3fn)
    for backend in ("triton", "cublas"):
        y = gemm(a, b, out_dtype=torch.float32, backend=backend)
        ok = bool(torch.isnan(y[3]).all()) and not bool(torch.isnan(y[[0, 1, 2, 4]]).any())
        emit(f"| NaN block scale -> NaN row only | {backend} | {'ok' if ok else 'FAIL'} |")
    emit()


def w4a4_forward(quick: bool) -> None:
    emit("## W4A4 forward vs cuBLAS bf16 (operands already quantized; weight expansion cached)")
    emit("| M×N×K | impl | ms | TFLOP/s | time / bf16 |")
    emit("|---|---|---|---|---|")
    configs = [
        dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, SPLIT_K=1, num_warps=8, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, SPLIT_K=1, num_warps=4, num_stages=4),
        dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, SPLIT_K=1, num_warps=8, num_stages=3),
        dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, SPLIT_K=1, num_warps=8, num_stages=3),
    ]
    for M, N, K in [(16384, 4096, 4096), (16384, 12288, 4096), (16384, 4096, 12288)][: 1 if quick else None]:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        a, b = quantize(x, QuantRecipe()), quantize(w, QuantRecipe(block="16x16"))
        xa, wb = expand(a), expand(b)
        ga, gb = a.global_scale.reshape(1).float(), b.global_scale.reshape(1).float()
        ms_bf16 = do_bench(lambda: torch.mm(x, w.T))
        rows = [("cuBLAS bf16 (x·wᵀ)", ms_bf16)]
        rows.append(
            (
                "nvfp4 cublas: expand(a) + mm fp32-out + scale",
                do_bench(lambda: gemm(a, b, backend="cublas", b_expanded=wb)),
            )
        )
        zn = torch.zeros(N, device="cuda", dtype=torch.bfloat16)
        rows.append(
            (
                "nvfp4 cublas-alpha: expand(a) + addmm(alpha, host sync) bf16-out",
                do_bench(lambda: torch.addmm(zn, expand(a), wb.T, beta=0, alpha=float(ga * gb))),
            )
        )
        rows.append(("  part: expand(a) only", do_bench(lambda: expand(a))))
        rows.append(
            (
                "  part: mm(bf16 expanded, fp32 out)",
                do_bench(lambda: torch.mm(xa, wb.T, out_dtype=torch.float32)),
            )
        )
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        for i, cfg in enumerate(configs):
            try:
                ms = do_bench(
                    lambda cfg=cfg: gt.launch_gemm(
                        a.data, a.scale, b.data, b.scale, K, out, ga, gb, None, config=cfg
                    )
                )
                rows.append(
                    (
                        f"nvfp4 triton fused W4A4 cfg{i} {cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']}"
                        f" w{cfg['num_warps']}s{cfg['num_stages']}",
                        ms,
                    )
                )
                ms = do_bench(
                    lambda cfg=cfg: gt.launch_gemm(
                        a.data, a.scale, wb, None, K, out, ga, gb, None, config=cfg
                    )
                )
                rows.append((f"nvfp4 triton a packed, b expanded cfg{i}", ms))
                ms = do_bench(
                    lambda cfg=cfg: gt.launch_gemm(xa, None, wb, None, K, out, ga, gb, None, config=cfg)
                )
                rows.append((f"triton dense bf16 (both expanded) cfg{i}", ms))
            except Exception as e:  # a config that does not compile or fit in shared memory
                rows.append((f"cfg{i} failed: {type(e).__name__}: {str(e)[:80]}", float("nan")))
        for name, ms in rows:
            emit(f"| {M}×{N}×{K} | {name} | {ms:.3f} | {tflops(M, N, K, ms):.0f} | {ms / ms_bf16:.2f} |")
    emit()


def decode(quick: bool) -> None:
    emit("## Decode (CUDA-graph timings): packed FP4 weights vs bf16")
    emit("| M | N×K | bf16 ms | W4A16 ms | W4A4 ms | bf16/W4A16 | bf16/W4A4 |")
    emit("|---|---|---|---|---|---|---|")
    for N, K in [(4096, 4096), (12288, 4096), (4096, 12288)][: 1 if quick else None]:
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        b = quantize(w, QuantRecipe())
        for M in (1, 16, 64):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            a = quantize(x, QuantRecipe())
            err = rel(
                gemm_w4a16(x, b, out_dtype=torch.float32), gemm_w4a16_reference(x, b, out_dtype=torch.float64)
            )
            assert err < 1e-4, err
            t_bf16 = do_bench_cudagraph(lambda: torch.mm(x, w.T))
            t_w4a16 = do_bench_cudagraph(lambda: gemm_w4a16(x, b, backend="triton"))
            t_w4a4 = do_bench_cudagraph(lambda: gemm(a, b, backend="triton"))
            emit(
                f"| {M} | {N}×{K} | {t_bf16 * 1e3:.1f}µs | {t_w4a16 * 1e3:.1f}µs | {t_w4a4 * 1e3:.1f}µs | "
                f"{t_bf16 / t_w4a16:.2f} | {t_bf16 / t_w4a4:.2f} |"
            )
    emit()


def linear(quick: bool) -> None:
    from triage.kernels import NVFP4Linear, NVFP4LinearConfig
    from triage.kernels.nvfp4 import dequantize

    emit("## NVFP4Linear forward+backward (bf16-backward, quantization included) vs bf16 nn.Linear")
    emit("| M×N×K | impl | ms | TFLOP/s (3 GEMMs) | throughput / bf16 |")
    emit("|---|---|---|---|---|")

    def fake_quant_linear(x, w):
        xq = dequantize(quantize(x, QuantRecipe()))
        wq = dequantize(quantize(w, QuantRecipe(block="16x16")))
        return torch.nn.functional.linear(xq, wq)

    compiled = None
    try:
        from triage.kernels.nvfp4 import quantize_reference

        def torch_fake_quant(x, w):
            xq = quantize_reference(x, QuantRecipe()).dequantize()
            wq = quantize_reference(w, QuantRecipe(block="16x16")).dequantize()
            return torch.nn.functional.linear(xq, wq)

        compiled = torch.compile(torch_fake_quant)
    except Exception as e:  # noqa: BLE001
        emit(f"(torch.compile fake-quant unavailable: {e})")
        torch_fake_quant = None

    for M, N, K in [(16384, 4096, 4096), (16384, 12288, 4096), (16384, 4096, 12288)][: 1 if quick else None]:
        ref = torch.nn.Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16)
        fp4 = NVFP4Linear.from_linear(ref, NVFP4LinearConfig())
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)

        def step(fn):
            x.grad = None
            ref.weight.grad = None
            fn(x).backward(dy)

        ms_bf16 = do_bench(lambda: step(ref))
        rows = [("bf16 nn.Linear", ms_bf16), ("NVFP4Linear (bf16-backward)", do_bench(lambda: step(fp4)))]
        rows.append(
            (
                "fake-quant, Triton quantize+dequantize, bf16 mm",
                do_bench(lambda: step(lambda t: fake_quant_linear(t, ref.weight))),
            )
        )
        if torch_fake_quant is not None:
            rows.append(
                (
                    "fake-quant, torch reference quantizer (eager)",
                    do_bench(lambda: step(lambda t: torch_fake_quant(t, ref.weight))),
                )
            )
            try:
                step(lambda t: compiled(t, ref.weight))
                rows.append(
                    (
                        "fake-quant, torch reference quantizer (torch.compile)",
                        do_bench(lambda: step(lambda t: compiled(t, ref.weight))),
                    )
                )
            except Exception as e:  # noqa: BLE001
                rows.append((f"torch.compile fake-quant failed: {type(e).__name__}", float("nan")))
        for name, ms in rows:
            emit(f"| {M}×{N}×{K} | {name} | {ms:.3f} | {tflops(M, N, K, ms) * 3:.0f} | {ms_bf16 / ms:.2f} |")
    emit()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="first shape of each section only")
    p.add_argument("--sections", default="correctness,w4a4,decode,linear")
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
    sections = {"correctness": correctness, "w4a4": w4a4_forward, "decode": decode, "linear": linear}
    for name in args.sections.split(","):
        try:
            sections[name](args.quick)
        except Exception as e:  # keep going: report which section broke
            import traceback

            emit(f"SECTION {name} FAILED: {type(e).__name__}: {e}")
            emit("```\n" + traceback.format_exc()[-3000:] + "\n```")
    emit(f"total {time.time() - t0:.0f}s")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_gemm.md").write_text("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
