"""Host (Python) time of ``NVFP4Linear`` calls with every Triton launch stubbed out — runs without a GPU.

    python experiments/bench/host_overhead.py [--dtype bf16] [--shapes 16x256x256 128x256x256 ...]
                                              [--iters 200] [--profile CASE] [--verbose]

The learner step of a small model is host-bound (docs/benchmarks.md, "NVFP4Linear host time"): each
NVFP4Linear call spends host time in our Python (recipe checks, shape logic, buffers, tile configs), in
Triton's launcher and in CUDA allocations. This script isolates the first part: it runs the Triton code path
(``TRITON_INTERPRET=1``, backends forced to ``triton``) with every ``@triton.jit`` kernel of ``triage``
replaced by a no-op launcher and reports, per case (forward / forward+backward × ``backward`` mode ×
per-tensor / per-row activation scale × shape), microseconds per call, the Triton launches per call and the
other torch ops that would launch a CUDA kernel (the outputs are garbage — this measures the host path only).

Tensors are small CPU tensors, so the torch ops (which also compute here) cost little; ``nn.Linear`` on the
same tensors is printed beside each case. Each figure is the best of 5 rounds of ``--iters / 5`` calls (the
machine may be shared). ``--profile CASE`` (e.g. ``fwd/bf16-backward/tensor/128x256x256``): cProfile of that
case; ``--verbose`` names the launches and torch ops.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"  # the Triton code path without a GPU (set before importing triton)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


class _NoLaunch:
    """Stands in for a ``@triton.jit`` function: ``kernel[grid](...)`` only counts the launch."""

    def __init__(self, name: str) -> None:
        self.name, self.launches = name, 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches += 1

        return launch


KERNEL_MODULES = (
    "triage.kernels.nvfp4.dequantize_rows",
    "triage.kernels.nvfp4.gemm_decode",
    "triage.kernels.nvfp4.gemm_dense",
    "triage.kernels.nvfp4.quantize_columns",
    "triage.kernels.nvfp4.quantize_rows",
)


def stub_kernels(setattr_=setattr) -> list[_NoLaunch]:
    """Replace every Triton kernel of the modules in :data:`KERNEL_MODULES` by a :class:`_NoLaunch`
    (``setattr_``: e.g. pytest's ``monkeypatch.setattr``, so that tests restore them)."""
    import importlib

    stubs = []
    for name in KERNEL_MODULES:
        module = importlib.import_module(name)
        for attr in dir(module):
            if type(getattr(module, attr)).__name__ in ("JITFunction", "InterpretedFunction", "FastLaunch"):
                stub = _NoLaunch(attr)
                setattr_(module, attr, stub)
                stubs.append(stub)
    return stubs


class TorchKernels(TorchDispatchMode):
    """Counts the torch ops that launch a CUDA kernel (views and ``empty`` allocations launch none)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and not name.startswith("empty") and name not in ("lift_fresh", "detach"):
            self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def make_case(shape, backward: str, act_scale: str, dtype):
    from triage.kernels import NVFP4Linear, NVFP4LinearConfig
    from triage.kernels.nvfp4 import QuantRecipe

    M, K, N = shape
    config = NVFP4LinearConfig(
        activation=QuantRecipe(scale=act_scale), backward=backward, quant_backend="triton", gemm_backend="triton"
    )
    torch.manual_seed(0)
    layer = NVFP4Linear(K, N, bias=False, dtype=dtype, config=config)
    x = torch.randn(M, K, dtype=dtype)
    xg = x.clone().requires_grad_()
    dy = torch.randn(M, N, dtype=dtype)

    def fwd():
        with torch.no_grad():
            layer(x)

    def fwd_bwd():
        layer(xg).backward(dy)

    return fwd, fwd_bwd


def make_peer(shape, dtype) -> dict:
    """``nn.Linear`` on the same tensors: ``{"fwd": ..., "fwd+bwd": ...}``."""
    M, K, N = shape
    dense = torch.nn.Linear(K, N, bias=False, dtype=dtype)
    x = torch.randn(M, K, dtype=dtype)
    xg = x.clone().requires_grad_()
    dy = torch.randn(M, N, dtype=dtype)

    def fwd():
        with torch.no_grad():
            dense(x)

    return {"fwd": fwd, "fwd+bwd": lambda: dense(xg).backward(dy)}


def measure(fn, stubs, iters: int) -> tuple[float, dict, dict]:
    for _ in range(3):
        fn()
    for s in stubs:
        s.launches = 0
    with TorchKernels() as counter:
        fn()
    launches = {s.name: s.launches for s in stubs if s.launches}
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(max(1, iters // 5)):
            fn()
        best = min(best, (time.perf_counter() - t0) / max(1, iters // 5))
    return best * 1e6, launches, counter.ops


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="fp32", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--shapes", nargs="+", default=["16x64x64", "128x64x64"],
                   help="MxKxN: M <= 64 takes the decode GEMM, larger M the GEMM on expansions")  # fmt: skip
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--profile", default=None, help="cProfile one case, e.g. fwd/bf16-backward/tensor/256x1024x3072")
    p.add_argument("--verbose", action="store_true", help="name the launches and torch ops of each case")
    args = p.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    stubs = stub_kernels()
    print(f"CPU, {args.dtype}, Triton launches stubbed; host µs per call (the Python part only)")
    print(f"{'case':48s} {'µs':>7s} {'triton':>6s} {'torch':>5s}  nn.Linear µs")
    for shape_s in args.shapes:
        shape = tuple(int(v) for v in shape_s.split("x"))
        peer = make_peer(shape, dtype)
        for backward in ("bf16-backward", "nvfp4-backward"):
            for act in ("tensor", "row"):
                fwd, fwd_bwd = make_case(shape, backward, act, dtype)
                for what, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                    if what == "fwd" and backward == "nvfp4-backward":
                        continue  # the forward does not depend on the backward mode
                    name = f"{what}/{backward}/{act}/{shape_s}"
                    us, launches, ops = measure(fn, stubs, args.iters)
                    peer_us = measure(peer[what], [], args.iters)[0]
                    n_launch, n_ops = sum(launches.values()), sum(ops.values())
                    print(f"{name:48s} {us:7.0f} {n_launch:6d} {n_ops:5d}  {peer_us:7.0f}")
                    if args.verbose:
                        print(f"    triton: {launches}\n    torch: {ops}")
                    if args.profile == name:
                        import cProfile
                        import pstats

                        prof = cProfile.Profile()
                        prof.enable()
                        for _ in range(100):
                            fn()
                        prof.disable()
                        pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    sys.exit(main())
