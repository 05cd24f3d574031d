"""Host time per call of the NVFP4 learner's building blocks on the GPU (no sync inside the loop). CUDA only.

    python experiments/bench/launch_overhead.py

The 0.6B learner step is host-bound (docs/benchmarks.md, Round 2); this splits the host time of one
``NVFP4Linear`` forward into its launches: a bare Triton launch, our quantize, our GEMM, the whole layer,
against ``nn.Linear`` and a torch elementwise op. Each row: mean host µs over 300 calls, measured before the
final synchronize (so queued GPU work does not count, as long as the GPU keeps up).
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gemm import _ensure_triage  # noqa: E402

_ensure_triage()

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _noop(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def host_us(fn, calls: int = 300) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host / calls * 1e6


def profile_calls(fn, calls: int = 200) -> str:
    """cProfile of ``calls`` host calls (top functions by own time)."""
    import cProfile
    import io
    import pstats

    for _ in range(5):
        fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
    return out.getvalue()


def main() -> None:
    from triage.kernels import NVFP4Linear, NVFP4LinearConfig
    from triage.kernels.nvfp4 import QuantRecipe, gemm, quantize
    from triage.kernels.nvfp4.matmul import gemm_plan

    torch.manual_seed(0)
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)  # small: host-bound, not GPU-bound
    small = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    lin = torch.nn.Linear(1024, 3072, bias=False, device="cuda", dtype=torch.bfloat16)
    fp4 = NVFP4Linear.from_linear(lin, NVFP4LinearConfig(share_inputs=False))  # one x: quantize every call
    buf = torch.randn(4096, device="cuda")
    wq = quantize(lin.weight.detach(), QuantRecipe(block="16x16"))
    xq = quantize(x, QuantRecipe())
    xq_mid = quantize(torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16), QuantRecipe(),
                      emit_expanded=torch.bfloat16)  # fmt: skip
    tma_plan = gemm_plan(xq_mid, wq, host_scales=False)
    print(f"512×3072×1024 plan: route {tma_plan.route}, TMA {getattr(tma_plan.launch, 'tma', None)}")
    rows = [
        ("bare Triton launch (3 args)", lambda: _noop[(4,)](buf, 4096, BLOCK=1024)),
        ("torch.add (eager op)", lambda: buf.add(1.0)),
        ("quantize 64×1024 per-tensor (amax + quantize)", lambda: quantize(small, QuantRecipe())),
        (
            "quantize 64×1024 static",
            lambda: quantize(small, QuantRecipe(scale_source="static", static_amax=4.0)),
        ),
        ("quantize 256×1024 per-tensor", lambda: quantize(x, QuantRecipe())),
        ("gemm 256×3072×1024 (quantized operands)", lambda: gemm(xq, wq)),
        ("gemm 512×3072×1024, TMA kernel (its plan, bf16 expansions)", lambda: tma_plan.run(xq_mid, wq)),
        ("nn.Linear forward 256×1024→3072", lambda: lin(x)),
        ("NVFP4Linear forward 256×1024→3072", lambda: fp4(x)),
    ]
    xg = x.clone().requires_grad_(True)

    def fwd_bwd(m):
        return lambda: m(xg).sum().backward()

    rows += [
        ("nn.Linear fwd+bwd", fwd_bwd(lin)),
        ("NVFP4Linear fwd+bwd", fwd_bwd(fp4)),
    ]
    launchers = all_launchers()
    same = check_identical(launchers)
    hits = sum(launcher.hits for launcher in launchers)
    print(
        f"fast-launch wrappers: {len(launchers)}; fast-path launches in the check: {hits}; bit-identical: {same}"
    )
    if "--profile" in sys.argv:
        small_q = rows[2][1]
        print("## fast launch\n", profile_calls(small_q))
        print("## Triton launch\n", with_fast(launchers, False, functools.partial(profile_calls, small_q)))
        print("hits:", {type(lr.fn).__name__ + str(i): lr.hits for i, lr in enumerate(launchers) if lr.hits})
    print("| call | host µs/call, Triton launch | host µs/call, fast launch |\n|---|---|---|")
    for name, fn in rows:
        plain = with_fast(launchers, False, functools.partial(host_us, fn))
        print(f"| {name} | {plain:.1f} | {host_us(fn):.1f} |")


def all_launchers() -> list:
    import triage.kernels.moe.grouped_triton  # noqa: F401
    import triage.kernels.nvfp4.dequantize_rows  # noqa: F401
    import triage.kernels.nvfp4.gemm_decode  # noqa: F401
    import triage.kernels.nvfp4.gemm_dense  # noqa: F401
    import triage.kernels.nvfp4.quantize_columns  # noqa: F401
    import triage.kernels.nvfp4.quantize_rows  # noqa: F401
    from triage.kernels._launch import FastLaunch

    found = []
    for name, module in list(sys.modules.items()):
        if name.startswith("triage"):
            found += [v for v in vars(module).values() if isinstance(v, FastLaunch) and v not in found]
    return found


def with_fast(launchers, on: bool, fn):
    old = [launcher.fast for launcher in launchers]
    for launcher in launchers:
        launcher.fast = on and launcher.fast
    try:
        return fn()
    finally:
        for launcher, o in zip(launchers, old):
            launcher.fast = o


def check_identical(launchers) -> bool:
    """Quantize + GEMM outputs through the fast path equal Triton's own path, over shapes, offsets (pointer
    alignment), int sizes and recipes that change Triton's specialization from call to call."""
    from triage.kernels.nvfp4 import QuantRecipe, gemm, quantize
    from triage.kernels.nvfp4.matmul import gemm_plan

    torch.manual_seed(1)
    base = torch.randn(600000, device="cuda", dtype=torch.bfloat16) * 3
    cases, weights = [], {}
    for rows, k, off in [
        (64, 1024, 0),
        (64, 1024, 8),
        (33, 1040, 1),
        (7, 48, 3),
        (1, 16, 0),
        (128, 4096, 16),
    ]:
        x = base[off : off + rows * k].view(rows, k)
        weights[k] = torch.randn(48, k, device="cuda", dtype=torch.bfloat16)
        for recipe in (QuantRecipe(), QuantRecipe(scale="row"), QuantRecipe(rounding="stochastic", seed=5)):
            cases.append((x, recipe))

    # the persistent TMA GEMM's route (sm_90+: two bf16 expansions, more than 256 rows; descriptors made per
    # call): both settings, wherever its kernel is a FastLaunch
    tma_cases = [(3000, 1000, 1040), (4096, 2560, 1024), (512, 4096, 2560)]

    def run_all():
        outs = []
        for x, recipe in cases * 2:  # twice: the second round hits the fast path's cache
            q = quantize(x, recipe)
            w = quantize(weights[x.shape[1]], QuantRecipe(block="16x16"))
            outs += [q.data, q.scale.view(torch.uint8), q.global_scale, gemm(q, w)]
        for m, n, k in tma_cases * 2:
            torch.manual_seed(m + n + k)
            a = quantize(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), QuantRecipe(),
                         emit_expanded=torch.bfloat16)  # fmt: skip
            b = quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16), QuantRecipe(block="16x16"))
            plan = gemm_plan(a, b, host_scales=False)
            outs.append(plan.run(a, b))
        return [o.clone() for o in outs]

    fast = run_all()
    plain = with_fast(launchers, False, run_all)
    return all(
        torch.equal(a, b) or (a.isnan() == b.isnan()).all() and torch.equal(a.nan_to_num(), b.nan_to_num())
        for a, b in zip(fast, plain)
    )


if __name__ == "__main__":
    main()
