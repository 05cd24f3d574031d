"""The small-M (decode) NVFP4 GEMM kernel behind :func:`triage.kernels.nvfp4.gemm` and ``gemm_w4a16`` for
M ≤ ``SMALL_M`` (memory-bound), and ``gemm_w4a16`` up to ``W4A16_UNPACK_MAX_M`` rows (M in tiles):
:func:`launch_decode`.

It streams the packed weight once (0.5625 B/param) as int32 words, turns each word into eight exact
``e2m1·2⁻¹⁴`` fp16 values (on the GPU with bf16 activations ``e2m1·2⁻¹²⁶`` bf16) with a few integer ops
(:func:`_unpack_words`), multiplies them by the block's e4m3 scale (exact: ≤ 6 significant bits) and runs a
swap-AB tensor-core dot against the few activation rows, fp32 accumulation; the epilogue undoes the unpack
bias and applies the outer scales (:func:`~.device.epilogue`). Split-K with a deterministic reduction:
folded into the kernel (:func:`_splitk_last_reduces`, the default) or the dense GEMM's second kernel
(:func:`~.gemm_dense.splitk_reduce`), same bits. Tiles: :data:`DECODE_CONFIG`, :data:`DECODE_CONFIG_M16`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from triage.kernels._launch import cdiv, fast_launch, next_power_of_2
from triage.kernels.nvfp4.device import (
    UNPACK_FACTOR,
    e4m3_nan,
    epilogue,
    interpreting,
    scale_mode,
)
from triage.kernels.nvfp4.gemm_dense import bf16_by_hand, dot_dtypes, num_sms, splitk_reduce

#: Element order of one unpacked word (:func:`_unpack_words`): position p holds element ``WORD_ORDER[p]``.
#: Each adjacent pair is one 32-bit register of the bit trick, so no repacking; the activation is loaded in
#: the same order (the dot product does not care about the order of K).
WORD_ORDER = (0, 4, 2, 6, 1, 5, 3, 7)


@triton.jit
def _scale_pairs(r, s):
    """``r`` (uint32: two bf16 values) times the bf16 scale in the low half of ``s`` (uint32): one
    ``fma.rn.bf16x2`` with a -0 addend, i.e. the product itself (exact here; -0 leaves every value, ±0
    included, as it is), which ptxas emits on sm_90 as one ``HMUL2.BF16`` reading the scale's half twice
    (``.H0_H0``); ``fma.bf16x2`` needs sm_80 where ``mul.bf16x2`` needs sm_90. Triton's own bf16 multiply of
    the joined values compiles (3.6, sm_90) to a half-swap ``PRMT`` before and after every ``HMUL2``."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; .reg .b32 s2, z; mov.b32 {lo, hi}, $2; mov.b32 s2, {lo, lo}; mov.b32 z, 0x80008000; "
        "fma.rn.bf16x2 $0, $1, s2, z; }",
        "=r,r,r", [r, s], dtype=tl.uint32, is_pure=True, pack=1,
    )  # fmt: skip


@triton.jit
def _unpack_pairs(u, SH: tl.constexpr):
    """The four registers of :func:`_unpack_words` (uint32 ``u`` -> two values each: elements 0/4, 1/5, 2/6,
    3/7) by shifts and masks: ``(u & 0x80008000) | ((u & 0x70007000) >> SH)`` turns the nibbles in bits 12-15
    and 28-31 of ``u`` into two bit patterns at once (sign to bit 15, exponent/mantissa bits to 11-9 for
    ``SH`` = 3, fp16's ``e2m1·2⁻¹⁴``, or to 8-6 for ``SH`` = 6, bf16's ``e2m1·2⁻¹²⁶``); shifting the word left
    by 12, 8, 4, 0 brings nibbles 0/4, 1/5, 2/6, 3/7 there."""
    r0 = ((u << 12) & 0x80008000) | (((u << 12) & 0x70007000) >> SH)  # elements 0 (low half), 4 (high)
    r1 = ((u << 8) & 0x80008000) | (((u << 8) & 0x70007000) >> SH)  # 1, 5
    r2 = ((u << 4) & 0x80008000) | (((u << 4) & 0x70007000) >> SH)  # 2, 6
    r3 = (u & 0x80008000) | ((u & 0x70007000) >> SH)  # 3, 7
    return r0, r1, r2, r3


@triton.jit
def _unpack_pairs_mul(u):
    """:func:`_unpack_pairs` for bf16 (``SH`` = 6, the same bits) with one multiply instead of two shifts per
    register: for ``x = u & 0x000F000F`` (nibbles 0 and 4), ``x·0x1040 = (x << 12) + (x << 6)`` puts each sign
    bit at 15 / 31 and each exponent/mantissa field at 8-6 / 24-22 without carries (the two copies occupy bits
    12-15 and 6-9 of each half), and ``& 0x81C081C0`` keeps exactly those; nibbles 1/5 take ``0x104`` on bits
    4-7, and ``u >> 8`` brings nibbles 2/6, 3/7 to the places of 0/4, 1/5. (fp16's fields, 11-9, would overlap
    the copies: no such form.)"""
    v = u >> 8
    r0 = ((u & 0x000F000F) * 0x1040) & 0x81C081C0
    r1 = ((u & 0x00F000F0) * 0x104) & 0x81C081C0
    r2 = ((v & 0x000F000F) * 0x1040) & 0x81C081C0
    r3 = ((v & 0x00F000F0) * 0x104) & 0x81C081C0
    return r0, r1, r2, r3


