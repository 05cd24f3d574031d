"""Triton kernels from packed NVFP4 rows back to dense values: :func:`dequantize_triton` (``q·s·g``, the twin
of ``NVFP4Tensor.dequantize``) and :func:`expand_triton` (the exact ``q·s``, outer scale not applied, that the
large-M GEMMs run on).

``[rows, blocks, 16]`` tiles: 8-byte code loads and one scale byte per block, 32-byte value stores per
block. ``q·s`` has at most 6 significant bits, so it is exact in bf16, fp16 and fp32; a bf16 output of
:func:`dequantize_triton` is rounded to nearest even by integer arithmetic (:func:`~.device.bf16_rne`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._launch import cdiv, fast_launch, next_power_of_2
from .device import (
    OUTER_ROW,
    ROUND_ID,
    bf16_rne,
    bits_view,
    check_runnable,
    e2m1_value,
    e4m3_value,
    interpreting,
)
from .tensor import NVFP4Tensor

__all__ = ["dequantize_triton", "expand_triton"]

#: dequantize kernel modes (global_scale layout), with :data:`~.device.OUTER_ROW`
OUTER_SCALAR, OUTER_EXPERT = 0, 1


@fast_launch
@triton.jit
def _dequantize_kernel(
    data_ptr, scale_ptr, gs_ptr, out_ptr, R, K, KP, rows_per_outer,
    OUTER: tl.constexpr, ROUND: tl.constexpr, BR: tl.constexpr, NB: tl.constexpr,
):  # fmt: skip
    """``out = e2m1(code) · f32(scale) · g`` over a ``[BR, NB, 16]`` tile; ``OUTER`` 0 scalar, 1 per
    group of ``rows_per_outer`` rows, 2 per row."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cb = tl.program_id(1) * NB + tl.arange(0, NB)
    rmask = rows < R
    grow = rows.to(tl.int64)
    bmask = rmask[:, None] & (cb[None, :] < KP // 16)
    j8 = tl.arange(0, 8)
    packed = tl.load(
        data_ptr + grow[:, None, None] * (KP // 2) + (cb[None, :, None] * 8 + j8[None, None, :]),
        mask=bmask[:, :, None],
        other=0,
    ).to(tl.int32)
    q = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BR, NB, 16))
    sc = tl.load(scale_ptr + grow[:, None] * (KP // 16) + cb[None, :], mask=bmask, other=0).to(tl.int32)
    y = e2m1_value(q) * e4m3_value(sc)[:, :, None]
    if OUTER == 2:
        gs = tl.load(gs_ptr + grow, mask=rmask, other=1.0)[:, None, None]
    elif OUTER == 1:
        gs = tl.load(gs_ptr + grow // rows_per_outer, mask=rmask, other=1.0)[:, None, None]
    else:
        gs = tl.load(gs_ptr)
    y = y * gs
    if ROUND == 1:  # bf16 output written as int16 bits of the nearest-even bf16
        y = (bf16_rne(y).to(tl.int32, bitcast=True) >> 16).to(tl.int16)
    else:
        y = y.to(out_ptr.dtype.element_ty)
    cols = cb[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
    tl.store(out_ptr + grow[:, None, None] * K + cols, y, mask=rmask[:, None, None] & (cols < K))


@fast_launch
@triton.jit
def _expand_kernel(
    data_ptr, scale_ptr, out_ptr, R, KP, stride_dr, stride_sr,
    OUT_BF16: tl.constexpr, BR: tl.constexpr, NB: tl.constexpr,
):  # fmt: skip
    """``out[r, k] = e2m1(code[r, k]) · f32(scale[r, k // 16])`` (exact in bf16/fp16), ``[BR, NB, 16]``
    tiles: 8-byte code loads, 32-byte value stores per block."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cb = tl.program_id(1) * NB + tl.arange(0, NB)
    grow = rows.to(tl.int64)
    bmask = (rows < R)[:, None] & (cb[None, :] < KP // 16)
    j8 = tl.arange(0, 8)
    packed = tl.load(
        data_ptr + grow[:, None, None] * stride_dr + (cb[None, :, None] * 8 + j8[None, None, :]),
        mask=bmask[:, :, None],
        other=0,
    ).to(tl.int32)
    q = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BR, NB, 16))
    sc = tl.load(scale_ptr + grow[:, None] * stride_sr + cb[None, :], mask=bmask, other=0).to(tl.int32)
    y = e2m1_value(q) * e4m3_value(sc)[:, :, None]
    if OUT_BF16:  # exact in bf16: the low 16 bits are zero
        y = (y.to(tl.int32, bitcast=True) >> 16).to(tl.int16)
    else:
        y = y.to(out_ptr.dtype.element_ty)
    cols = cb[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
    tl.store(out_ptr + grow[:, None, None] * KP + cols, y, mask=bmask[:, :, None])


def _outer_mode(gs: torch.Tensor, rows: int) -> tuple[int, int]:
    if gs.numel() == 1:
        return OUTER_SCALAR, rows
    if gs.numel() == rows:
        return OUTER_ROW, 1
    return OUTER_EXPERT, rows // gs.numel()


def dequantize_triton(
    t: NVFP4Tensor, dtype: torch.dtype | None = None, block_rows: int = 16, block_k: int = 512
) -> torch.Tensor:
    """Triton twin of ``NVFP4Tensor.dequantize`` (same values)."""
    check_runnable(t.data)
    out_dtype = t.dtype if dtype is None else dtype
    if out_dtype not in ROUND_ID:
        raise TypeError(f"dequantize: output dtype must be float32/bfloat16/float16, got {out_dtype}")
    k = t.shape[-1]
    kp = t.padded_k
    rows = t.data.numel() // (kp // 2)
    gs = t.global_scale.float().contiguous()
    mode, rpo = _outer_mode(gs, rows)
    out = torch.empty((rows, k), dtype=out_dtype, device=t.data.device)
    nb = min(block_k // 16, next_power_of_2(kp // 16))
    br = 64 if interpreting() else block_rows
    grid = (cdiv(rows, br), cdiv(kp // 16, nb))
    _dequantize_kernel[grid](
        t.data.contiguous(), t.scale.view(torch.uint8).contiguous(), gs, bits_view(out), rows, k, kp, rpo,
        OUTER=mode, ROUND=ROUND_ID[out_dtype], BR=br, NB=nb,
    )  # fmt: skip
    return out.reshape(t.shape)


def expand_triton(data: torch.Tensor, scale: torch.Tensor, kp: int, dtype: torch.dtype) -> torch.Tensor:
    """Exact ``q·s`` of packed codes ``data`` [R, Kp/2] and e4m3 scales [R, Kp/16] as a dense [R, Kp]
    tensor of ``dtype`` (bf16, fp16 or fp32). Rows may be strided; each row must be contiguous."""
    check_runnable(data)
    if data.stride(-1) != 1:
        data = data.contiguous()
    scale = scale.view(torch.uint8)
    if scale.stride(-1) != 1:
        scale = scale.contiguous()
    R = data.shape[0]
    out = torch.empty((R, kp), device=data.device, dtype=dtype)
    if R == 0:
        return out
    br, nb = (16, 16) if interpreting() else (16, 32)
    nb = min(nb, next_power_of_2(kp // 16))
    _expand_kernel[(cdiv(R, br), cdiv(kp // 16, nb))](
        data, scale, bits_view(out), R, kp, data.stride(0), scale.stride(0),
        OUT_BF16=dtype == torch.bfloat16, BR=br, NB=nb,
    )  # fmt: skip
    return out
