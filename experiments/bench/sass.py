"""Offline SASS inspection of a Triton kernel for sm_90 — no GPU needed.

Triton compiles for any target on a CPU-only machine (its wheel ships ``ptxas`` and ``nvdisasm``), so the
instruction mix of a kernel's hot loop can be counted before spending GPU time. Usage from Python::

    from triage.experiments.bench.sass import compile_sass, loop_report
    sass = compile_sass(kernel, signature={"x_ptr": "*bf16", "n": "i32", "B": "constexpr"},
                        constexprs={"B": 1024}, num_warps=4)
    print(loop_report(sass, elements_per_iteration=1024))

``loop_report`` finds the innermost backward branch (the hot loop) and counts its instructions by opcode;
divided by the elements one iteration handles (per CTA) and multiplied by the threads of a CTA it gives
instructions per element per thread, the number that decides whether a streaming kernel is ALU-bound
(an H200 SM issues 4 warp-instructions per clock: ~128 lanes·ops per clock).

The GPU image runs Triton 3.6; this machine's Triton may be newer, so counts are indicative.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile


def compile_sass(fn, signature: dict, constexprs: dict, *, num_warps: int = 4, num_stages: int = 1,
                 arch: int = 90, divisible: tuple | None = None) -> str:  # fmt: skip
    """Compile a ``@triton.jit`` function for ``sm_{arch}`` and return its SASS text.

    ``divisible``: argument names the launcher would specialize as divisible by 16 (``tt.divisibility``);
    default every pointer argument, as on the GPU for ``torch`` allocations. Integer arguments that are
    multiples of 16 at run time (row lengths, ...) should be listed too: without the hint Triton cannot
    prove contiguity and falls back to scalar loads and another layout, so the SASS would not be the GPU's."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("unset TRITON_INTERPRET before importing triton to compile SASS")
    import triton
    import triton.backends.nvidia as nv

    fn = fn.fn if type(fn).__name__ == "FastLaunch" else fn  # triage.kernels._launch wrapper
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if divisible is None:
        divisible = tuple(k for k, v in signature.items() if isinstance(v, str) and v.startswith("*"))
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in divisible}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(
        src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps, num_stages=num_stages)
    )
    nvdisasm = os.path.join(os.path.dirname(nv.__file__), "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout


_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def instructions(sass: str) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) for every instruction in the SASS text."""
    return [(int(a, 16), op, rest.strip()) for a, op, rest in _LINE.findall(sass)]


def _labels(sass: str) -> dict[str, int]:
    """Label name (``.L_x_3``) -> address of the next instruction (newer nvdisasm prints branch targets as
    labels, not addresses)."""
    out, pending = {}, []
    for line in sass.splitlines():
        m = re.match(r"\s*(\.L\w+):", line)
        if m:
            pending.append(m.group(1))
            continue
        a = re.search(r"/\*([0-9a-f]{4,})\*/", line)
        if a and pending:
            for name in pending:
                out[name] = int(a.group(1), 16)
            pending = []
    return out


def loops(sass: str) -> list[list[tuple[int, str, str]]]:
    """Every loop body (backward branch target .. the branch), in program order."""
    ins = instructions(sass)
    addr = {a: i for i, (a, _, _) in enumerate(ins)}
    labels = _labels(sass)
    out = []
    for i, (a, op, rest) in enumerate(ins):
        if op.startswith("BRA"):
            m = re.search(r"0x([0-9a-f]+)", rest)
            t = int(m.group(1), 16) if m else None
            if t is None:
                lm = re.search(r"\((\.L\w+)\)", rest)
                t = labels.get(lm.group(1)) if lm else None
            if t is not None and t < a and t in addr:
                out.append(ins[addr[t] : i + 1])
    return out


def hot_loop(sass: str) -> list[tuple[int, str, str]]:
    """Instructions of the innermost loop (the backward branch spanning the fewest instructions)."""
    ls = loops(sass)
    return min(ls, key=len) if ls else instructions(sass)


def loop_report(sass: str, elements_per_iteration: int, threads: int = 128, top: int = 12) -> str:
    """Instruction count of the hot loop, per element per thread, and the commonest opcodes."""
    loop = hot_loop(sass)
    ops = collections.Counter(op.split(".")[0] for _, op, _ in loop)
    per_elt = len(loop) * threads / elements_per_iteration
    lines = [f"hot loop: {len(loop)} instructions, {per_elt:.2f} per element (x{threads} threads)"]
    lines += [f"  {op:10s} {n}" for op, n in ops.most_common(top)]
    return "\n".join(lines)
