"""SASS of the grouped MoE GEMM's two forward kernels at the benchmark's tiles (sm_90, offline; see sass.py).

    PYTHONPATH=/tmp/t36 python experiments/bench/sass_grouped.py
(/tmp/t36: `pip install --no-deps --target /tmp/t36 triton==3.6.0`, the GPU image's Triton; without it the
local Triton is used.) The operands of ``bench_grouped_gemm.py``'s "kernel alone" rows: bf16 expansions of the
tokens (gathered in the kernel) and of the expert weights, one activation scale, one weight scale per expert,
bf16 output. For the pointer kernel (``_grouped_gemm_kernel``, :data:`GROUPED_CONFIG`) and the persistent TMA
kernel (``_grouped_tma_kernel``, each tile of ``bench_grouped_gemm.TMA_TILES``), one line each: the
instruction count, how the operands arrive (UTMALDG: a TMA bulk copy; LDGSTS: ``cp.async``), the wgmma
instructions (HGMMA), the barrier waits (SYNCS), and local-memory traffic (LDL/STL: spills). Static counts, not
timings: ``bench_grouped_gemm.py --skip-fused`` times the same tiles on a GPU.
"""

import collections
import os

os.environ.pop("TRITON_INTERPRET", None)
import torch

from triage.experiments.bench.bench_grouped_gemm import TMA_TILES
from triage.experiments.bench.sass import compile_sass, instructions
from triage.kernels.moe import grouped_triton as gt
from triage.kernels.nvfp4.device import SCALE_SCALAR
from triage.kernels.nvfp4.gemm_dense import dot_dtypes

_OPS = ("UTMALDG", "LDGSTS", "LDG", "HGMMA", "SYNCS", "BAR", "LDL", "STL")
_TABLES = dict(offs_ptr="*i64", tile_expert_ptr="*i32", tile_row0_ptr="*i64", rows_ptr="*i64")
_INTS = ("E", "N", "K", "stride_am", "stride_cm")


def grouped_sass(config: dict) -> str:
    """SASS of the kernel ``config`` selects (``TMA=True``: the persistent TMA kernel) for bf16 operands."""
    dot, precision = dot_dtypes(torch.bfloat16, False, torch.bfloat16, False, "grouped-GEMM")
    tiles = {k: config[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
    cx = dict(stride_ak=1, stride_cn=1, GA_MODE=SCALE_SCALAR, GB_ROW=False, GATHER=True, EVEN_K=True,
              DOT_DTYPE=dot, INPUT_PRECISION=precision, **tiles)  # fmt: skip
    sig = dict(a_ptr="*bf16", c_ptr="*bf16", ga_ptr="*fp32", gb_ptr="*fp32", **_TABLES, **dict.fromkeys(_INTS, "i32"))
    sig.update(out_mult="fp32", **dict.fromkeys(cx, "constexpr"))
    if config.get("TMA"):
        fn = gt._grouped_tma_kernel
        sig.update(b_desc=f"tensordesc<bf16[{tiles['BLOCK_N']}, {tiles['BLOCK_K']}]>", tile_end_ptr="*i64", programs="i32")
    else:
        fn = gt._grouped_gemm_kernel
        sig.update(b_ptr="*bf16", a_scale_ptr="*fp8e4nv", b_scale_ptr="*fp8e4nv")
        sig.update(dict.fromkeys(("stride_asm", "stride_be", "stride_bn", "stride_bse", "stride_bsn"), "i32"))
        cx.update(stride_ask=1, stride_bk=1, stride_bsk=1, A_PACKED=False, B_PACKED=False)
        sig.update(dict.fromkeys(cx, "constexpr"))
    # the launcher's order; every pointer and int argument divisible by 16 (GPU allocations, K and N of the
    # benchmark's shapes)
    ordered = {name: sig[name] for name in getattr(fn, "fn", fn).arg_names}  # past the FastLaunch wrapper
    divisible = tuple(k for k, v in ordered.items() if v.startswith("*") or v == "i32")
    return compile_sass(fn, ordered, cx, num_warps=config["num_warps"], num_stages=config["num_stages"],
                        divisible=divisible)  # fmt: skip


def report(config: dict) -> str:
    ops = collections.Counter(op.split(".")[0] for _, op, _ in instructions(grouped_sass(config)))
    kind = "TMA" if config.get("TMA") else "pointer"
    tile = f"{config['BLOCK_M']}x{config['BLOCK_N']}x{config['BLOCK_K']} w{config['num_warps']}s{config['num_stages']}"
    counts = "  ".join(f"{op} {ops[op]}" for op in _OPS)
    return f"{kind:<8s} {tile:<18s} {sum(ops.values()):6d} instructions  {counts}"


def main() -> None:
    import triton

    print(f"triton {triton.__version__}, sm_90, bf16 operands, gathered tokens")
    for config in (gt.GROUPED_CONFIG, *TMA_TILES):
        try:
            print(report(config))
        except Exception as exc:  # noqa: BLE001 - a tile the compiler rejects (shared memory, say)
            print(f"{config}: {type(exc).__name__}: {str(exc)[:200]}")


if __name__ == "__main__":
    main()