@triton.jit
def _unpack_words(q, BF16: tl.constexpr, s=None):
    """Packed codes as int32 words [R, W] (8 nibbles each, element 8w+i in nibble i) -> ``e2m1·2⁻¹⁴`` in
    fp16 (``BF16``: ``e2m1·2⁻¹²⁶`` in bf16, code 1 the bf16 subnormal 2⁻¹²⁷) as [R, W, 2, 2, 2], read in
    :data:`WORD_ORDER` when flattened. ``BF16``: :func:`_unpack_pairs_mul`, each register then times its
    word's block scale ``s`` ([R, W] uint32, the bf16 scale in the low half: :func:`_scale_pairs`); fp16:
    :func:`_unpack_pairs`, unscaled. Per 8 codes: 13 integer ops + 4 ``HMUL2`` (bf16), 15 (fp16)."""
    u = q.to(tl.uint32, bitcast=True)
    if BF16:
        r0, r1, r2, r3 = _unpack_pairs_mul(u)
        r0, r1, r2, r3 = _scale_pairs(r0, s), _scale_pairs(r1, s), _scale_pairs(r2, s), _scale_pairs(r3, s)
    else:
        r0, r1, r2, r3 = _unpack_pairs(u, 3)
    DT: tl.constexpr = tl.bfloat16 if BF16 else tl.float16
    lo = tl.join(
        tl.join(
            (r0 & 0xFFFF).to(tl.uint16).to(DT, bitcast=True), (r1 & 0xFFFF).to(tl.uint16).to(DT, bitcast=True)
        ),
        tl.join(
            (r2 & 0xFFFF).to(tl.uint16).to(DT, bitcast=True), (r3 & 0xFFFF).to(tl.uint16).to(DT, bitcast=True)
        ),
    )
    hi = tl.join(
        tl.join((r0 >> 16).to(tl.uint16).to(DT, bitcast=True), (r1 >> 16).to(tl.uint16).to(DT, bitcast=True)),
        tl.join((r2 >> 16).to(tl.uint16).to(DT, bitcast=True), (r3 >> 16).to(tl.uint16).to(DT, bitcast=True)),
    )
    # join(lo, hi)[j, t, u] = (lo, hi)[u][j, t] = half u of r[2t + j]: flat 4j + 2t + u -> WORD_ORDER
    return tl.join(lo, hi)


@triton.jit
def _decode_loads(
    w_rows, s_rows, x_ptr, kb, kb_end, jw, jb, j, j_perm, offs_m, m_ok, n_ok, stride_xm, K, KB,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, BM: tl.constexpr, BW: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """One K step of :func:`_decode_kernel` from 16-block ``kb``: code words [BN, BW], e4m3 scales [BN, NB]
    and the activation tile xᵀ [BK, BM] in :data:`WORD_ORDER`; blocks at or past ``kb_end`` (≤ KB) read 0."""
    cw = kb * 2 + jw
    cb = kb + jb
    if EVEN_N:
        q = tl.load(w_rows + cw[None, :], mask=cw[None, :] < 2 * kb_end, other=0)
        s = tl.load(s_rows + cb[None, :], mask=cb[None, :] < kb_end, other=0.0)
    else:
        q = tl.load(w_rows + cw[None, :], mask=n_ok[:, None] & (cw[None, :] < 2 * kb_end), other=0)
        s = tl.load(s_rows + cb[None, :], mask=n_ok[:, None] & (cb[None, :] < kb_end), other=0.0)
    kk = kb * 16 + j_perm
    k_end = kb_end * 16
    if EVEN_K:  # natural [BM, BK] load (16-byte vectors), WORD_ORDER applied in registers
        kn = kb * 16 + j
        xn = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + kn[None, :],
            mask=m_ok[:, None] & (kn[None, :] < k_end),
            other=0.0,
        )
        xt = tl.trans(tl.reshape(tl.permute(tl.reshape(xn, (BM, BW, 2, 2, 2)), (0, 1, 4, 3, 2)), (BM, BK)))
    else:  # not EVEN_K: xᵀ [BK, BM] loaded in WORD_ORDER, masked at K
        k_end = min(k_end, K)
        xt = tl.load(
            x_ptr + offs_m[None, :] * stride_xm + kk[:, None],
            mask=m_ok[None, :] & (kk[:, None] < k_end),
            other=0.0,
        )
    return q, s, xt


