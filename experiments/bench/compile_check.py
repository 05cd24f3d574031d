"""Compile every Triton kernel specialization the CPU tests launch, for a real GPU target — no GPU needed.

The CPU suite runs the kernels under Triton's interpreter, which checks their semantics but never compiles
them, so a specialization that only the tests reach (an odd dtype, a padding branch, an opt-in constexpr)
can still crash the GPU compiler (Triton 3.6 on sm_90 crashes on NVFP4 ``tl.dot_scaled``, say). This
script closes that gap in two steps:

1. ``record``: run pytest in-process under the interpreter with a plugin that logs each kernel launch as a
   compile spec — the kernel, each argument's Triton type (``*bf16``, ``i32``, ``constexpr``, a host TMA
   descriptor's ``tensordesc<bf16[128, 64]>`` …), the
   constexpr values, the arguments Triton would specialize as divisible by 16 or equal to 1, and
   ``num_warps`` / ``num_stages`` — deduplicated, one JSON line each.
2. ``compile``: in a process whose ``triton`` is the GPU image's version (``PYTHONPATH`` to a
   ``pip install --no-deps --target DIR triton==3.6.0``), compile every spec for ``sm_<arch>`` with
   ptxas, and report failures, and spills (local-memory loads and stores in the SASS).

    python experiments/bench/compile_check.py record --out /tmp/specs.jsonl tests/kernels
    python experiments/bench/compile_check.py record --gpu-host --out /tmp/specs-gpu.jsonl tests/kernels
    PYTHONPATH=/tmp/t36 python experiments/bench/compile_check.py compile /tmp/specs*.jsonl --arch 90

``compile --hashes OUT.json`` also writes each spec's instruction hash (SHA-1 of the SASS opcodes and
operands, addresses left out); ``same OLD.json NEW.json`` then lists the specs whose instructions differ
between two trees, the proof that a refactor left the compiled kernels unchanged.

``--gpu-host`` makes the kernels' host code pick its GPU tiles and dot dtypes (bf16 dots, which the
interpreter computes wrongly: tests fail, but every launch they reach is still logged).

The specs mirror Triton's launcher specialization (pointer and integer divisibility by 16, integers equal to
1 as constexprs, ``do_not_specialize``), so the compiled kernel is the one the GPU would build for the same
arguments, up to pointer alignment of GPU allocations (always 16 there; taken from the CPU tensor here).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

_OPTIONS = {"num_warps", "num_stages", "num_ctas", "maxnreg"}
_TORCH_TO_TRITON = {
    "torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32", "torch.float64": "fp64",
    "torch.uint8": "u8", "torch.int8": "i8", "torch.int16": "i16", "torch.int32": "i32", "torch.int64": "i64",
    "torch.uint16": "u16", "torch.uint32": "u32", "torch.uint64": "u64", "torch.bool": "i1",
    "torch.float8_e4m3fn": "fp8e4nv", "torch.float8_e5m2": "fp8e5",
}  # fmt: skip


def _is_constexpr(param) -> bool:
    ann = param.annotation
    return "constexpr" in (ann if isinstance(ann, str) else getattr(ann, "__name__", repr(ann)))


def launch_spec(fn, args: tuple, kwargs: dict) -> dict:
    """The compile spec of one interpreted launch of ``fn`` (a ``@triton.jit`` Python function) with ``args``
    / ``kwargs`` (launch options included), as Triton's launcher would specialize it."""
    import inspect

    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor

    params = list(inspect.signature(fn.fn).parameters.values())
    no_spec = set(fn.kwargs.get("do_not_specialize", ()) or ())
    bound = dict(zip([p.name for p in params], args))
    bound.update({k: v for k, v in kwargs.items() if k not in _OPTIONS})
    signature, constexprs, divisible = {}, {}, []
    for p in params:
        if p.name in bound:
            v = bound[p.name]
        elif p.default is not inspect.Parameter.empty:
            v = p.default
        else:
            raise TypeError(f"{fn.fn.__name__}: argument {p.name!r} not given")
        if _is_constexpr(p) or v is None:
            signature[p.name] = "constexpr"
            constexprs[p.name] = v if isinstance(v, (bool, int, float, str, type(None))) else _encode(v)
        elif isinstance(v, torch.Tensor):
            signature[p.name] = "*" + _TORCH_TO_TRITON[str(v.dtype)]
            if v.data_ptr() % 16 == 0:
                divisible.append(p.name)
        elif isinstance(v, TensorDescriptor):  # a host TMA descriptor: its type is dtype and block shape
            block = ", ".join(str(int(b)) for b in v.block_shape)
            signature[p.name] = f"tensordesc<{_TORCH_TO_TRITON[str(v.base.dtype)]}[{block}]>"
        elif isinstance(v, bool):
            signature[p.name] = "i1"
        elif isinstance(v, int):
            if v == 1 and p.name not in no_spec:
                signature[p.name], constexprs[p.name] = "constexpr", 1
                continue
            signature[p.name] = "i32" if -(2**31) <= v < 2**31 else ("i64" if v < 2**63 else "u64")
            if v % 16 == 0 and p.name not in no_spec:
                divisible.append(p.name)
        elif isinstance(v, float):
            signature[p.name] = "fp32"
        else:
            raise TypeError(f"{fn.fn.__name__}: argument {p.name!r} of type {type(v).__name__}")
    return {
        "module": fn.fn.__module__, "name": fn.fn.__qualname__, "signature": signature,
        "constexprs": constexprs, "divisible": divisible,
        "num_warps": int(kwargs.get("num_warps", 4)), "num_stages": int(kwargs.get("num_stages", 3)),
    }  # fmt: skip


