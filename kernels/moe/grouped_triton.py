"""Triton grouped GEMM: ``C[rows of e] = epilogue(A[rows of e] · B[e]ᵀ)`` for every expert e in one launch.

Rows of A are sorted by expert; ``offsets[e] .. offsets[e+1]`` are expert e's rows. The M-tiles are laid out
expert after expert (each expert wastes at most one partial tile), so the grid has the static upper bound
``cdiv(T, BLOCK_M) + E`` M-tiles and a device-side table maps a tile to (expert, first row): no host sync,
and experts with zero rows own zero tiles. Unused tiles exit at once.

Operands are packed NVFP4 (uint8 codes + e4m3 block scales, unpacked and scaled exactly in registers by the
dense GEMMs' :func:`~triage.kernels.nvfp4.device.load_tile`) or dense fp16/bf16 (for example the exact ``q·s`` expansion), each independently.
``rows`` (optional, int32/int64 [R]): row r of the product reads row ``rows[r]`` of A (the MoE top-k gather),
so the routed copy of the activations is never materialized; per-row ``g_a`` is indexed the same way.
Epilogue in fp32: ``acc · 2¹⁴ per packed operand · g_a (none / scalar / per row) · g_b (per expert / per
expert row)``, one cast to C's dtype.

:func:`launch_grouped_wgrad` is the ragged-K twin for the MoE weight gradient: ``C[e] = A[:, seg e] ·
B[:, seg e]ᵀ`` with the segments along the shared (token) dim, all experts in one launch (see its kernel).
"""

from __future__ import annotations

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
from triage.kernels.nvfp4.gemm_dense import bf16_by_hand, dot_dtypes, num_sms, tma_ready, tma_supported

#: GPU tile of the grouped GEMM: the best of the H200 sweep (bench_grouped_gemm.py --sweep, 2026-11-29:
#: 128x256x64 w8 s3 at 501 / 414 TFLOP/s on gate_up / down, vs 402 / 301 for 128x128x64 w8 s4).
GROUPED_CONFIG = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3)


@fast_launch
@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    c_ptr,
    ga_ptr,
    gb_ptr,
    offs_ptr,
    tile_expert_ptr,
    tile_row0_ptr,
    rows_ptr,
    E,
    N,
    K,
    stride_am,
    stride_ak,
    stride_asm,
    stride_ask,
    stride_be,
    stride_bn,
    stride_bk,
    stride_bse,
    stride_bsn,
    stride_bsk,
    stride_cm,
    stride_cn,
    out_mult,
    A_PACKED: tl.constexpr,
    B_PACKED: tl.constexpr,
    GA_MODE: tl.constexpr,
    GB_ROW: tl.constexpr,
    GATHER: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(tile_expert_ptr + pid_m)
    if e < E:
        row0 = tl.load(tile_row0_ptr + pid_m)
        row_end = tl.load(offs_ptr + e + 1)
        offs_m = row0 + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = offs_m < row_end
        n_ok = offs_n < N
        if GATHER:
            a_rows = tl.load(rows_ptr + offs_m, mask=m_ok, other=0).to(tl.int64)
        else:
            a_rows = offs_m.to(tl.int64)
        b_e = b_ptr + e.to(tl.int64) * stride_be
        bs_e = b_scale_ptr + e.to(tl.int64) * stride_bse
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:  # no K mask: rows / columns only
                a_mask = m_ok[:, None]
                b_mask = n_ok[None, :]
            else:
                k_ok = offs_k < K
                a_mask = m_ok[:, None] & k_ok[None, :]
                b_mask = k_ok[:, None] & n_ok[None, :]
            a = load_tile(
                a_ptr,
                a_scale_ptr,
                a_rows[:, None],
                offs_k[None, :],
                a_mask,
                stride_am,
                stride_ak,
                stride_asm,
                stride_ask,
                A_PACKED,
                DOT_DTYPE,
            )
            b = load_tile(
                b_e,
                bs_e,
                offs_n[None, :],
                offs_k[:, None],
                b_mask,
                stride_bn,
                stride_bk,
                stride_bsn,
                stride_bsk,
                B_PACKED,
                DOT_DTYPE,
            )
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        _grouped_store(
            acc, c_ptr, ga_ptr, gb_ptr, a_rows, offs_m, m_ok, offs_n, n_ok, e, N, stride_cm, stride_cn, out_mult,
            GA_MODE, GB_ROW,
        )  # fmt: skip