@triton.jit
def _splitk_last_reduces(
    part_ptr, cnt_ptr, tile, part_stride, mask, offs_m, offs_n, M, N, c_ptr, stride_cm, stride_cn, ga_ptr, gb_ptr,
    bias_ptr, out_mult, GA_MODE: tl.constexpr, GB_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, BF16_BY_HAND: tl.constexpr,
    SPLIT_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """Split-K reduction folded into the kernel ("last program reduces"), called right after this program
    stored its partial ``part[pid_k]`` of the tile (``part_stride`` elements per slice): take a ticket from the
    tile's counter ``cnt_ptr``; the program that draws ticket SPLIT_K - 1 (every other partial of the tile is stored by then) sums
    ``part[0..SPLIT_K-1]`` in slice order (the same fp32 additions as ``gemm_dense._splitk_reduce_kernel``, so the
    same bits), runs the epilogue and puts the counter back to 0 for the next launch (CUDA-graph replays
    included: no host-side zeroing).

    Memory ordering: (1) ``debug_barrier`` (bar.sync) orders every thread's partial stores before the
    ticket, which one thread takes with an acq_rel gpu-scope atomic (release is cumulative: it publishes
    what the barrier made it observe); (2) the counter's RMWs form one release sequence, so the last ticket's
    acquire sees every partial; Triton broadcasts the ticket through shared memory behind a barrier, which
    orders that acquire before the other threads' loads; (3) the loads are ``.cg`` (L2, never a stale L1).
    """
    tl.debug_barrier()
    ticket = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    if ticket == SPLIT_K - 1:
        total = tl.zeros((BM, BN), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):  # unrolled: the SPLIT_K independent loads issue together
            total += tl.load(part_ptr + s * part_stride + tile, mask=mask, other=0.0, cache_modifier=".cg")
        epilogue(
            total, offs_m, offs_n, M, N, c_ptr, stride_cm, stride_cn, ga_ptr, gb_ptr, bias_ptr, out_mult,
            GA_MODE, GB_MODE, HAS_BIAS, BF16_BY_HAND,
        )  # fmt: skip
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")  # every ticket of this launch is drawn


@fast_launch
@triton.jit
def _decode_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    c_ptr,
    part_ptr,
    cnt_ptr,
    ga_ptr,
    gb_ptr,
    bias_ptr,
    M,
    N,
    K,
    KB,
    stride_xm,
    stride_wn,
    stride_wsn,
    stride_cm,
    stride_cn,
    out_mult,
    GA_MODE: tl.constexpr,
    GB_MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BF16_BY_HAND: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    BF16: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    NB: tl.constexpr,
    PREFETCH: tl.constexpr = True,
    FUSED_REDUCE: tl.constexpr = False,
    NPART=0,
    MEMBERS: tl.constexpr = 1,
    w1_ptr=None, ws1_ptr=None, c1_ptr=None, gb1_ptr=None, bias1_ptr=None, N1=0, T1=0,
    w2_ptr=None, ws2_ptr=None, c2_ptr=None, gb2_ptr=None, bias2_ptr=None, N2=0, T2=0,
):  # fmt: skip
    """Small-M (decode) ``C[M, N] = x[M, K]·Wᵀ`` streaming the packed weight once.

    Swap-AB: the program computes ``Cᵀ`` tile ``[BN, BM] = W_tile[BN, BK] · xᵀ[BK, BM]``, so the unpacked
    weight (the big operand, ``BN`` ≥ 64 rows) is the MMA's M side and the few activation rows (``BM``: M
    padded to 16/32/64, or a tile of :data:`DECODE_CONFIG_MID`'s rows when M > 64: program axis 2) its N
    side. The weight streams as int32 words (``w_ptr`` is the uint8 codes viewed
    as int32, ``stride_wn`` in words): :func:`_unpack_words` turns each word into eight exact fp16
    ``e2m1·2⁻¹⁴`` (bf16 ``e2m1·2⁻¹²⁶`` for bf16 activations) with ~2 integer ops per element, each times the
    block's e4m3 scale (exact, module docstring); the epilogue multiplies by 2¹⁴ (2⁷). ``x`` is dense (bf16/fp16 activations, or the exact
    fp16 expansion of an NVFP4 activation). Program axis 1 splits K (in whole 16-blocks); with
    ``SPLIT_K > 1`` the fp32 partials go to ``part[pid_k, M, N]`` and are summed in slice order 0..SPLIT_K-1
    (deterministic): by :func:`~.gemm_dense.splitk_reduce` (a second launch), or with ``FUSED_REDUCE`` here, by
    the program of the tile that draws the last ticket of ``cnt[pid_m·(N tiles) + pid_n]`` (:func:`_splitk_last_reduces`).
    ``EVEN_N`` / ``EVEN_K``: no row / K-tail masks in the loop (N % BN == 0, KB % NB == 0).

    ``MEMBERS`` = 2 or 3: one launch for sibling weights that read the same x (q/k/v, gate/up): member 0 is
    ``w_ptr``/``ws_ptr``/``c_ptr``/``gb_ptr``/``bias_ptr`` with ``N`` rows, member j its ``*j_ptr`` with ``Nj``
    rows; the N tiles ``[Tj, Tj+1)`` are member j's (``T1``, ``T2``: the first tile of members 1 and 2), each
    member's outputs contiguous ``[M, Nj]``, all with the same K, strides, scale modes and tiles. Split-K
    partials live at the tile's place in ``part[pid_k, M, NPART]`` (``NPART``: N for one member, all members'
    tiles × BN for a group); a group needs ``FUSED_REDUCE``. Every output element is computed as a one-member
    launch with the same tiles and split computes it: the same bits.
    """
    BK: tl.constexpr = 16 * NB
    BW: tl.constexpr = 2 * NB
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)  # the activation rows' tile (one unless M > BM)
    offs_g = pid_n * BN + tl.arange(0, BN)  # the tile's columns in the split-K partials
    if MEMBERS > 1:  # the member whose tiles hold pid_n: its pointers, rows and first tile
        zero = pid_n * 0  # int32 scalars in both branches (an int argument equal to 1 is a constexpr)
        N = zero + N
        t0 = zero
        if pid_n >= T1:
            w_ptr, ws_ptr, c_ptr, gb_ptr, N, t0 = w1_ptr, ws1_ptr, c1_ptr, gb1_ptr, zero + N1, zero + T1
            if HAS_BIAS:
                bias_ptr = bias1_ptr
        if MEMBERS > 2:
            if pid_n >= T2:
                w_ptr, ws_ptr, c_ptr, gb_ptr, N, t0 = w2_ptr, ws2_ptr, c2_ptr, gb2_ptr, zero + N2, zero + T2
                if HAS_BIAS:
                    bias_ptr = bias2_ptr
        stride_cm = N  # each member's output is a contiguous [M, Nj]
        offs_n = offs_g - t0 * BN
    else:
        offs_n = offs_g
    offs_m = pid_m * BM + tl.arange(0, BM)
    n_ok = offs_n < N
    m_ok = offs_m < M
    span = tl.cdiv(tl.cdiv(KB, SPLIT_K), NB) * NB  # 16-blocks per split, a multiple of NB
    kb0 = pid_k * span
    kb1 = min(KB, kb0 + span)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    s_rows = ws_ptr + offs_n[:, None].to(tl.int64) * stride_wsn
    j = tl.arange(0, BK)
    j_perm = (j // 8) * 8 + ((j % 2) * 4 + ((j // 4) % 2) + ((j // 2) % 2) * 2)  # WORD_ORDER within words
    jw = tl.arange(0, BW)
    jb = tl.arange(0, NB)
    # PREFETCH: the next K step's codes, scales and activations are loaded before this step's unpack and MMA
    # (register double buffering: twice the bytes in flight per program, which a memory-bound kernel needs)
    q, s, xt = _decode_loads(
        w_rows, s_rows, x_ptr, kb0, kb1, jw, jb, j, j_perm, offs_m, m_ok, n_ok, stride_xm, K, KB,
        EVEN_N, EVEN_K, BM, BW, BK,
    )  # fmt: skip
    for kb in range(kb0, kb1, NB):
        if PREFETCH:
            q_c, s_c, x_c = q, s, xt
            q, s, xt = _decode_loads(
                w_rows, s_rows, x_ptr, kb + NB, kb1, jw, jb, j, j_perm, offs_m, m_ok, n_ok, stride_xm,
                K, KB, EVEN_N, EVEN_K, BM, BW, BK,
            )  # fmt: skip
        else:
            q_c, s_c, x_c = _decode_loads(
                w_rows, s_rows, x_ptr, kb, kb1, jw, jb, j, j_perm, offs_m, m_ok, n_ok, stride_xm, K, KB,
                EVEN_N, EVEN_K, BM, BW, BK,
            )  # fmt: skip
        if BF16:  # e2m1·2⁻¹²⁶ · (s·2¹¹⁹) = e2m1·s·2⁻⁷: exact, normal bf16; one HMUL2 per register. (Never
            # interpreted, so no e4m3_nan: the GPU's cvt turns a NaN scale into NaN, and NaN times a code is NaN.)
            sd = (s_c.to(tl.float32) * 6.646139978924579e35).to(tl.bfloat16).to(tl.uint16, bitcast=True)
            sw = tl.reshape(tl.broadcast_to(sd.to(tl.uint32)[:, :, None], (BN, NB, 2)), (BN, BW))  # per word
            v = _unpack_words(q_c, BF16, sw)  # [BN, BW, 2, 2, 2], scaled
        else:  # e2m1·2⁻¹⁴ · s: exact in fp16
            sd = e4m3_nan(s_c, s_c.to(tl.float16))
            v = tl.reshape(_unpack_words(q_c, BF16), (BN, NB, 16)) * sd[:, :, None]
        w = tl.reshape(v, (BN, BK)).to(DOT_DTYPE)
        acc = tl.dot(w, x_c.to(DOT_DTYPE), acc, input_precision=INPUT_PRECISION)
    acc = tl.trans(acc)  # [BM, BN]
    if SPLIT_K == 1:
        epilogue(
            acc, offs_m, offs_n, M, N, c_ptr, stride_cm, stride_cn, ga_ptr, gb_ptr, bias_ptr, out_mult,
            GA_MODE, GB_MODE, HAS_BIAS, BF16_BY_HAND,
        )  # fmt: skip
    else:
        mask = m_ok[:, None] & n_ok[None, :]
        tile = offs_m[:, None] * NPART + offs_g[None, :]
        tl.store(part_ptr + pid_k * M * NPART + tile, acc, mask=mask)
        if FUSED_REDUCE:
            _splitk_last_reduces(
                part_ptr, cnt_ptr + pid_m * tl.num_programs(0) + pid_n, tile, M * NPART, mask, offs_m, offs_n, M,
                N, c_ptr, stride_cm, stride_cn, ga_ptr, gb_ptr, bias_ptr, out_mult, GA_MODE, GB_MODE, HAS_BIAS,
                BF16_BY_HAND, SPLIT_K, BM, BN,
            )  # fmt: skip


#: Decode tiling (rows of W per program, 16-blocks per K step, warps, stages): the best of the H200 sweep
#: (bench_gemm.py --sweep, 2026-11-29; 128 registers, no spills; pipelining (stages > 1) stages the codes
#: through shared memory byte by byte and was slower).
DECODE_CONFIG = dict(BN=64, NB=8, num_warps=4, num_stages=1, PREFETCH=True)


#: M <= 16: two warps (mma.sync on register operands), 256-wide K steps, a 3-stage cp.async pipeline, split-K
#: by :func:`decode_config`'s rule: the best of the H200 sweep (bench_gemm.py --sweep, 2026-11-29: 18.8 / 20.0 µs at M = 1 / 16,
#: N×K = 4096×12288, against 23.6 / 25.7 with DECODE_CONFIG; bf16 torch.mm 30 µs).
DECODE_CONFIG_M16 = dict(BN=64, NB=16, num_warps=2, num_stages=3, PREFETCH=False)


#: M > 64 (W4A16 at prefill rows, up to :data:`~.matmul.W4A16_UNPACK_MAX_M`): :data:`DECODE_CONFIG`'s tiles
#: with 64 activation rows per program (program axis 2 tiles M), split-K by :func:`decode_config`'s rule over
#: the N × M tiles. The fastest in sum over Qwen3-4B's shapes at 128 and 256 rows of the H100 sweep
#: (bench_gemm.py --sections decode-mid, 2026-12-07: against 128 × 128 w8, 128 × 64 w4 and 64 × 128 w8 tiles).
DECODE_CONFIG_MID = dict(DECODE_CONFIG, BM=64)


#: M <= 16 with K <= NARROW_K (four 256-wide K steps or fewer): NARROW_BN weight rows per program, split 1 (H100
#: sweep, bench_gemm.py --sections decode-shapes --sweep: 4.5–4.7 µs at N×K = 1024–3072×1024, M = 1 and 16,
#: against 5.3–6.4 µs with 64 rows and the split rule).
NARROW_K = 1024
NARROW_BN = 32


#: Default split-K (:func:`decode_config`): K is split (doubling) while the programs fill fewer than
#: ``WAVES`` waves of the GPU's SMs and every split keeps at least ``MIN_SPLIT_STEPS`` K steps.
WAVES = 3
MIN_SPLIT_STEPS = 1


def decode_config(M: int, N: int, K: int, split_k: int | None = None) -> dict:
    """Tiles of :func:`_decode_kernel`: BM = M padded to 16/32/64 (above 64 rows :data:`DECODE_CONFIG_MID`,
    M in tiles of its BM); at M ≤ 16 and K ≤ :data:`NARROW_K`,
    :data:`NARROW_BN` weight rows per program and no split; otherwise K split (doubling) while the programs
    fill fewer than :data:`WAVES` waves and each split keeps :data:`MIN_SPLIT_STEPS` K steps: of the rules of
    this form, the one fastest in total over the 17 Qwen3 0.6B–8B Linear shapes at M = 1 and 16 of an H100
    split sweep, and again on a second sweep (docs/benchmarks.md, "Decode GEMV")."""
    bm = 16 if M <= 16 else (32 if M <= 32 else 64)
    if interpreting():
        return dict(BM=bm, BN=16, NB=2, SPLIT_K=split_k or 1, num_warps=4, num_stages=1)
    if M > 64:
        cfg = dict(DECODE_CONFIG_MID)
    else:
        cfg = dict(DECODE_CONFIG_M16 if bm == 16 else DECODE_CONFIG, BM=bm)
    if bm == 16 and K <= NARROW_K:  # a few K steps per row: narrower tiles, more programs, no split
        cfg["BN"] = NARROW_BN
        split_k = split_k or 1
    cfg["SPLIT_K"] = split_k or decode_split(M, N, K, cfg)
    return cfg


def decode_split(M: int, N: int, K: int, cfg: dict) -> int:
    """:func:`decode_config`'s split-K for tiles ``cfg``: doubled while the programs (N × M tiles × splits)
    fill fewer than :data:`WAVES` waves and each split keeps :data:`MIN_SPLIT_STEPS` K steps."""
    tiles, kb = cdiv(N, cfg["BN"]) * cdiv(M, cfg["BM"]), -(-K // 16)
    split = 1
    while tiles * split < WAVES * num_sms() and kb // (split * 2) >= MIN_SPLIT_STEPS * cfg["NB"]:
        split *= 2
    return split


#: Ticket counters (int32, one per output tile: N tiles × M tiles) of the fused split-K reduction. Eager launches: one zeroed buffer
#: per (device, stream), allocated on first use on that stream (so its zero-fill is ordered before its first
#: use) and never freed; every launch leaves it at zero. Grown (a new buffer, the old one kept alive) when a
#: launch needs more tiles. While a CUDA graph is being captured each launch gets its own zeroed buffer
#: instead: the zero-fill is captured with it and re-runs on every replay, so graphs never share tickets
#: with each other or with eager work; inside :func:`graph_counters` the launches captured on the stream that
#: opened it share one buffer of that graph instead, zeroed once per replay. Launches on one stream are
#: ordered, so they can share; launches that run concurrently on one stream's buffer cannot happen. Pass
#: ``counters=`` to :func:`launch_decode` only for a buffer the caller keeps zeroed and unshared.
_SPLITK_COUNTERS: dict[tuple, list[torch.Tensor]] = {}
_SPLITK_COUNTERS_MIN = 4096
#: The capture :func:`graph_counters` is open for: ``[device, stream, thread, buffer or None]``, or None.
_GRAPH_COUNTERS: list | None = None


@contextlib.contextmanager
def graph_counters(device: torch.device | None = None):
    """Open inside ``torch.cuda.graph(...)`` (a capture on ONE stream: its launches run one after another):
    the decode launches it captures on ``device`` (default: the current one), on the stream and thread that
    opened it, draw their split-K ticket counters from one zeroed buffer of :data:`_SPLITK_COUNTERS_MIN`
    counters, allocated (and zeroed, in the capture) by the first such launch, instead of one zeroed buffer
    each. Every launch leaves its counters at zero, so one zero-fill per replay serves them all: one memset
    node per graph instead of one per captured decode GEMM. A launch that needs more tiles, or runs on
    another stream (a side stream the capture forked onto) or thread, gets its own buffer as before."""
    global _GRAPH_COUNTERS
    device = torch.device("cuda") if device is None else torch.device(device)
    if not (device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        raise RuntimeError("graph_counters: open it inside a CUDA-graph capture (torch.cuda.graph(...))")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if _GRAPH_COUNTERS is not None:
        raise RuntimeError("graph_counters: already open for another capture")
    stream = torch.cuda.current_stream(device).cuda_stream
    _GRAPH_COUNTERS = [device, stream, threading.get_ident(), None]
    try:
        yield
    finally:
        _GRAPH_COUNTERS = None


def splitk_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed ticket counters (≥ ``tiles``) for a launch on the current stream of ``device`` (see above)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        shared = _GRAPH_COUNTERS
        if (
            shared is not None
            and shared[0] == device
            and tiles <= _SPLITK_COUNTERS_MIN
            and shared[1] == torch.cuda.current_stream(device).cuda_stream
            and shared[2] == threading.get_ident()
        ):
            if shared[3] is None:  # the graph's one buffer, zeroed on every replay
                shared[3] = torch.zeros(_SPLITK_COUNTERS_MIN, dtype=torch.int32, device=device)
            return shared[3]
        return torch.zeros(tiles, dtype=torch.int32, device=device)  # captured: re-zeroed on every replay
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    bufs = _SPLITK_COUNTERS.setdefault((device.type, device.index, stream), [])
    if bufs and bufs[-1].numel() >= tiles:
        return bufs[-1]
    size = max(_SPLITK_COUNTERS_MIN, next_power_of_2(tiles))
    bufs.append(torch.zeros(size, dtype=torch.int32, device=device))
    return bufs[-1]


def launch_decode(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    K: int,
    out: torch.Tensor,
    g_a: torch.Tensor | None,
    g_b: torch.Tensor | None,
    bias: torch.Tensor | None,
    *,
    split_k: int | None = None,
    config: dict | None = None,
    fused_reduce: bool | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[M,N] = ((x·Wᵀ)·g_a)·g_b + bias``, sized for small M (any M runs: above 64 rows in tiles of
    :data:`DECODE_CONFIG_MID`'s): x dense bf16/fp16 [M, K] (row stride any, unit
    column stride), W packed uint8 [N, Kp/2] + e4m3 scales [N, Kp/16] (row-major rows).

    Split-K (``SPLIT_K > 1``): ``fused_reduce`` (default ``config["FUSED_REDUCE"]``, else True) sums the
    partials inside the kernel (one launch) instead of a second kernel; both give the same bits. ``counters``: zeroed int32 [≥ N tiles × M tiles] ticket counters for the fused
    path (left zeroed after every launch); default the device's cached buffer (:func:`splitk_counters`).
    """
    M, N = out.shape
    kb = w_scale.shape[-1]
    if split_k is None and config is None and fused_reduce is None:
        launch = default_launch(M, N, K, kb, x.dtype, out.dtype, x.device)
    else:
        launch = decode_launch(
            M, N, K, kb, x.dtype, out.dtype, split_k=split_k, config=config, fused_reduce=fused_reduce
        )
    return launch.run(x, w, w_scale, out, g_a, g_b, bias, counters)


def launch_decode_group(
    x: torch.Tensor,
    members: Sequence[tuple],
    K: int,
    g_a: torch.Tensor | None,
    *,
    split_k: int | None = None,
    config: dict | None = None,
    counters: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """:func:`launch_decode` for 2 or 3 weights that read the same ``x`` (sibling layers: q/k/v, gate/up), in
    ONE launch: ``members`` = ``(w, w_scale, out, g_b, bias)`` per weight, as :func:`launch_decode` takes them
    (every ``out`` a contiguous ``[M, Nj]`` of one dtype; the weights of one K, row strides and scale kinds:
    ``g_b`` all None, all one element or all per row; ``bias`` all None or all of one dtype). The tiles and the split
    are :func:`decode_config`'s for the members' total rows; the split-K partials are summed in the kernel.
    Each member's output has the bits a :func:`launch_decode` of that member with the same ``config``
    (tiles and split) gives. Returns the outputs."""
    outs = [m[2] for m in members]
    M = outs[0].shape[0]
    if M > 64:
        raise ValueError(f"launch_decode_group handles M <= 64, got M={M}")
    widths, kb = tuple(o.shape[1] for o in outs), members[0][1].shape[-1]
    if split_k is None and config is None:
        launch = default_launch(M, widths, K, kb, x.dtype, outs[0].dtype, x.device)
    else:
        launch = decode_launch(
            M, widths, K, kb, x.dtype, outs[0].dtype, split_k=split_k, config=config, fused_reduce=True
        )
    launch.run_group(x, members, g_a, counters)
    return outs


def default_launch(
    M: int, N: int | tuple[int, ...], K: int, kb: int, x_dtype: torch.dtype, out_dtype: torch.dtype, device
) -> DecodeLaunch:
    """The :class:`DecodeLaunch` of :func:`launch_decode` (``N`` rows) or :func:`launch_decode_group` (``N``
    the members' rows) with the default tiles: one per signature (and device: its SM count sets the split),
    the last :data:`LAUNCHES_KEPT` kept."""
    key = (M, N, K, kb, x_dtype, out_dtype, device)
    launch = _LAUNCHES.get(key)
    if launch is None:
        if len(_LAUNCHES) >= LAUNCHES_KEPT:
            _LAUNCHES.pop(next(iter(_LAUNCHES), None), None)
        launch = _LAUNCHES[key] = decode_launch(M, N, K, kb, x_dtype, out_dtype)
    return launch


#: The kernel's argument names of group members 1 and 2 (:meth:`DecodeLaunch.launch_group`).
_MEMBER_ARGS = {j: (f"w{j}_ptr", f"ws{j}_ptr", f"c{j}_ptr", f"gb{j}_ptr", f"bias{j}_ptr", f"N{j}", f"T{j}")
                for j in (1, 2)}  # fmt: skip

#: :func:`default_launch`'s launches, by signature (a few per model: one per layer or group shape and row
#: count); the last :data:`LAUNCHES_KEPT` are kept.
_LAUNCHES: dict[tuple, DecodeLaunch] = {}
LAUNCHES_KEPT = 256


def _words(w: torch.Tensor, w_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed codes as int32 words and the block scales as e4m3, both with unit column stride."""
    if w.stride(-1) != 1 or w_scale.stride(-1) != 1:
        w, w_scale = w.contiguous(), w_scale.contiguous()
    try:  # the codes stream as int32 words (rows are 8-byte multiples: K % 16 == 0)
        w32 = w.view(torch.int32)
    except RuntimeError:  # storage offset or row stride not 4-byte aligned
        w32 = w.contiguous().view(torch.int32)
    if w_scale.dtype != torch.float8_e4m3fn:
        w_scale = w_scale.view(torch.float8_e4m3fn)
    return w32, w_scale


@dataclasses.dataclass(frozen=True)
class DecodeLaunch:
    """What :func:`launch_decode` derives from M, N, K, the scale blocks, x's and the output's dtypes and the
    tiles alone (grid, split-K, the reduction, the unpack trick, constexprs): built by :func:`decode_launch`,
    kept by a caller's plan (``matmul.GemmPlan``); :meth:`run` views the weight as int32 words, takes the
    ticket counters and launches. A sibling group's launch (``members``: each member's rows) runs with
    :meth:`run_group`, or with :meth:`launch_group` on weight operands :meth:`group_weights` checked once."""

    M: int
    N: int
    K: int
    kb: int
    grid: tuple[int, int, int]  # N tiles, K splits, M tiles
    split: int
    tiles: int  # N tiles (times the M tiles: the counters a fused split-K reduction needs)
    fused: bool
    out_mult: float
    kwargs: dict  # constexprs, num_warps, num_stages
    members: tuple[int, ...] = ()  # a group's rows per member (their sum is N); () for one weight
    starts: tuple[int, ...] = ()  # the first N tile of each member after the first

    def run(self, x, w, w_scale, out, g_a, g_b, bias, counters=None) -> torch.Tensor:
        """:func:`launch_decode` for operands of the planned shapes and dtypes."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        w32, w_scale = _words(w, w_scale)
        split, dummy = self.split, out
        part = torch.empty((split, self.M, self.N), device=out.device, dtype=torch.float32) if split > 1 else dummy
        cnt = self._counters(out.device, counters) if split > 1 and self.fused else None
        _decode_kernel[self.grid](
            x, w32, w_scale, out, part, cnt if cnt is not None else dummy,
            g_a if g_a is not None else dummy, g_b if g_b is not None else dummy, bias if bias is not None else dummy,
            self.M, self.N, self.K, self.kb, x.stride(0), w32.stride(0), w_scale.stride(0), out.stride(0),
            out.stride(1), self.out_mult, GA_MODE=scale_mode(g_a), GB_MODE=scale_mode(g_b), HAS_BIAS=bias is not None,
            FUSED_REDUCE=cnt is not None, NPART=self.N, **self.kwargs,
        )  # fmt: skip
        if split > 1 and cnt is None:
            splitk_reduce(part, out, g_a, g_b, bias, self.out_mult, split)
        return out

    def run_group(self, x, members, g_a, counters=None) -> None:
        """:func:`launch_decode_group` for operands of the planned shapes and dtypes (``members``: its
        ``(w, w_scale, out, g_b, bias)`` tuples, as many as :attr:`members`)."""
        if len(members) != len(self.members):
            raise ValueError(f"run_group: planned for {len(self.members)} members, got {len(members)}")
        outs = [m[2] for m in members]
        for j, out in enumerate(outs):
            if tuple(out.shape) != (self.M, self.members[j]) or not out.is_contiguous() or out.dtype != outs[0].dtype:
                raise ValueError(
                    f"run_group: member {j}'s output must be a contiguous {outs[0].dtype} "
                    f"[{self.M}, {self.members[j]}], got {out.dtype} {tuple(out.shape)}"
                )
        self.launch_group(x, self.group_weights([(m[0], m[1], m[3], m[4]) for m in members]), outs, g_a, counters)

    def group_weights(self, weights) -> tuple:
        """The members' weight operands as :meth:`launch_group` reads them, checked once: ``weights`` =
        ``(w, w_scale, g_b, bias)`` per member → ``(words, scales, g_bs, biases, GB_MODE)`` (codes as int32
        words, e4m3 scales, each member's rows strided like member 0's, the outer scales of one kind, the
        biases of one dtype or all None). A caller that keeps it (:class:`~triage.kernels.siblings.SiblingGroup`)
        must drop it when a member's tensors change."""
        if len(weights) != len(self.members):
            raise ValueError(f"group_weights: planned for {len(self.members)} members, got {len(weights)}")
        words = [_words(w, ws) for w, ws, _, _ in weights]
        w32, ws = words[0]
        for j, (wj, sj) in enumerate(words):
            if wj.stride(0) != w32.stride(0) or sj.stride(0) != ws.stride(0):
                raise ValueError(f"group_weights: member {j}'s weight rows are strided unlike member 0's")
        g_bs, biases = tuple(m[2] for m in weights), tuple(m[3] for m in weights)
        modes = {scale_mode(g) for g in g_bs}
        if len(modes) != 1 or len({None if b is None else b.dtype for b in biases}) != 1:
            raise ValueError("group_weights: the members' outer scales (g_b) and biases must be of one kind")
        return tuple(w for w, _ in words), tuple(s for _, s in words), g_bs, biases, modes.pop()

    def launch_group(self, x, weights: tuple, outs, g_a, counters=None) -> None:
        """Launch the group on ``x`` with ``weights`` from :meth:`group_weights` into ``outs`` (contiguous
        ``[M, Nj]`` of one dtype, one per member: the caller's to get right)."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        codes, scales, g_bs, biases, gb_mode = weights
        npart = self.tiles * self.kwargs["BN"]
        part = torch.empty((self.split, self.M, npart), device=x.device, dtype=torch.float32) if self.split > 1 else outs[0]
        cnt = self._counters(x.device, counters) if self.split > 1 else outs[0]
        extra = {}
        for j in range(1, len(outs)):
            out, g, b = outs[j], g_bs[j], biases[j]
            values = (codes[j], scales[j], out, out if g is None else g, out if b is None else b, self.members[j],
                      self.starts[j - 1])  # fmt: skip
            extra.update(zip(_MEMBER_ARGS[j], values))
        dummy = outs[0]
        w32, ws = codes[0], scales[0]
        _decode_kernel[self.grid](
            x, w32, ws, outs[0], part, cnt, g_a if g_a is not None else dummy,
            g_bs[0] if g_bs[0] is not None else dummy, biases[0] if biases[0] is not None else dummy,
            self.M, self.members[0], self.K, self.kb, x.stride(0), w32.stride(0), ws.stride(0), outs[0].stride(0), 1,
            self.out_mult, GA_MODE=scale_mode(g_a), GB_MODE=gb_mode, HAS_BIAS=biases[0] is not None,
            FUSED_REDUCE=self.split > 1, NPART=npart, MEMBERS=len(outs), **extra, **self.kwargs,
        )  # fmt: skip

    def _counters(self, device: torch.device, counters: torch.Tensor | None) -> torch.Tensor:
        needed = self.tiles * self.grid[2]
        if counters is None:
            return splitk_counters(device, needed)
        if (
            counters.dtype != torch.int32
            or counters.numel() < needed
            or counters.device != device
            or not counters.is_contiguous()
        ):
            raise ValueError(
                f"counters must be a contiguous, zeroed int32 tensor with >= {needed} elements on {device}"
            )
        return counters


def decode_launch(
    M: int,
    N: int | tuple[int, ...],
    K: int,
    kb: int,
    x_dtype: torch.dtype,
    out_dtype: torch.dtype,
    *,
    split_k: int | None = None,
    config: dict | None = None,
    fused_reduce: bool | None = None,
) -> DecodeLaunch:
    """The :class:`DecodeLaunch` of :func:`launch_decode` (``kb``: the weight's scale blocks per row;
    ``config``: tiles, default :func:`decode_config` of the total rows). ``N`` a tuple of 2 or 3 row counts:
    a sibling group's launch (:func:`launch_decode_group`; its split-K reduction is always fused)."""
    members = tuple(N) if isinstance(N, tuple) else ()
    if members and not 2 <= len(members) <= 3:
        raise ValueError(f"a decode group has 2 or 3 members, got {len(members)}")
    if members and M > 64:
        raise ValueError(f"a decode group handles M <= 64, got M={M}")
    total = sum(members) if members else N
    dot_dtype, precision = dot_dtypes(x_dtype, False, torch.uint8, True, "decode")
    cfg = dict(config) if config else decode_config(M, total, K, split_k)
    if M * max(total * cfg["SPLIT_K"], K) >= 2**31:  # the kernel's offsets into x, out, the partials: int32
        raise ValueError(
            f"the decode kernel takes M·max(N·split, K) < 2**31, got M={M}, N={total}, K={K}, split {cfg['SPLIT_K']}"
        )
    fused = cfg.pop("FUSED_REDUCE", True)
    fused = fused if fused_reduce is None else fused_reduce
    if members and not fused:
        raise ValueError("a decode group sums its split-K partials in the kernel (fused_reduce=True)")
    # bf16 bit trick on the GPU (its code-1 value is a bf16 subnormal, which the interpreter flushes): the
    # interpreter runs the fp16 trick and an fp32 dot instead, exact as well
    bf16 = x_dtype == torch.bfloat16 and not interpreting()
    rows = members or (N,)
    kwargs = dict(
        BF16_BY_HAND=bf16_by_hand(out_dtype), DOT_DTYPE=dot_dtype, INPUT_PRECISION=precision,
        EVEN_N=all(n % cfg["BN"] == 0 for n in rows), EVEN_K=kb % cfg["NB"] == 0 and K == 16 * kb, BF16=bf16,
        **cfg,
    )  # fmt: skip
    counts = [cdiv(n, cfg["BN"]) for n in rows]
    tiles = sum(counts)
    starts = tuple(sum(counts[:j]) for j in range(1, len(counts))) if members else ()
    return DecodeLaunch(
        M=M, N=total, K=K, kb=kb, grid=(tiles, cfg["SPLIT_K"], cdiv(M, cfg["BM"])), split=cfg["SPLIT_K"], tiles=tiles,
        fused=fused,
        out_mult=2.0**7 if bf16 else UNPACK_FACTOR,  # undoes the unpack bias (see _unpack_words)
        kwargs=kwargs, members=members, starts=starts,
    )  # fmt: skip
