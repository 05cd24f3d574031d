"""Triton kernels of the dense NVFP4 GEMM behind :func:`triage.kernels.nvfp4.gemm` (Hopper path, Blackwell
path), and the host pieces the decode (:mod:`.gemm_decode`) and grouped GEMMs share with it: the dot
dtype rule (:func:`dot_dtypes`), the split-K reduction (:func:`splitk_reduce`).

One tiled kernel, :func:`_gemm_kernel`, computes ``C = epilogue(A·Bᵀ)`` where each operand is either
*packed* NVFP4 (uint8 codes + e4m3 block scales, unpacked and scaled in registers) or *dense*
(bf16/fp16 values read as they are). So the same kernel is the W4A4 GEMM (both packed), the W4A16 GEMM
(A dense activations, B packed weights), the small-M decode GEMM (same, with split-K) and a plain
GEMM over pre-expanded operands (both dense). For two dense operands on sm_90+ above 256 rows,
:func:`_gemm_tma_kernel` computes the same: persistent, both operands read through TMA descriptors, no
split-K (:func:`_tile_config`).

Unpacking, exact by construction. An E2M1 code ``c`` (sign bit 3, magnitude bits 0-2) becomes the fp16
bit pattern ``(c & 8) << 12 | (c & 7) << 9``, whose value is ``e2m1(c)·2⁻¹⁴`` (codes 0/1 land on the fp16
subnormals 0 and 2⁻¹⁵, the others on normals). Multiplying by the e4m3 scale in fp16 is exact: ``q·s`` has
≤ 6 significant bits and ``q·s·2⁻¹⁴`` is a multiple of 2⁻²⁴ (the fp16 subnormal step) below 2688·2⁻¹⁴. The
tensor cores then multiply exact operands exactly and accumulate in fp32; the epilogue multiplies by
``2¹⁴`` (:data:`~.device.UNPACK_FACTOR`) per packed operand (a power of two: exact), by the fp32 outer
scales and adds the bias (:func:`~.device.epilogue`).

Dot dtype: fp16 for W4A4 (exact, and correct under ``TRITON_INTERPRET=1``); the activation's dtype for
W4A16 (``q·s·2⁻¹⁴`` is exact in bf16 as well). Under the interpreter, bf16 ``tl.dot`` is broken, so
bf16 operands are upcast to fp32 there (``input_precision="ieee"``): :func:`dot_dtypes`.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from triage.kernels._launch import cdiv, fast_launch
from triage.kernels.nvfp4.device import (
    epilogue,
    interpreting,
    load_tile,
    operand_strides,
    scale_mode,
    swizzled_tile,
    unpack_mult,
)

_TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def dot_dtypes(a_dtype: torch.dtype, a_packed: bool, b_dtype: torch.dtype, b_packed: bool, what: str) -> tuple:
    """``(DOT_DTYPE, INPUT_PRECISION)`` of a ``tl.dot`` over operands of dtypes ``a_dtype`` and ``b_dtype``
    (packed or dense): the dense operands' dtype (they must share one; fp16 when both are packed:
    ``q·s·2⁻¹⁴`` is exact there), "ieee" precision for fp32, "tf32" otherwise (which 16-bit dots ignore).
    Under the interpreter a bf16 dot becomes an fp32 "ieee" one (its bf16 ``tl.dot`` is wrong; fp32 holds
    ``q·s`` exactly). ``what`` names the GEMM in the error."""
    dense = [d for d, p in ((a_dtype, a_packed), (b_dtype, b_packed)) if not p]
    if dense and any(d != dense[0] for d in dense):
        raise TypeError(f"dense {what} operands must share a dtype, got {dense}")
    dot_dtype = dense[0] if dense else torch.float16
    if interpreting() and dot_dtype == torch.bfloat16:
        dot_dtype = torch.float32
    return _TL_DTYPE[dot_dtype], "ieee" if dot_dtype == torch.float32 else "tf32"


def bf16_by_hand(out_dtype: torch.dtype) -> bool:
    """The epilogue's ``BF16_BY_HAND`` for an output of ``out_dtype``: a bf16 output under the interpreter,
    whose fp32 -> bf16 cast truncates, is rounded by integer arithmetic (:func:`~.device.to_bf16_rne`)."""
    return interpreting() and out_dtype == torch.bfloat16


@fast_launch
@triton.jit
def _gemm_kernel(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    c_ptr,
    ws_ptr,
    ga_ptr,
    gb_ptr,
    bias_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_asm,
    stride_ask,
    stride_bn,
    stride_bk,
    stride_bsn,
    stride_bsk,
    stride_cm,
    stride_cn,
    out_mult,
    A_PACKED: tl.constexpr,
    B_PACKED: tl.constexpr,
    GA_MODE: tl.constexpr,
    GB_MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BF16_BY_HAND: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Tile (BLOCK_M × BLOCK_N) of ``A[M,K]·B[N,K]ᵀ``; program axis 1 is the split-K index.

    SPLIT_K == 1: the epilogue runs here. SPLIT_K > 1: the fp32 partial sum of K-slice ``pid_k`` goes
    to ``ws[pid_k, M, N]`` and :func:`_splitk_reduce_kernel` sums the slices in a fixed order
    (deterministic) and runs the epilogue.
    """
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = swizzled_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_begin = pid_k * k_span
    k_end = min(K, k_begin + k_span)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_end
        a = load_tile(
            a_ptr,
            a_scale_ptr,
            offs_m[:, None],
            offs_k[None, :],
            (offs_m[:, None] < M) & k_ok[None, :],
            stride_am,
            stride_ak,
            stride_asm,
            stride_ask,
            A_PACKED,
            DOT_DTYPE,
        )
        b = load_tile(
            b_ptr,
            b_scale_ptr,
            offs_n[None, :],
            offs_k[:, None],
            k_ok[:, None] & (offs_n[None, :] < N),
            stride_bn,
            stride_bk,
            stride_bsn,
            stride_bsk,
            B_PACKED,
            DOT_DTYPE,
        )
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)

    if SPLIT_K == 1:
        epilogue(
            acc, offs_m, offs_n, M, N, c_ptr, stride_cm, stride_cn, ga_ptr, gb_ptr, bias_ptr, out_mult,
            GA_MODE, GB_MODE, HAS_BIAS, BF16_BY_HAND,
        )  # fmt: skip
    else:
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        ws = ws_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :]
        tl.store(ws, acc, mask=mask)


