"""Host (Python) time of one ``NVFP4Linear`` forward with every Triton launch stubbed out — runs on CPU.

    python experiments/bench/host_overhead.py [--rows 128] [--features 256] [--profile]

The learner step of a small model is host-bound (docs/benchmarks.md, Round 2): each NVFP4Linear forward
spends host time in our Python (recipe checks, buffers, tile configs), in Triton's launcher and in CUDA
allocations. This script isolates the first part: it runs the Triton code path (``TRITON_INTERPRET=1``,
backends forced to ``triton``) on CPU tensors with every ``@triton.jit`` kernel of ``triage`` replaced by a
no-op launcher, and reports microseconds per forward and the kernel launches each forward issues (the
outputs are garbage — this measures the host path only). Use it to check host-side changes without a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"  # the Triton code path on CPU (set before importing triton)

import torch  # noqa: E402


class _NoLaunch:
    """Stands in for a ``@triton.jit`` function: ``kernel[grid](...)`` only counts the launch."""

    def __init__(self, name: str) -> None:
        self.name, self.launches = name, 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches += 1

        return launch


def stub_kernels() -> list[_NoLaunch]:
    import triage.kernels.nvfp4.dequantize_rows  # noqa: F401  (import every module that defines kernels)
    import triage.kernels.nvfp4.gemm_decode  # noqa: F401
    import triage.kernels.nvfp4.gemm_dense  # noqa: F401
    import triage.kernels.nvfp4.quantize_rows  # noqa: F401

    stubs = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("triage"):
            continue
        for attr in dir(module):
            if type(getattr(module, attr)).__name__ in ("JITFunction", "InterpretedFunction", "FastLaunch"):
                stub = _NoLaunch(attr)
                setattr(module, attr, stub)
                stubs.append(stub)
    return stubs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--features", type=int, default=256)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--profile", action="store_true", help="cProfile of the forwards (cumulative)")
    args = p.parse_args()
    stubs = stub_kernels()
    from triage.kernels import NVFP4Linear, NVFP4LinearConfig

    torch.manual_seed(0)
    dense = torch.nn.Linear(args.features, args.features, bias=False)
    layer = NVFP4Linear.from_linear(dense, NVFP4LinearConfig(quant_backend="triton", gemm_backend="triton"))
    x = torch.randn(args.rows, args.features)
    for _ in range(3):
        layer(x)
    for s in stubs:
        s.launches = 0
    t0 = time.perf_counter()
    for _ in range(args.iters):
        layer(x)
    us = (time.perf_counter() - t0) / args.iters * 1e6
    launches = {s.name: s.launches / args.iters for s in stubs if s.launches}
    print(
        f"host time per NVFP4Linear forward (launches stubbed): {us:.0f} µs; launches per forward: {launches}"
    )
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(100):
            layer(x)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
