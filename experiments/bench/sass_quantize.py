"""SASS instructions per element of the NVFP4 quantize kernel (sm_90, offline; see sass.py).

    PYTHONPATH=/tmp/t36 python experiments/bench/sass_quantize.py [old]
(/tmp/t36: `pip install --no-deps --target /tmp/t36 triton==3.6.0`, the GPU image's Triton; without it the
local Triton is used.) "old" also compiles the general path (PAIRS=False). One line per loop of the kernel
(row scale: the amax sweep || the quantize loop); the last lines are the per-tensor amax pass with Hadamard.
"""

import collections
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
from triage.experiments.bench.sass import compile_sass, loops
from triage.kernels.nvfp4 import quantize_rows as q

SIG = dict(
    x_ptr="*i16",
    data_ptr="*u8",
    scale_ptr="*u8",
    exp_ptr="*i16",
    enc_ptr="*fp32",
    dec_ptr="*fp32",
    amax_ptr="*fp32",
    group_amax_ptr="*i32",
    enc_arg="fp32",
    dec_arg="fp32",
    amax_arg="fp32",
    N="i32",
    K="i32",
    KP="i32",
    rows_per_outer="i32",
    key="i32",
)
CX = [
    "PAIRS",
    "PROFILE",
    "OUTER",
    "TILE16",
    "HADAMARD",
    "ROUND",
    "STOCHASTIC",
    "SIGNBIT",
    "SIGNS",
    "WRITE_AMAX",
    "EXPANDED",
    "BR",
    "NB",
]


def quant(name, BR=8, NB=16, nw=4, **kw):
    c = dict(
        PAIRS=False,
        PROFILE=0,
        OUTER=1,
        TILE16=False,
        HADAMARD=False,
        ROUND=1,
        STOCHASTIC=False,
        SIGNBIT=True,
        SIGNS=q.SIGN_MASK,
        WRITE_AMAX=True,
        EXPANDED=0,
        BR=BR,
        NB=NB,
    )
    c.update(kw)
    sig = dict(SIG)
    sig.update({k: "constexpr" for k in CX})
    if c["PAIRS"]:
        sig.update(x_ptr="*i32", data_ptr="*i32", exp_ptr="*i32")
    div = tuple(k for k in SIG if SIG[k].startswith("*")) + ("N", "K", "KP", "rows_per_outer")
    s = compile_sass(q._quantize_kernel.fn, signature=sig, constexprs=c, num_warps=nw, divisible=div)
    report(name, s, BR * NB * 16, nw * 32)
    if os.environ.get("DUMP"):
        dump(name.replace(" ", "_"), s)
    return s


def report(name, s, elems, threads):
    ls = loops(s)
    parts = []
    for l in ls:
        ops = collections.Counter(op.split(".")[0] for _, op, _ in l)
        parts.append(
            f"{len(l)} ins = {len(l) * threads / elems:.2f}/elt [{', '.join(f'{k}{v}' for k, v in ops.most_common(8))}]"
        )
    print(f"{name:40s}", " || ".join(parts), flush=True)


def amax(name, BLOCK=4096, nw=8):
    sig = dict(
        x_ptr="*i16",
        amax_ptr="*i32",
        n_per_group="i32",
        CHUNK="i32",
        PROPAGATE_NAN="constexpr",
        ROUND="constexpr",
        BLOCK="constexpr",
    )
    s = compile_sass(
        q._amax_flat_kernel.fn,
        signature=sig,
        constexprs=dict(PROPAGATE_NAN=False, ROUND=1, BLOCK=BLOCK),
        num_warps=nw,
        divisible=("x_ptr", "amax_ptr", "n_per_group", "CHUNK"),
    )
    report(name, s, BLOCK, nw * 32)


def amax_hadamard(name, pairs, BR=8, NB=32, nw=4):
    """The per-tensor amax pass with Hadamard: general (``_amax_tiled_kernel``) or fast-path layout."""
    if pairs:
        fn, sig = q._amax_pairs_kernel, dict(x_ptr="*i32", amax_ptr="*i32", rows_per_group="i32", KP="i32")
        cx = dict(PROPAGATE_NAN=False, SIGNS=q.SIGN_MASK, BR=BR, NB=NB)
    else:
        fn = q._amax_tiled_kernel
        sig = dict(x_ptr="*i16", amax_ptr="*i32", rows_per_group="i32", K="i32", KP="i32")
        cx = dict(PROPAGATE_NAN=False, HADAMARD=True, ROUND=1, SIGNS=q.SIGN_MASK, BR=BR, NB=NB)
    sig.update({k: "constexpr" for k in cx})
    div = tuple(k for k in sig if k not in cx)
    s = compile_sass(fn.fn, signature=sig, constexprs=cx, num_warps=nw, divisible=div)
    report(name, s, BR * NB * 16, nw * 32)


def dump(name, s):
    l = max(loops(s), key=len)
    open(f"/tmp/q/{name}.loop", "w").write("\n".join(f"{a:05x} {op} {r}" for a, op, r in l))


if __name__ == "__main__":
    P = dict(PAIRS=True)
    for nm, kw in [
        ("tensor 1x16 nearest te", {}),
        ("row 1x16 nearest te", dict(OUTER=2)),
        ("static 1x16 nearest te", dict(OUTER=0)),
        ("tensor 1x16 stochastic te", dict(STOCHASTIC=True)),
        ("tensor 16x16 nearest te", dict(TILE16=True, BR=16)),
        ("tensor torchao", dict(PROFILE=1)),
        ("tensor modelopt", dict(PROFILE=2, SIGNBIT=False)),
        ("tensor ct", dict(PROFILE=3, SIGNBIT=False)),
        ("static + expanded", dict(OUTER=0, EXPANDED=1)),
        ("row 1x16 nearest te +hadamard", dict(OUTER=2, HADAMARD=True)),
        ("tensor 1x16 nearest te +hadamard", dict(HADAMARD=True)),
        ("tensor 1x16 stochastic te +hadamard", dict(STOCHASTIC=True, HADAMARD=True)),
    ]:
        if "old" in sys.argv:
            quant("OLD " + nm, **kw)
        quant("NEW " + nm, **P, **{"NB": 16 if kw.get("TILE16") else 32, **kw})  # the default tiles
    if "old" in sys.argv:
        amax_hadamard("OLD amax pass +hadamard", False, BR=8, NB=16)
    amax_hadamard("NEW amax pass +hadamard", True)