@triton.jit
def _grouped_store(
    acc, c_ptr, ga_ptr, gb_ptr, a_rows, offs_m, m_ok, offs_n, n_ok, e, N, stride_cm, stride_cn, out_mult,
    GA_MODE: tl.constexpr, GB_ROW: tl.constexpr,
):  # fmt: skip
    """The grouped kernels' epilogue: ``C[rows] = ((acc·out_mult)·g_a)·g_b[e]`` in fp32 (``g_a`` none / one /
    per A row, read at the gathered row; ``g_b`` per expert or per expert row), one cast, stored where
    ``m_ok`` and ``n_ok``."""
    acc = acc * out_mult
    if GA_MODE == 1:
        acc = acc * tl.load(ga_ptr)
    elif GA_MODE == 2:
        acc = acc * tl.load(ga_ptr + a_rows, mask=m_ok, other=0.0)[:, None]
    if GB_ROW:
        acc = acc * tl.load(gb_ptr + e * N + offs_n, mask=n_ok, other=0.0)[None, :]
    else:
        acc = acc * tl.load(gb_ptr + e)
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@fast_launch
@triton.jit
def _grouped_tma_kernel(
    a_ptr, b_desc, c_ptr, ga_ptr, gb_ptr, offs_ptr, tile_end_ptr, tile_expert_ptr, tile_row0_ptr, rows_ptr,
    E, N, K, stride_am, stride_ak, stride_cm, stride_cn, out_mult,
    GA_MODE: tl.constexpr, GB_ROW: tl.constexpr, GATHER: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, programs,
):  # fmt: skip
    """:func:`_grouped_gemm_kernel` for dense operands, persistent, the expert weights read through TMA:
    ``programs`` programs (at most one per SM) sweep the experts' M-tiles × the N tiles, N fastest (an A
    tile's N tiles run side by side); the number of M-tiles in use is read from the device
    (``tile_end[E-1]``), so no program visits an unused one. ``b_desc``: a descriptor of B as [E·N, K] with
    blocks [BLOCK_N, BLOCK_K] (rows past expert e's N belong to expert e+1, or are TMA's zeros after the last:
    their output columns are not stored); A's rows are gathered with pointer loads. The same fp32 sums of
    the same exact products, the same epilogue."""
    n_tiles = tl.cdiv(N, BLOCK_N)
    m_tiles = tl.load(tile_end_ptr + E - 1).to(tl.int32)  # int32 tile ids: TMA coordinates are int32
    k_steps = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), m_tiles * n_tiles, programs, flatten=True):
        pid_m = tile // n_tiles
        pid_n = tile % n_tiles
        e = tl.load(tile_expert_ptr + pid_m)
        row0 = tl.load(tile_row0_ptr + pid_m)
        row_end = tl.load(offs_ptr + e + 1)
        offs_m = row0 + tl.arange(0, BLOCK_M)
        m_ok = offs_m < row_end
        if GATHER:
            a_rows = tl.load(rows_ptr + offs_m, mask=m_ok, other=0).to(tl.int64)
        else:
            a_rows = offs_m.to(tl.int64)
        b_row = e * N + pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ks in range(k_steps):
            offs_k = ks * BLOCK_K + tl.arange(0, BLOCK_K)
            if EVEN_K:
                a_mask = m_ok[:, None]
            else:
                a_mask = m_ok[:, None] & (offs_k < K)[None, :]
            a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
            a = tl.load(a_ptrs, mask=a_mask, other=0.0).to(DOT_DTYPE)
            b = b_desc.load([b_row, ks * BLOCK_K]).to(DOT_DTYPE)
            acc = tl.dot(a, b.T, acc, input_precision=INPUT_PRECISION)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        _grouped_store(
            acc, c_ptr, ga_ptr, gb_ptr, a_rows, offs_m, m_ok, offs_n, offs_n < N, e, N, stride_cm, stride_cn,
            out_mult, GA_MODE, GB_ROW,
        )  # fmt: skip