def _encode(v):
    name = getattr(v, "name", None)  # a triton dtype (tl.float16, ...)
    if name is not None and type(v).__module__.startswith("triton"):
        return {"tl_dtype": name}
    raise TypeError(f"constexpr value {v!r} of type {type(v).__name__}")


def _decode(v):
    if isinstance(v, dict) and "tl_dtype" in v:
        import triton.language as tl

        return getattr(
            tl, {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}.get(v["tl_dtype"], v["tl_dtype"])
        )
    return v


class _Recorder:
    """pytest plugin: wraps ``InterpretedFunction.run`` and collects one spec per distinct launch."""

    def __init__(self) -> None:
        self.specs: dict[str, dict] = {}
        self.errors: list[str] = []
        self.test = ""

    def pytest_configure(self, config):
        from triton.runtime.interpreter import InterpretedFunction

        original, recorder = InterpretedFunction.run, self

        def run(fn, *args, grid, warmup, **kwargs):
            if not warmup:
                try:
                    spec = launch_spec(fn, args, kwargs)
                    recorder.specs.setdefault(
                        json.dumps(spec, sort_keys=True), dict(spec, test=recorder.test)
                    )
                except Exception as e:  # never break the test run; report it
                    recorder.errors.append(f"{recorder.test}: {e}")
            return original(fn, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = run

    def pytest_runtest_setup(self, item):
        self.test = item.nodeid


#: Modules whose host code picks tiles and dot dtypes by ``interpreting()`` (small tiles and an fp32 dot for
#: bf16 under the interpreter); ``--gpu-host`` makes them pick the GPU's choices instead.
_HOST_CHOICE_MODULES = (
    "triage.kernels.nvfp4.gemm_dense", "triage.kernels.nvfp4.gemm_decode", "triage.kernels.moe.grouped_triton",
    "triage.kernels.nvfp4.quantize_columns", "triage.kernels.nvfp4.quantize_rows",
)  # fmt: skip


def record(out: str, pytest_args: list[str], gpu_host: bool = False) -> int:
    if not os.environ.get("TRITON_INTERPRET"):
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import importlib

    import pytest

    if gpu_host:  # the interpreter then computes bf16 dots wrongly: tests fail, the launches are still logged
        for name in _HOST_CHOICE_MODULES:
            importlib.import_module(name).interpreting = lambda: False
    recorder = _Recorder()
    rc = pytest.main(["-q", "-p", "no:cacheprovider", *pytest_args], plugins=[recorder])
    with open(out, "w") as f:
        for spec in recorder.specs.values():
            f.write(json.dumps(spec) + "\n")
    print(f"{len(recorder.specs)} distinct launch specs -> {out} (pytest exit {int(rc)})")
    for e in recorder.errors[:20]:
        print("  not recorded:", e)
    return 0 if not recorder.errors else 1


def _compile_one(spec: dict, arch: int) -> tuple[str, str, int, float, str]:
    """(label, error or "", local-memory instructions in the SASS, seconds, instruction hash)."""
    import hashlib
    import importlib
    import re

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from sass import compile_sass, instructions

    label = f"{spec['module'].rsplit('.', 1)[-1]}.{spec['name']} w{spec['num_warps']} s{spec['num_stages']}"
    t0 = time.perf_counter()
    try:
        fn = getattr(importlib.import_module(spec["module"]), spec["name"])
        sass = compile_sass(
            fn, spec["signature"], {k: _decode(v) for k, v in spec["constexprs"].items()},
            num_warps=spec["num_warps"], num_stages=spec["num_stages"], arch=arch, divisible=tuple(spec["divisible"]),
        )  # fmt: skip
    except Exception as e:
        msg = f"{type(e).__name__}: {e}".strip().splitlines()
        return label, " | ".join(msg[-3:])[:600], 0, time.perf_counter() - t0, ""
    local = len(re.findall(r"\b(?:LDL|STL)(?:\.[A-Z0-9]+)*\b", sass))
    ins = [(op, rest) for _, op, rest in instructions(sass)]
    digest = f"{hashlib.sha1(repr(ins).encode()).hexdigest()[:16]} ({len(ins)} instructions)"
    return label, "", local, time.perf_counter() - t0, digest


def _spec_key(spec: dict) -> str:
    return json.dumps({k: v for k, v in spec.items() if k != "test"}, sort_keys=True)


def compile_all(paths: list[str], arch: int, jobs: int, hashes: str | None = None) -> int:
    os.environ.pop("TRITON_INTERPRET", None)
    import multiprocessing as mp

    import triton

    specs = {}
    for path in paths:
        for line in open(path):
            spec = json.loads(line)
            specs.setdefault(_spec_key(spec), spec)
    specs = list(specs.values())
    print(f"triton {triton.__version__} ({os.path.dirname(triton.__file__)}), sm_{arch}: {len(specs)} specs")
    with mp.get_context("fork").Pool(jobs) as pool:
        results = pool.starmap(_compile_one, [(s, arch) for s in specs])
    if hashes:
        with open(hashes, "w") as f:
            json.dump({_spec_key(s): [r[0], r[1] or r[4]] for s, r in zip(specs, results)}, f, indent=0)
    failed = [(s, r) for s, r in zip(specs, results) if r[1]]
    spilled = [(s, r) for s, r in zip(specs, results) if not r[1] and r[2]]
    by_kernel: dict[str, list] = {}
    for s, r in zip(specs, results):
        by_kernel.setdefault(f"{s['module']}.{s['name']}", []).append(r)
    print(f"{'kernel':<62} {'specs':>5} {'failed':>6} {'spill':>5} {'max s':>6}")
    for k, rs in sorted(by_kernel.items()):
        n_fail, n_spill = sum(bool(r[1]) for r in rs), sum(r[2] > 0 for r in rs)
        print(f"{k:<62} {len(rs):>5} {n_fail:>6} {n_spill:>5} {max(r[3] for r in rs):>6.1f}")
    for s, r in failed:
        print(f"FAILED {r[0]} (from {s['test']}): {r[1]}")
    for s, r in spilled:
        print(f"spills {r[0]}: {r[2]} LDL/STL (from {s['test']}), constexprs {s['constexprs']}")
    print(
        f"{len(specs) - len(failed)}/{len(specs)} compiled for sm_{arch}; {len(spilled)} with local-memory traffic"
    )
    return 1 if failed else 0


def same(old: str, new: str) -> int:
    """Compare two ``compile --hashes`` files spec by spec: 0 when every spec of both compiled to the same
    instructions (or failed the same way)."""
    a, b = json.load(open(old)), json.load(open(new))
    differ = [k for k in a.keys() & b.keys() if a[k] != b[k]]
    for k in sorted(differ, key=lambda k: a[k][0]):
        print(f"DIFFERS {a[k][0]}: {a[k][1]} -> {b[k][1]}  {k[:300]}")
    only = [(f, k) for f, d, e in ((old, a, b), (new, b, a)) for k in d.keys() - e.keys()]
    for f, k in only:
        print(f"only in {f}: {k[:300]}")
    print(f"{len(a.keys() & b.keys()) - len(differ)}/{len(a.keys() | b.keys())} specs with identical instructions")
    return 1 if differ or only else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="run pytest under the interpreter and log the launch specs")
    r.add_argument("--out", default="launch_specs.jsonl")
    r.add_argument(
        "--gpu-host", action="store_true", help="host code picks GPU tiles / dot dtypes (tests may fail)"
    )
    r.add_argument("pytest_args", nargs="*", default=["tests/kernels"])
    c = sub.add_parser("compile", help="compile logged specs for a GPU target (no GPU needed)")
    c.add_argument("specs", nargs="+")
    c.add_argument("--arch", type=int, default=90)
    c.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    c.add_argument("--hashes", help="write each spec's instruction hash to this JSON file")
    s = sub.add_parser("same", help="compare two --hashes files (exit 1 if any spec's instructions differ)")
    s.add_argument("old")
    s.add_argument("new")
    a = p.parse_args()
    if a.cmd == "record":
        return record(a.out, a.pytest_args, a.gpu_host)
    if a.cmd == "same":
        return same(a.old, a.new)
    return compile_all(a.specs, a.arch, a.jobs, a.hashes)


if __name__ == "__main__":
    sys.exit(main())
