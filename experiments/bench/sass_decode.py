"""SASS instructions per K step of the decode GEMV (``gemm_decode._decode_kernel``, sm_90, offline; see sass.py).

    PYTHONPATH=/tmp/t36 python experiments/bench/sass_decode.py
(/tmp/t36: `pip install --no-deps --target /tmp/t36 triton==3.6.0`, the GPU image's Triton; without it the
local Triton is used.) The M <= 16 configuration (``DECODE_CONFIG_M16``: 64 weight rows x 256 K per step,
2 warps, 3 stages), even tiles, per-row outer scales, in-kernel split-K: one line per activation dtype (bf16:
the sampler copy of a bf16 model; fp16: W4A4's activation expansions) with the hot loop's instruction count,
per weight element per thread, and the commonest opcodes. ``--mid``: the prefill-row tiles of
``bench_gemm.py --sections decode-mid`` instead (:func:`mid_report`).
"""

import collections
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
import triton.language as tl

from triage.experiments.bench.sass import compile_sass, hot_loop
from triage.kernels.nvfp4 import gemm_decode as gd

_POINTERS = dict(
    w_ptr="*i32", ws_ptr="*fp8e4nv", part_ptr="*fp32", cnt_ptr="*i32", ga_ptr="*fp32", gb_ptr="*fp32"
)
_INTS = ("M", "N", "K", "KB", "stride_xm", "stride_wn", "stride_wsn", "stride_cm", "NPART")
_MEMBER_ARGS = ("w1_ptr", "ws1_ptr", "c1_ptr", "gb1_ptr", "bias1_ptr", "N1", "T1",
                "w2_ptr", "ws2_ptr", "c2_ptr", "gb2_ptr", "bias2_ptr", "N2", "T2")  # fmt: skip


def decode_sass(dtype: str, split: int = 8, cfg: dict | None = None, bm: int = 16) -> str:
    """SASS of the decode kernel for activations and outputs of ``dtype`` ("bf16" or "fp16"), tiles ``cfg``
    (default ``DECODE_CONFIG_M16``) with ``bm`` activation rows per program."""
    cfg = cfg or gd.DECODE_CONFIG_M16
    sig = dict(x_ptr=f"*{dtype}", c_ptr=f"*{dtype}", bias_ptr=f"*{dtype}", out_mult="fp32", **_POINTERS)
    sig.update(dict.fromkeys(_INTS, "i32"))
    cx = dict(
        stride_cn=1, GA_MODE=0, GB_MODE=2, HAS_BIAS=False, BF16_BY_HAND=False, SPLIT_K=split,
        DOT_DTYPE=tl.bfloat16 if dtype == "bf16" else tl.float16, INPUT_PRECISION="tf32", EVEN_N=True,
        EVEN_K=True, BF16=dtype == "bf16", BM=bm, BN=cfg["BN"], NB=cfg["NB"], PREFETCH=cfg["PREFETCH"],
        FUSED_REDUCE=split > 1, MEMBERS=1, **{k: None if "ptr" in k else 0 for k in _MEMBER_ARGS},
    )  # fmt: skip
    sig.update(dict.fromkeys(cx, "constexpr"))
    divisible = tuple(k for k, v in sig.items() if v.startswith("*")) + tuple(k for k in _INTS if k != "M")
    return compile_sass(gd._decode_kernel, sig, cx, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                        divisible=divisible)  # fmt: skip


def mid_report() -> None:
    """``--mid``: the hot loop of each prefill-row tile of ``bench_gemm.py``'s ``decode-mid`` section (bf16, no
    split): instructions per weight element per thread (a weight element is unpacked once per tile of BM
    activation rows) and whether the unpacked weight passes through shared memory (``STS``/``LDSM``)."""
    from triage.experiments.bench.bench_gemm import DECODE_MID_CANDIDATES

    for name, c in {"DECODE_CONFIG_MID": dict(gd.DECODE_CONFIG_MID), **DECODE_MID_CANDIDATES}.items():
        loop = hot_loop(decode_sass("bf16", split=1, cfg=c, bm=c["BM"]))
        ops = collections.Counter(op.split(".")[0] for _, op, _ in loop)
        elements = c["BN"] * 16 * c["NB"] / (32 * c["num_warps"])
        print(f"{name}: {len(loop)} instructions per K step, {len(loop) / elements:.2f} per weight element per "
              f"thread; STS {ops['STS']}, LDSM {ops['LDSM']}, HGMMA {ops['HGMMA']}, HMMA {ops['HMMA']}")  # fmt: skip


if __name__ == "__main__":
    import triton

    if "--mid" in sys.argv:
        mid_report()
        sys.exit(0)
    cfg = gd.DECODE_CONFIG_M16
    elements = cfg["BN"] * 16 * cfg["NB"] / (32 * cfg["num_warps"])  # weight elements per thread per K step
    print(
        f"triton {triton.__version__}, sm_90, decode kernel hot loop per {cfg['BN']}x{16 * cfg['NB']} K step"
    )
    for dtype in sys.argv[1:] or ("bf16", "fp16"):
        loop = hot_loop(decode_sass(dtype))
        ops = collections.Counter(op.split(".")[0] for _, op, _ in loop)
        top = " ".join(f"{o} {n}" for o, n in ops.most_common(10))
        print(
            f"{dtype}: {len(loop)} instructions ({len(loop) / elements:.2f} per weight element per thread): {top}"
        )