def tile_table(offsets: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per expert: the end (exclusive, cumulative) of its M-tiles and its tile count. Device ops only."""
    counts = (offsets[1:] - offsets[:-1]).long()
    tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    return tile_end, tiles


def launch_grouped_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    b: torch.Tensor,
    b_scale: torch.Tensor | None,
    K: int,
    offsets: torch.Tensor,
    out: torch.Tensor,
    g_a: torch.Tensor | None,
    g_b: torch.Tensor,
    *,
    rows: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """``out[T, N]``: A packed uint8 [T_a, K/2] (+ ``a_scale`` [T_a, K/16]) or dense [T_a, K] (any
    strides); row r of the product reads A row ``rows[r]`` (or r if ``rows`` is None, then T_a = T);
    B packed uint8 [E, N, K/2] (+ ``b_scale`` [E, N, K/16]) or dense [E, N, K] (any strides, so a
    transposed view serves dgrad); ``g_a`` None / 1 element / [T_a]; ``g_b`` [E] or [E, N] fp32.

    ``config``: the tiles (default :data:`GROUPED_CONFIG`); with ``TMA=True`` dense operands whose experts'
    weight rows form one evenly strided [E·N, K] block (:func:`~triage.kernels.nvfp4.gemm_dense.tma_ready`)
    run :func:`_grouped_tma_kernel` on sm_90+ (the same bits), others the pointer kernel."""
    T, N = out.shape
    E = offsets.numel() - 1
    a_packed, b_packed = a_scale is not None, b_scale is not None
    dot_dtype, precision = dot_dtypes(a.dtype, a_packed, b.dtype, b_packed, "grouped-GEMM")
    if config is None:
        if interpreting():
            config = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=1)
        else:
            config = dict(GROUPED_CONFIG)
    cfg = dict(config)
    num_warps, num_stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    bm = cfg["BLOCK_M"]
    # tile -> (expert, first row), built on the device
    n_tiles = cdiv(T, bm) + E
    tile_end, tiles = tile_table(offsets, bm)
    ids = torch.arange(n_tiles, device=out.device)
    tile_expert = torch.searchsorted(tile_end, ids, right=True)
    e_clamped = tile_expert.clamp(max=max(E - 1, 0))
    first_tile = tile_end[e_clamped] - tiles[e_clamped] if E else ids
    tile_row0 = (offsets[:-1].long()[e_clamped] + (ids - first_tile) * bm) if E else ids
    tile_expert = tile_expert.to(torch.int32)
    tile_row0 = tile_row0.to(torch.int64)
    dummy = out
    ga_mode = scale_mode(g_a)
    gb_row = g_b.dim() == 2
    grid = (n_tiles, cdiv(N, cfg["BLOCK_N"]))
    if T == 0 or N == 0 or E == 0:
        return out
    tma = cfg.pop("TMA", False) and not (a_packed or b_packed) and (interpreting() or tma_supported())
    # B as one [E·N, K] operand: experts' rows evenly strided (a contiguous [E, N, Kp] expansion)
    flat = tma and b.dim() == 3 and b.stride(2) == 1 and b.stride(0) == N * b.stride(1)
    b2 = b.as_strided((E * N, b.shape[2]), (b.stride(1), 1)) if flat else None
    if b2 is not None and tma_ready(b2):
        programs = min(grid[0] * grid[1], 3 if interpreting() else num_sms())  # (interpreted: several tiles each)
        desc = TensorDescriptor(b2, [E * N, K], [b2.stride(0), 1], [cfg["BLOCK_N"], cfg["BLOCK_K"]])
        _grouped_tma_kernel[(programs,)](
            a, desc, out,
            g_a if g_a is not None else dummy, g_b, offsets, tile_end, tile_expert, tile_row0,
            rows if rows is not None else tile_row0, E, N, K, a.stride(0), a.stride(1), out.stride(0),
            out.stride(1), unpack_mult(a_packed, b_packed), GA_MODE=ga_mode, GB_ROW=gb_row,
            GATHER=rows is not None, EVEN_K=K % cfg["BLOCK_K"] == 0, DOT_DTYPE=dot_dtype,
            INPUT_PRECISION=precision, BLOCK_M=bm, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
            programs=programs, num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
        return out
    _grouped_gemm_kernel[grid](
        a,
        a_scale if a_packed else dummy,
        b,
        b_scale if b_packed else dummy,
        out,
        g_a if g_a is not None else dummy,
        g_b,
        offsets,
        tile_expert,
        tile_row0,
        rows if rows is not None else tile_row0,
        E,
        N,
        K,
        *operand_strides(a, a_scale),
        *operand_strides(b, b_scale),
        out.stride(0),
        out.stride(1),
        unpack_mult(a_packed, b_packed),
        A_PACKED=a_packed,
        B_PACKED=b_packed,
        GA_MODE=ga_mode,
        GB_ROW=gb_row,
        GATHER=rows is not None,
        EVEN_K=K % cfg["BLOCK_K"] == 0,
        DOT_DTYPE=dot_dtype,
        INPUT_PRECISION=precision,
        num_warps=num_warps,
        num_stages=num_stages,
        **cfg,
    )
    return out


#: GPU tiles of the grouped wgrad (ragged K), not swept on hardware yet. Dense (expanded) operands: the
#: forward's best tile (sm_90a ptxas: 255 registers, no spills, 16-byte cp.async, wgmma). Packed operands
#: (unpacked in registers): 128x128x32 is the largest tried that does not spill (128x256x64 spills 632 B).
WGRAD_CONFIG = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
WGRAD_PACKED_CONFIG = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=8, num_stages=3)
_INTERPRETER_WGRAD_CONFIG = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=1)


@fast_launch
@triton.jit
def _grouped_wgrad_kernel(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    c_ptr,
    ga_ptr,
    gb_ptr,
    offs_ptr,
    M,
    N,
    stride_am,
    stride_ak,
    stride_asm,
    stride_ask,
    stride_bn,
    stride_bk,
    stride_bsn,
    stride_bsk,
    stride_ce,
    stride_cm,
    stride_cn,
    out_mult,
    A_PACKED: tl.constexpr,
    B_PACKED: tl.constexpr,
    GA_MODE: tl.constexpr,
    GB_MODE: tl.constexpr,
    BF16_BY_HAND: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Tile (BLOCK_M × BLOCK_N) of ``C[e] = A[:, s:t] · B[:, s:t]ᵀ``, ``s, t = offs[e], offs[e+1]``.

    Program axis 0: the output tile (GROUP_M swizzle, as the dense GEMM); axis 1: the expert. The segment
    bounds come from device memory; they are multiples of 16 (the launcher's contract), so the loop starts
    at the BLOCK_K-aligned column below ``s`` and masks columns outside ``[s, t)`` on both sides (they
    belong to the neighbouring experts). An empty segment stores exact zeros (no epilogue: 0 whatever the
    outer scales are).
    """
    pid = tl.program_id(0)
    e = tl.program_id(1)
    pid_m, pid_n = swizzled_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    rows_a = offs_m.to(tl.int64)  # row * stride can pass 2**31 at T_pad ~ 1e5 tokens
    rows_b = offs_n.to(tl.int64)
    c_e = c_ptr + e.to(tl.int64) * stride_ce
    seg_start = tl.multiple_of(tl.load(offs_ptr + e).to(tl.int32), 16)
    seg_end = tl.multiple_of(tl.load(offs_ptr + e + 1).to(tl.int32), 16)
    if seg_end > seg_start:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_first = tl.multiple_of((seg_start // BLOCK_K) * BLOCK_K, BLOCK_K)
        for k0 in range(k_first, seg_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = (offs_k >= seg_start) & (offs_k < seg_end)
            a = load_tile(
                a_ptr, a_scale_ptr, rows_a[:, None], offs_k[None, :], m_ok[:, None] & k_ok[None, :],
                stride_am, stride_ak, stride_asm, stride_ask, A_PACKED, DOT_DTYPE,
            )  # fmt: skip
            b = load_tile(
                b_ptr, b_scale_ptr, rows_b[None, :], offs_k[:, None], k_ok[:, None] & n_ok[None, :],
                stride_bn, stride_bk, stride_bsn, stride_bsk, B_PACKED, DOT_DTYPE,
            )  # fmt: skip
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        epilogue(
            acc, offs_m, offs_n, M, N, c_e, stride_cm, stride_cn, ga_ptr, gb_ptr, ga_ptr, out_mult,
            GA_MODE, GB_MODE, False, BF16_BY_HAND,
        )  # fmt: skip
    else:
        c_ptrs = c_e + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
        zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=c_ptr.dtype.element_ty)
        tl.store(c_ptrs, zero, mask=m_ok[:, None] & n_ok[None, :])


def launch_grouped_wgrad(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    b: torch.Tensor,
    b_scale: torch.Tensor | None,
    offsets: torch.Tensor,
    out: torch.Tensor,
    g_a: torch.Tensor | None,
    g_b: torch.Tensor | None,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """``out[e] = ((A[:, s:t] · B[:, s:t]ᵀ)·g_a)·g_b`` with ``s, t = offsets[e], offsets[e+1]``, one launch.

    A packed uint8 [M, L/2] (+ ``a_scale`` [M, L/16]) or dense [M, L]; B packed [N, L/2] (+ ``b_scale``) or
    dense [N, L] (any strides); ``offsets`` int [E+1] on the device: non-decreasing MULTIPLES OF 16 (the
    kernel tells the compiler so; unchecked here), ``offsets[E] ≤ L``; ``g_a`` None / 1 element / [M] and
    ``g_b`` None / 1 element / [N] fp32; ``out`` [E, M, N] (any dtype the epilogue casts to). Empty
    segments give exact zeros.
    """
    E, M, N = out.shape
    a_packed, b_packed = a_scale is not None, b_scale is not None
    dot_dtype, precision = dot_dtypes(a.dtype, a_packed, b.dtype, b_packed, "grouped-wgrad")
    if config is None:
        if interpreting():
            config = _INTERPRETER_WGRAD_CONFIG
        else:
            config = WGRAD_PACKED_CONFIG if a_packed or b_packed else WGRAD_CONFIG
    cfg = dict(config)
    num_warps, num_stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    if E == 0 or M == 0 or N == 0:
        return out
    dummy = out  # never dereferenced when the matching constexpr switch is off
    grid = (cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]), E)
    _grouped_wgrad_kernel[grid](
        a,
        a_scale if a_packed else dummy,
        b,
        b_scale if b_packed else dummy,
        out,
        g_a if g_a is not None else dummy,
        g_b if g_b is not None else dummy,
        offsets,
        M,
        N,
        *operand_strides(a, a_scale),
        *operand_strides(b, b_scale),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        unpack_mult(a_packed, b_packed),
        A_PACKED=a_packed,
        B_PACKED=b_packed,
        GA_MODE=scale_mode(g_a),
        GB_MODE=scale_mode(g_b),
        BF16_BY_HAND=bf16_by_hand(out.dtype),
        DOT_DTYPE=dot_dtype,
        INPUT_PRECISION=precision,
        num_warps=num_warps,
        num_stages=num_stages,
        **cfg,
    )
    return out