@triton.jit
def _gemm_tma_kernel(
    a_desc, b_desc, c_ptr, ga_ptr, gb_ptr, bias_ptr, M, N, K, stride_cm, stride_cn, out_mult,
    GA_MODE: tl.constexpr, GB_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, BF16_BY_HAND: tl.constexpr,
    DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, programs,
):  # fmt: skip
    """:func:`_gemm_kernel` for two dense operands without split-K, persistent and fed by TMA: ``programs``
    programs (at most one per SM) sweep the output tiles (``tile = pid, pid + programs, ...``, grouped as
    :func:`~.device.swizzled_tile`); ``a_desc`` / ``b_desc`` are tensor descriptors of A [M, K] and B [N, K]
    with blocks [BLOCK_M, BLOCK_K] / [BLOCK_N, BLOCK_K]. TMA fills what lies past M, N or K with zeros, so
    the loop has no masks. The same fp32 sums of the same exact products, the same epilogue."""
    k_steps = tl.cdiv(K, BLOCK_K)
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, programs, flatten=True):
        pid_m, pid_n = swizzled_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ks in range(k_steps):
            a = a_desc.load([pid_m * BLOCK_M, ks * BLOCK_K]).to(DOT_DTYPE)
            b = b_desc.load([pid_n * BLOCK_N, ks * BLOCK_K]).to(DOT_DTYPE)
            acc = tl.dot(a, b.T, acc, input_precision=INPUT_PRECISION)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        epilogue(
            acc, offs_m, offs_n, M, N, c_ptr, stride_cm, stride_cn, ga_ptr, gb_ptr, bias_ptr, out_mult,
            GA_MODE, GB_MODE, HAS_BIAS, BF16_BY_HAND,
        )  # fmt: skip


