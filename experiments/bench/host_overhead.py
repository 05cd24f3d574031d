"""Host (Python) time of ``NVFP4Linear`` calls: with every Triton launch stubbed out (no GPU needed), or on a
GPU beside ``nn.Linear`` and under ``torch.compile`` (``--gpu``).

    python experiments/bench/host_overhead.py [--dtype bf16] [--shapes 16x256x256 128x256x256 ...]
                                              [--iters 200] [--profile CASE] [--verbose]
    python experiments/bench/host_overhead.py --siblings [--iters 200]
    python experiments/bench/host_overhead.py --gpu [--gpu-shapes 1x2560x9728 ...] [--iters 200]
                                              [--fwd-bwd] [--compile-backend inductor] [--device cpu]

``--gpu`` (CUDA, bf16, default config but ``share_inputs=False``): for each MxKxN (default M = 1, 256, 2048 at the K, N of Qwen3-4B's
MLP, 2560→9728 and 9728→2560) it first checks that the custom op and the compiled layer give the eager
layer's bits, then prints, side by side, µs per call of ``nn.Linear``, ``NVFP4Linear`` eager (autograd
Function), the ``triage::nvfp4_linear`` custom op called eagerly, and ``NVFP4Linear`` under
``torch.compile(fullgraph=True)`` (and ``nn.Linear`` compiled the same way): "host" = the Python call alone
(calls queued without a sync, the GPU running behind), "wall" = the same calls until the GPU is done.
``--fwd-bwd`` adds forward + backward rows. ``--device cpu`` runs the same steps on CPU (the torch reference
backends; a dry run of the script, e.g. ``--gpu --device cpu --gpu-shapes 1x64x96 32x64x96 --iters 5``).

Stub mode (the default, below):

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

if "--gpu" not in sys.argv:  # stub mode: the Triton code path without a GPU (set before importing triton)
    os.environ["TRITON_INTERPRET"] = "1"

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


def _linear_calls(module, shape, dtype):
    """``(x, fwd, fwd_bwd)`` for ``module`` (K -> N) at ``shape`` = (M, K, N): a random [M, K] input ``x``,
    the forward on it under ``no_grad``, and forward + backward of a random [M, N] gradient (on a copy of
    ``x`` that requires grad)."""
    M, K, N = shape
    x = torch.randn(M, K, dtype=dtype)
    xg = x.clone().requires_grad_()
    dy = torch.randn(M, N, dtype=dtype)

    def fwd():
        with torch.no_grad():
            module(x)

    def fwd_bwd():
        module(xg).backward(dy)

    return x, fwd, fwd_bwd


def _op_args(layer) -> tuple:
    """The arguments after ``x`` with which ``layer.forward`` calls the ``triage::nvfp4_linear`` op."""
    grad_free = not torch.is_grad_enabled()
    return layer.weight, layer.bias, layer._op_id, layer.config.backward == "nvfp4-backward", grad_free


def make_case(shape, backward: str, act_scale: str, dtype):
    from triage.kernels import NVFP4Linear, NVFP4LinearConfig
    from triage.kernels.nvfp4 import QuantRecipe

    M, K, N = shape
    config = NVFP4LinearConfig(  # called on one x again and again: share_inputs=False quantizes it every call
        activation=QuantRecipe(scale=act_scale),
        backward=backward,
        quant_backend="triton",
        gemm_backend="triton",
        share_inputs=False,
    )
    torch.manual_seed(0)
    layer = NVFP4Linear(K, N, bias=False, dtype=dtype, config=config)
    x, fwd, fwd_bwd = _linear_calls(layer, shape, dtype)

    def op_fwd():
        with torch.no_grad():
            torch.ops.triage.nvfp4_linear(x, *_op_args(layer))

    return fwd, fwd_bwd, op_fwd


def make_peer(shape, dtype) -> dict:
    """``nn.Linear`` on the same tensors: ``{"fwd": ..., "fwd+bwd": ...}``."""
    _, K, N = shape
    _, fwd, fwd_bwd = _linear_calls(torch.nn.Linear(K, N, bias=False, dtype=dtype), shape, dtype)
    return {"fwd": fwd, "fwd+bwd": fwd_bwd}


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


def _time(fn, iters: int, sync) -> tuple[float, float]:
    """(host µs, wall µs) per call of ``fn``: best of 3 rounds of ``iters`` calls; host = until the last
    call returns, wall = until the device has finished them (``sync``)."""
    host = wall = float("inf")
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        host, wall = min(host, (t1 - t0) / iters), min(wall, (t2 - t0) / iters)
    return host * 1e6, wall * 1e6


def gpu_main(args) -> None:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--gpu needs a CUDA device (--device cpu: a dry run on the torch reference backends)")
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU dry run (reference backends)"
    print(f"{name}, torch {torch.__version__}, bf16, NVFP4LinearConfig(share_inputs=False); µs per call")
    print(f"{'case':28s} {'variant':22s} {'host µs':>8s} {'wall µs':>8s} {'host / nn.Linear':>16s}")
    for shape_s in args.gpu_shapes:
        _gpu_shape(shape_s, args)


def _gpu_shape(shape_s: str, args) -> None:
    """The --gpu rows of one MxKxN."""
    from triage.kernels import NVFP4Linear, NVFP4LinearConfig

    # compiled code of one shape only: all shapes' layers share NVFP4Linear.forward's (and nn.Linear.forward's)
    # recompile limit, and each shape compiles it twice (no_grad for "fwd", grad mode for "fwd+bwd")
    torch._dynamo.reset()
    dev, dtype = torch.device(args.device), torch.bfloat16
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    M, K, N = (int(v) for v in shape_s.split("x"))
    torch.manual_seed(0)
    dense = torch.nn.Linear(K, N, bias=False, device=dev, dtype=dtype)
    # called on one x again and again: share_inputs=False quantizes it every call (as a model's layers do)
    config = NVFP4LinearConfig(share_inputs=False)
    layer = NVFP4Linear.from_linear(torch.nn.Linear(K, N, bias=False, device=dev, dtype=dtype), config)
    x = torch.randn(M, K, device=dev, dtype=dtype)
    op = torch.ops.triage.nvfp4_linear
    compiled = torch.compile(layer, backend=args.compile_backend, fullgraph=True)
    dense_c = torch.compile(dense, backend=args.compile_backend, fullgraph=True)
    with torch.no_grad():  # correctness first: the op and the compiled layer give the eager bits
        y = layer(x)
        assert torch.equal(op(x, *_op_args(layer))[0], y), shape_s
        assert torch.equal(compiled(x), y), shape_s
    xg = x.clone().requires_grad_()
    dy = torch.randn(M, N, device=dev, dtype=dtype)

    def no_grad(f):
        def run():
            with torch.no_grad():
                f(x)

        return run

    def fwd_bwd(f):
        return lambda: f(xg).backward(dy)

    variants = [
        ("nn.Linear", dense),
        ("nn.Linear compiled", dense_c),
        ("NVFP4Linear eager", layer),
        ("custom op, eager", lambda t: op(t, *_op_args(layer))[0]),
        ("NVFP4Linear compiled", compiled),
    ]
    for what, wrap in [("fwd", no_grad)] + ([("fwd+bwd", fwd_bwd)] if args.fwd_bwd else []):
        peer = None
        for name, f in variants:
            fn = wrap(f)
            for _ in range(3):  # warm-up: compiles, plans, the weight cache
                fn()
            host, wall = _time(fn, args.iters if M <= 256 else max(10, args.iters // 4), sync)
            peer = host if peer is None else peer
            print(f"{what + ' ' + shape_s:28s} {name:22s} {host:8.1f} {wall:8.1f} {host / peer:15.2f}x")


def siblings_main(args, stubs) -> None:
    """``--siblings``: a decoder layer's seven Linears (q/k/v, o, gate/up, down; hidden 64, 4 rows, fp16)
    converted three ways (``NVFP4Linear``, frozen W4A4 and W4A16; Triton backends), forward under no_grad,
    linked (q/k/v and gate/up one group launch each) against unlinked; stubbed launches, so the figures are
    the Python part only (the launches a group saves are not in them)."""
    import copy
    import dataclasses

    from torch import nn

    from triage.kernels import NVFP4Config, convert
    from triage.kernels.nvfp4 import QuantRecipe
    from triage.kernels.siblings import link_siblings

    class Layer(nn.Module):
        def __init__(self, h: int = 64) -> None:
            super().__init__()
            self.self_attn, self.mlp = nn.Module(), nn.Module()
            a, m = self.self_attn, self.mlp
            a.q_proj, a.k_proj, a.v_proj, a.o_proj = (nn.Linear(i, o, bias=False)
                                                      for i, o in ((h, 64), (h, 32), (h, 32), (64, h)))  # fmt: skip
            m.gate_proj, m.up_proj, m.down_proj = (nn.Linear(i, o, bias=False) for i, o in ((h, 96), (h, 96), (96, h)))

        def forward(self, x):
            a, m = self.self_attn, self.mlp
            h = x + a.o_proj(a.q_proj(x) * torch.cat([a.k_proj(x), a.v_proj(x)], -1))
            return h + m.down_proj(nn.functional.silu(m.gate_proj(h)) * m.up_proj(h))

    act = QuantRecipe(scale="row", profile="compressed-tensors")  # the sampler copy's recipe
    triton = dict(quant_backend="triton", gemm_backend="triton")
    configs = {"NVFP4Linear (W4A4)": NVFP4Config.from_recipe(act), "frozen W4A4": NVFP4Config.from_recipe(act, frozen="w4a4"),
               "frozen W4A16": NVFP4Config.from_recipe(act, frozen="w4a16")}  # fmt: skip
    print("CPU, fp16, Triton launches stubbed; host µs per decoder-layer forward (4 rows), no_grad")
    print(f"{'layers':22s} {'linked µs':>10s} {'launches':>8s} {'unlinked µs':>12s} {'launches':>8s}")
    for name, config in configs.items():
        if config.frozen is not None:
            config = dataclasses.replace(config, frozen=dataclasses.replace(config.frozen, **triton))
        else:
            config = dataclasses.replace(config, linear=dataclasses.replace(config.linear, **triton))
        torch.manual_seed(0)
        linked = convert(Layer().to(torch.float16), config)
        unlinked = copy.deepcopy(linked)
        link_siblings(unlinked, fused_groups=())
        x = torch.randn(4, 64, dtype=torch.float16)
        cells = []
        with torch.no_grad():
            for model in (linked, unlinked):
                us, launches, _ = measure(lambda model=model, x=x: model(x), stubs, args.iters)
                cells.append((us, sum(launches.values())))
        print(f"{name:22s} {cells[0][0]:10.0f} {cells[0][1]:8d} {cells[1][0]:12.0f} {cells[1][1]:8d}")


def main() -> None:
    p = argparse.ArgumentParser(
        description="Host time per NVFP4Linear call: stubbed Triton launches on CPU (default) or --gpu."
    )
    p.add_argument("--gpu", action="store_true", help="measure on a CUDA GPU beside nn.Linear and torch.compile")
    p.add_argument("--gpu-shapes", nargs="+", default=[f"{m}x{k}x{n}" for k, n in ((2560, 9728), (9728, 2560))
                                                       for m in (1, 256, 2048)],
                   help="--gpu: MxKxN (default M = 1/256/2048 at Qwen3-4B's MLP K, N)")  # fmt: skip
    p.add_argument("--fwd-bwd", action="store_true", help="--gpu: also time forward + backward")
    p.add_argument("--compile-backend", default="inductor", help="--gpu: torch.compile backend")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="--gpu: cpu = a dry run of the same steps on the torch reference backends (small "
                   "--gpu-shapes; its figures say nothing about a GPU)")  # fmt: skip
    p.add_argument("--dtype", default="fp32", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--shapes", nargs="+", default=["16x64x64", "128x64x64"],
                   help="MxKxN: M <= 64 takes the decode GEMM, larger M the GEMM on expansions")  # fmt: skip
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--profile", default=None, help="cProfile one case, e.g. fwd/bf16-backward/tensor/256x1024x3072")
    p.add_argument("--verbose", action="store_true", help="name the launches and torch ops of each case")
    p.add_argument("--siblings", action="store_true",
                   help="a decoder layer's forward with q/k/v and gate/up linked vs unlinked (siblings_main)")  # fmt: skip
    args = p.parse_args()
    if args.gpu:
        return gpu_main(args)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    stubs = stub_kernels()
    if args.siblings:
        return siblings_main(args, stubs)
    print(f"CPU, {args.dtype}, Triton launches stubbed; host µs per call (the Python part only)")
    print("op µs: the forward as the triage::nvfp4_linear custom op (what torch.compile runs), called eagerly")
    print(f"{'case':48s} {'µs':>7s} {'triton':>6s} {'torch':>5s}  {'op µs':>6s}  nn.Linear µs")
    for shape_s in args.shapes:
        shape = tuple(int(v) for v in shape_s.split("x"))
        peer = make_peer(shape, dtype)
        for backward in ("bf16-backward", "nvfp4-backward"):
            for act in ("tensor", "row"):
                fwd, fwd_bwd, op_fwd = make_case(shape, backward, act, dtype)
                for what, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                    if what == "fwd" and backward == "nvfp4-backward":
                        continue  # the forward does not depend on the backward mode
                    name = f"{what}/{backward}/{act}/{shape_s}"
                    us, launches, ops = measure(fn, stubs, args.iters)
                    peer_us = measure(peer[what], [], args.iters)[0]
                    op_us = f"{measure(op_fwd, [], args.iters)[0]:6.0f}" if what == "fwd" else f"{'':6s}"
                    n_launch, n_ops = sum(launches.values()), sum(ops.values())
                    print(f"{name:48s} {us:7.0f} {n_launch:6d} {n_ops:5d}  {op_us}  {peer_us:7.0f}")
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