@fast_launch
@triton.jit
def _splitk_reduce_kernel(
    ws_ptr,
    c_ptr,
    ga_ptr,
    gb_ptr,
    bias_ptr,
    M,
    N,
    stride_cm,
    stride_cn,
    out_mult,
    GA_MODE: tl.constexpr,
    GB_MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BF16_BY_HAND: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Sum the split-K partials in slice order (fixed, so deterministic), then the epilogue."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(ws_ptr + s * M * N + offs_m[:, None] * N + offs_n[None, :], mask=mask, other=0.0)
    epilogue(
        acc, offs_m, offs_n, M, N, c_ptr, stride_cm, stride_cn, ga_ptr, gb_ptr, bias_ptr, out_mult,
        GA_MODE, GB_MODE, HAS_BIAS, BF16_BY_HAND,
    )  # fmt: skip


@fast_launch
@triton.jit
def _dot_scaled_kernel(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    c_ptr,
    ga_ptr,
    gb_ptr,
    bias_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_asm,
    stride_ask,
    stride_bn,
    stride_bk,
    stride_bsn,
    stride_bsk,
    stride_cm,
    stride_cn,
    GA_MODE: tl.constexpr,
    GB_MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Blackwell (sm_100+) W4A4: native ``tl.dot_scaled`` with e2m1 codes and e4m3 scales per 16.

    UNTESTED ON HARDWARE (no sm_100 machine here; Triton 3.6 crashes compiling this on sm_90 and the
    Triton 3.9 interpreter decodes every scale as e8m0, so it cannot check it either). Requires
    K % BLOCK_K == 0. Never selected on Hopper.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kb = tl.arange(0, BLOCK_K // 2)
    offs_ks = tl.arange(0, BLOCK_K // 16)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(
            a_ptr + offs_m[:, None] * stride_am + (k0 // 2 + offs_kb)[None, :] * stride_ak,
            mask=offs_m[:, None] < M,
            other=0,
        )
        a_s = tl.load(
            a_scale_ptr + offs_m[:, None] * stride_asm + (k0 // 16 + offs_ks)[None, :] * stride_ask,
            mask=offs_m[:, None] < M,
            other=0.0,
        )
        b = tl.load(
            b_ptr + offs_n[None, :] * stride_bn + (k0 // 2 + offs_kb)[:, None] * stride_bk,
            mask=offs_n[None, :] < N,
            other=0,
        )
        b_s = tl.load(
            b_scale_ptr + offs_n[:, None] * stride_bsn + (k0 // 16 + offs_ks)[None, :] * stride_bsk,
            mask=offs_n[:, None] < N,
            other=0.0,
        )
        acc = tl.dot_scaled(a, a_s, "e2m1", b, b_s, "e2m1", acc)
    epilogue(
        acc, offs_m, offs_n, M, N, c_ptr, stride_cm, stride_cn, ga_ptr, gb_ptr, bias_ptr, 1.0, GA_MODE,
        GB_MODE, HAS_BIAS, False,
    )  # fmt: skip


def num_sms() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


#: Whether a CUDA device (by index) runs the TMA kernel's tiles, read once per device.
_TMA: dict[int, bool] = {}
#: Shared memory per block the TMA kernel's tiles need (:data:`TMA_CONFIG`: ~176 KiB, offline compile for sm_90).
TMA_SHARED_BYTES = 192 * 1024


def tma_supported(index: int | None = None) -> bool:
    """Whether CUDA device ``index`` (default: the current one) can run :func:`_gemm_tma_kernel` with
    :data:`TMA_CONFIG`'s tiles: TMA (sm_90 and later) and :data:`TMA_SHARED_BYTES` of shared memory per block
    (sm_90 and sm_100 have ~227 KiB; sm_120 has ~99 KiB and keeps the pointer kernel). Measured on sm_90 only."""
    index = torch.cuda.current_device() if index is None else index
    ok = _TMA.get(index)
    if ok is None:
        props = torch.cuda.get_device_properties(index)
        smem = getattr(props, "shared_memory_per_block_optin", None)
        ok = props.major >= 9 and (smem >= TMA_SHARED_BYTES if smem is not None else props.major in (9, 10))
        _TMA[index] = ok
    return ok


#: Large-M tile of the pointer kernel (:func:`_gemm_kernel`; on sm_90+ two dense operands take the TMA kernel,
#: :data:`TMA_CONFIG`): the best of the H200 sweep in bench_gemm.py --sweep (2026-11-29: 256x128x64 w8 s3 at
#: 1.13-1.34x cuBLAS bf16; 128x256x64 w8 s3/s4 1.19-1.40x).
DENSE_CONFIG = dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)


#: Tiles of the dense GEMM between the decode-sized (M ≤ 64) and the large-M ones (:data:`DENSE_CONFIG`), by
#: the largest M each serves (a prompt's forward in a sampler: batch × prompt width rows), each with K split
#: (:func:`mid_split`) while its programs fill less than one wave. :data:`DENSE_CONFIG`'s 256-row tiles leave
#: most SMs idle there (M = 128, N = 1024: 8 programs). From the H100 sweep at Qwen3-4B's shapes
#: (docs/benchmarks.md, "W4A16 and the dense GEMM at prefill rows"; in sum over the five shapes: 64×128 within
#: 5 % of the fastest at 128 and 256 rows, 128×128 the fastest at 512-2048, DENSE_CONFIG at 4096).
MID_CONFIGS = (
    (256, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)),
    (2048, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)),
)
#: The least of K a split of a mid-M GEMM keeps.
MID_MIN_SPLIT_K = 512

#: Tiles of the persistent TMA kernel (:func:`_gemm_tma_kernel`, no split-K), which two dense operands take on
#: sm_90+ in place of the pointer kernel: above the last of :data:`MID_CONFIGS`' rows :data:`TMA_CONFIG`;
#: above the first, :data:`TMA_MID_CONFIG` where its 128 × 128 tiles number at least :data:`TMA_MIN_TILES`
#: (fewer tiles leave SMs idle that the pointer kernel's split-K fills). From the H100 sweep
#: (bench_gemm.py --sections dense-tma, docs/benchmarks.md "W4A4 GEMM forward"): 128 × 256 w8 s3 took
#: 0.94-1.02× cuBLAS bf16's time at 8,192-16,384 rows, the pointer kernel's 256 × 128 tiles 1.13-1.26×;
#: with this rule 128 × 128 w4 s4 took 20 % / 15 % / 20 % less time than the pointer kernel over a
#: Qwen3-4B layer's seven GEMMs at 512 / 1,024 / 2,048 rows.
TMA_CONFIG = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
TMA_MID_CONFIG = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
TMA_MIN_TILES = 64


def _tile_config(M: int, N: int, K: int, split_k: int | None, dense: bool = False) -> dict:
    """Tile sizes: tiny and fast to interpret under TRITON_INTERPRET; on the GPU the decode-sized tiles up to
    64 rows, :data:`MID_CONFIGS` (split-K to fill the GPU) up to 2,048 and :data:`DENSE_CONFIG` above; for
    two ``dense`` operands on sm_90+ with no split asked for, the TMA kernel's tiles above 256 rows
    (:data:`TMA_CONFIG`, :data:`TMA_MID_CONFIG`; ``TMA=True``)."""
    if interpreting():
        return dict(
            BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=2, SPLIT_K=split_k or 1, num_warps=4, num_stages=1
        )
    if M <= 64:
        # Memory-bound decode: small M tile, wide K, split K until the grid fills the GPU.
        bm = 16 if M <= 16 else (32 if M <= 32 else 64)
        bn, bk = 64, 256
        tiles = cdiv(M, bm) * cdiv(N, bn)
        if split_k is None:
            split_k = 1
            while tiles * split_k < 2 * num_sms() and K // (split_k * 2) >= bk:
                split_k *= 2
        return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, SPLIT_K=split_k, num_warps=4, num_stages=3)
    if dense and split_k is None and M > MID_CONFIGS[0][0] and tma_supported():
        if M > MID_CONFIGS[-1][0]:
            return dict(TMA_CONFIG, SPLIT_K=1, TMA=True)
        if cdiv(M, TMA_MID_CONFIG["BLOCK_M"]) * cdiv(N, TMA_MID_CONFIG["BLOCK_N"]) >= TMA_MIN_TILES:
            return dict(TMA_MID_CONFIG, SPLIT_K=1, TMA=True)
    for largest, cfg in MID_CONFIGS:
        if M <= largest:
            return dict(cfg, SPLIT_K=split_k or mid_split(M, N, K, cfg))
    return dict(DENSE_CONFIG, SPLIT_K=split_k or 1)


def mid_split(M: int, N: int, K: int, cfg: dict) -> int:
    """Split-K of a mid-M GEMM with tiles ``cfg``: doubled while the programs fill less than one wave of the
    SMs and each split keeps at least :data:`MID_MIN_SPLIT_K` of K."""
    tiles = cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"])
    split = 1
    while tiles * split < num_sms() and K // (split * 2) >= MID_MIN_SPLIT_K:
        split *= 2
    return split


def launch_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    b: torch.Tensor,
    b_scale: torch.Tensor | None,
    K: int,
    out: torch.Tensor,
    g_a: torch.Tensor | None,
    g_b: torch.Tensor | None,
    bias: torch.Tensor | None,
    *,
    split_k: int | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """``out[M,N] = ((A·Bᵀ)·g_a)·g_b + bias``; A is packed iff ``a_scale`` is given (same for B).

    ``a``: packed uint8 [M, K/2] or dense [M, K]; ``b``: packed uint8 [N, K/2] or dense [N, K];
    ``g_a``: None, 1 element or [M] fp32; ``g_b``: None, 1 element or [N] fp32; ``bias``: [N] or None.
    """
    M, N = out.shape
    launch = dense_launch(
        M, N, K, a.dtype, a_scale is not None, b.dtype, b_scale is not None, out.dtype, split_k=split_k, config=config
    )
    return launch.run(a, a_scale, b, b_scale, out, g_a, g_b, bias)


@dataclasses.dataclass(frozen=True)
class DenseLaunch:
    """What :func:`launch_gemm` derives from M, N, K, the operands' dtypes and packing, the output dtype and
    the tiles alone (grid, split-K, dot dtype, epilogue multiplier, constexprs): built by
    :func:`dense_launch`, kept by a caller's plan (``matmul.GemmPlan``); :meth:`run` allocates the split-K
    workspace and launches."""

    M: int
    N: int
    K: int
    grid: tuple[int, int]
    split: int
    out_mult: float
    kwargs: dict  # constexprs, num_warps, num_stages
    tma: bool = False  # dense operands, no split: :func:`_gemm_tma_kernel` where both operands allow TMA
    programs: int = 0  # the TMA kernel's persistent programs: min(tiles, SMs)
    tma_kwargs: dict = dataclasses.field(default_factory=dict)  # the TMA kernel's constexprs, warps, stages

    def run(self, a, a_scale, b, b_scale, out, g_a, g_b, bias) -> torch.Tensor:
        """:func:`launch_gemm` for operands of the planned shapes, dtypes and packing."""
        dummy = out  # never dereferenced when the matching constexpr switch is off
        if self.tma and tma_ready(a) and tma_ready(b):
            kw = self.tma_kwargs
            _gemm_tma_kernel[(self.programs,)](
                TensorDescriptor(a, [self.M, self.K], [a.stride(0), 1], [kw["BLOCK_M"], kw["BLOCK_K"]]),
                TensorDescriptor(b, [self.N, self.K], [b.stride(0), 1], [kw["BLOCK_N"], kw["BLOCK_K"]]),
                out, g_a if g_a is not None else dummy, g_b if g_b is not None else dummy,
                bias if bias is not None else dummy, self.M, self.N, self.K, out.stride(0), out.stride(1),
                self.out_mult, GA_MODE=scale_mode(g_a), GB_MODE=scale_mode(g_b), HAS_BIAS=bias is not None,
                programs=self.programs, **kw,
            )  # fmt: skip
            return out
        split = self.split
        ws = torch.empty((split, self.M, self.N), device=out.device, dtype=torch.float32) if split > 1 else dummy
        _gemm_kernel[self.grid](
            a, a_scale if a_scale is not None else dummy, b, b_scale if b_scale is not None else dummy, out, ws,
            g_a if g_a is not None else dummy, g_b if g_b is not None else dummy,
            bias if bias is not None else dummy, self.M, self.N, self.K,
            *operand_strides(a, a_scale), *operand_strides(b, b_scale), out.stride(0), out.stride(1),
            self.out_mult, GA_MODE=scale_mode(g_a), GB_MODE=scale_mode(g_b), HAS_BIAS=bias is not None,
            **self.kwargs,
        )  # fmt: skip
        if split > 1:
            splitk_reduce(ws, out, g_a, g_b, bias, self.out_mult, split)
        return out


def dense_launch(
    M: int,
    N: int,
    K: int,
    a_dtype: torch.dtype,
    a_packed: bool,
    b_dtype: torch.dtype,
    b_packed: bool,
    out_dtype: torch.dtype,
    *,
    split_k: int | None = None,
    config: dict | None = None,
) -> DenseLaunch:
    """The :class:`DenseLaunch` of :func:`launch_gemm` (``config``: tiles, default :func:`_tile_config`)."""
    dot_dtype, input_precision = dot_dtypes(a_dtype, a_packed, b_dtype, b_packed, "GEMM")
    cfg = dict(config) if config else _tile_config(M, N, K, split_k, dense=not (a_packed or b_packed))
    tma = bool(cfg.pop("TMA", False)) and not (a_packed or b_packed) and cfg["SPLIT_K"] == 1
    tma = tma and (interpreting() or tma_supported())
    grid = (cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]), cfg["SPLIT_K"])
    kwargs = dict(
        A_PACKED=a_packed, B_PACKED=b_packed, BF16_BY_HAND=bf16_by_hand(out_dtype),
        DOT_DTYPE=dot_dtype, INPUT_PRECISION=input_precision, **cfg,
    )  # fmt: skip
    out_mult = unpack_mult(a_packed, b_packed)
    programs, tma_kwargs = 0, {}
    if tma:  # the TMA kernel's constexprs (no packing or split switches) and persistent programs
        tma_kwargs = {k: v for k, v in kwargs.items() if k not in ("A_PACKED", "B_PACKED", "SPLIT_K")}
        programs = min(grid[0], 3 if interpreting() else num_sms())  # (interpreted: several tiles each)
    return DenseLaunch(
        M=M, N=N, K=K, grid=grid, split=cfg["SPLIT_K"], out_mult=out_mult, kwargs=kwargs, tma=tma,
        programs=programs, tma_kwargs=tma_kwargs,
    )  # fmt: skip


def tma_ready(t: torch.Tensor) -> bool:
    """Whether a 2-D operand can be read through a TMA descriptor: not empty, unit last stride, rows that do
    not overlap, 16-byte aligned base and row stride (otherwise :class:`DenseLaunch` runs :func:`_gemm_kernel`
    on it)."""
    return (
        t.dim() == 2
        and t.numel() > 0
        and t.stride(1) == 1
        and t.stride(0) >= t.shape[1]
        and (t.stride(0) * t.element_size()) % 16 == 0
        and t.data_ptr() % 16 == 0
    )


def splitk_reduce(ws, out, g_a, g_b, bias, out_mult, split) -> None:
    """``out = epilogue(Σ_s ws[s])`` over the split-K partials ``ws`` [split, M, N] (fp32), summed in
    slice order (deterministic): the second kernel of a split-K :func:`launch_gemm` or decode launch."""
    M, N = out.shape
    dummy = out
    bm, bn = (16, 16) if interpreting() else (16, 128)
    _splitk_reduce_kernel[(cdiv(M, bm), cdiv(N, bn))](
        ws, out, g_a if g_a is not None else dummy, g_b if g_b is not None else dummy,
        bias if bias is not None else dummy, M, N, out.stride(0), out.stride(1), out_mult,
        GA_MODE=scale_mode(g_a), GB_MODE=scale_mode(g_b), HAS_BIAS=bias is not None,
        BF16_BY_HAND=bf16_by_hand(out.dtype), SPLIT_K=split, BLOCK_M=bm, BLOCK_N=bn,
    )  # fmt: skip


def launch_dot_scaled(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    K: int,
    out: torch.Tensor,
    g_a: torch.Tensor,
    g_b: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """Blackwell W4A4 launcher (see :func:`_dot_scaled_kernel`; untested on hardware)."""
    M, N = out.shape
    bm, bn, bk = 128, 128, 128
    if K % bk:
        raise ValueError(f"the dot_scaled path needs K % {bk} == 0, got K={K}")
    _dot_scaled_kernel[(cdiv(M, bm), cdiv(N, bn))](
        a,
        a_scale,
        b,
        b_scale,
        out,
        g_a,
        g_b,
        bias if bias is not None else out,
        M,
        N,
        K,
        a.stride(0),
        a.stride(1),
        a_scale.stride(0),
        a_scale.stride(1),
        b.stride(0),
        b.stride(1),
        b_scale.stride(0),
        b_scale.stride(1),
        out.stride(0),
        out.stride(1),
        GA_MODE=scale_mode(g_a),
        GB_MODE=scale_mode(g_b),
        HAS_BIAS=bias is not None,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        num_warps=8,
        num_stages=3,
    )
    return out
