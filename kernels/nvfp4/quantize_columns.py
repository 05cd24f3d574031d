"""Columnwise NVFP4 quantization: quantize ``xᵀ`` (1×16 blocks along the TOKEN dim of ``x``) without
materializing the transpose.

``quantize_columnwise(x [T, C], recipe, gather=, dest=, length=)`` returns exactly (same data bytes, scale
bytes, outer scales, amax and ``expanded``) what ``quantize(Y, recipe)`` returns for the ``[C, length]``
matrix ``Y`` whose column ``dest[r]`` is row r of ``x`` (of ``x[gather]`` with ``gather``), zeros
elsewhere; without ``dest``, ``Y = xᵀ`` (``x[gather]ᵀ``). That is the wgrad operand layout of TE-style
nvfp4-backward (``dW = Q_H(dyᵀ)·Q_H(xᵀ)``) and of the MoE grouped wgrad (``dest`` from
:func:`triage.kernels.moe.grouped_gemm.padded_segments`: every expert segment starts a new 16-block).
:func:`columnwise_matrix` builds that ``Y`` explicitly: the reference path is ``quantize(columnwise_matrix(...))``.

Kernels (two passes for a dynamic per-tensor / per-row outer scale, one for a recipe-given one). A program
owns ``NB`` 16-blocks of Y's columns (``16·NB`` tokens) × ``BC`` rows of Y (channels of x). Token row
``l`` of Y's columns comes from row ``src[l]`` of x (an int32 map built on the device from ``dest`` /
``gather``, -1 = padding; none needed for a plain transpose), so a program does 16 masked row loads of
``[NB, BC]``, one per token position j of a block (each a coalesced read of ``BC`` contiguous channels).
The transpose happens by construction: the 16 elements of one Y block are the SAME register slot of 16
separate ``[NB, BC]`` tensors, all in one layout, so the Hadamard butterflies (TE signs / 4, 4 radix-2 stages,
the same fp32 operations in the same order as ``hadamard.py``), the block amax, the E4M3 block
scale and the E2M1 codes are plain elementwise ops across the 16 tensors, which by design need no
shuffles, shared memory or layout conversions (not yet confirmed in the GPU's SASS). The codes of a block leave as two int32 words (8 bytes) of Y's row ``c``, the scale
as one byte, the optional exact ``q·s`` as 8 words of bf16/fp16 pairs.

* amax pass (dynamic ``"tensor"`` / ``"row"``; ``"expert"`` on a 2-D Y is per row): the same loads and
  Hadamard, block amax with NaN ignored, one integer ``atomic_max`` of the fp32 bits per program (tensor)
  or per channel (row) into a zeroed int32 buffer (plus a NaN flag for compressed-tensors), as
  ``quantize_rows._amax_tiled_kernel``;
* quantize pass: the outer scales from that buffer with the reference formulas
  (:func:`~.device.outer_from_row_amax`), then :func:`~.device.block_scale` / ``block_factor`` /
  ``e2m1_code``, the row quantizer's own (:mod:`.device`).

Stochastic rounding: element ``(c, l)`` of Y draws ``fmix32((c·Lp + l) mod 2^32 ^ key) >> 8``, its
row-major linear index in the K-padded Y (``reference.round_codes``), so the bytes match ``quantize(Y)``.

``block="16x16"`` recipes, ``backend="torch"`` and ``backend="auto"`` on non-CUDA tensors take the
reference path (materialize ``Y``, then :func:`~triage.kernels.nvfp4.api.quantize`).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from .._launch import cdiv, fast_launch, next_power_of_2
from .api import check_quantize_options, quantize
from .device import (
    EXPANDED_ID,
    INTERPRETED,
    OUTER_GIVEN,
    OUTER_GROUP,
    OUTER_ROW,
    PROFILE_ID,
    ROUND_ID,
    SIGN_MASK,
    QuantOutputs,
    available,
    bfly16,
    bits_view,
    block_factor,
    block_scale,
    check_runnable,
    e2m1_code,
    expanded_word,
    fmix32,
    given_outer_args,
    interpreting,
    max_nan,
    outer_from_row_amax,
    publish_amax,
    quarter,
    reduced_amax,
    round_to,
    seed_arg,
    store_outer,
    stream_key,
    widen,
)
from .format import BLOCK
from .quantize_rows import quantize_triton
from .recipe import QuantRecipe
from .reference import check_input
from .tensor import NVFP4Tensor

__all__ = ["ColumnsPlan", "columns_plan", "columnwise_matrix", "columnwise_source", "quantize_columnwise"]


@triton.jit
def _token(
    x_ptr, src_ptr, l, c64, cmask, L, sx0, sx1, HAS_SRC: tl.constexpr, ROUND: tl.constexpr,
):  # fmt: skip
    """Y[c, l] for token indices ``l`` [NB] and channels ``c`` [BC]: ``x[src[l], c]`` as fp32 [NB, BC]
    (0 for padding: ``src[l] < 0`` or ``l >= L``)."""
    if HAS_SRC:
        s = tl.load(src_ptr + l, mask=l < L, other=-1)
    else:
        s = tl.where(l < L, l, -1)
    m = (s >= 0)[:, None] & cmask[None, :]
    return widen(
        tl.load(x_ptr + s.to(tl.int64)[:, None] * sx0 + c64[None, :] * sx1, mask=m, other=0), ROUND
    )


@triton.jit
def _h16(
    v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15,
    SIGNS: tl.constexpr, ROUND: tl.constexpr,
):  # fmt: skip
    """The 16-point RHT of the blocks held as 16 tensors (element j of every block in ``vj``): × sign/4,
    4 butterflies, rounded to the input dtype; the fp32 ops of ``quantize_rows._rht16``."""
    v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = (
        quarter(v0, SIGNS, 0, ROUND), quarter(v1, SIGNS, 1, ROUND), quarter(v2, SIGNS, 2, ROUND),
        quarter(v3, SIGNS, 3, ROUND), quarter(v4, SIGNS, 4, ROUND), quarter(v5, SIGNS, 5, ROUND),
        quarter(v6, SIGNS, 6, ROUND), quarter(v7, SIGNS, 7, ROUND), quarter(v8, SIGNS, 8, ROUND),
        quarter(v9, SIGNS, 9, ROUND), quarter(v10, SIGNS, 10, ROUND), quarter(v11, SIGNS, 11, ROUND),
        quarter(v12, SIGNS, 12, ROUND), quarter(v13, SIGNS, 13, ROUND),
        quarter(v14, SIGNS, 14, ROUND), quarter(v15, SIGNS, 15, ROUND),
    )  # fmt: skip
    for _ in tl.static_range(4):
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = bfly16(
            v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15
        )
    return (
        round_to(v0, ROUND), round_to(v1, ROUND), round_to(v2, ROUND), round_to(v3, ROUND),
        round_to(v4, ROUND), round_to(v5, ROUND), round_to(v6, ROUND), round_to(v7, ROUND),
        round_to(v8, ROUND), round_to(v9, ROUND), round_to(v10, ROUND), round_to(v11, ROUND),
        round_to(v12, ROUND), round_to(v13, ROUND), round_to(v14, ROUND), round_to(v15, ROUND),
    )  # fmt: skip


@triton.jit
def _load16(
    x_ptr, src_ptr, l0, c64, cmask, L, sx0, sx1,
    HAS_SRC: tl.constexpr, ROUND: tl.constexpr, HADAMARD: tl.constexpr, SIGNS: tl.constexpr,
):  # fmt: skip
    """The Y blocks starting at token ``l0`` [NB] for channels ``c64`` [BC]: element j of each block as
    ``vj`` [NB, BC] fp32 (Hadamard-rotated and rounded to the input dtype if ``HADAMARD``)."""
    v0 = _token(x_ptr, src_ptr, l0 + 0, c64, cmask, L, sx0, sx1, HAS_SRC, ROUND)
    v1 = _token(x_ptr, src_ptr, l0 + 1, c64, cmask, L, sx0, sx1, HAS_SRC, ROUND)
    v2 = _token(x_ptr, src_ptr, l0 + 2, c64, cmask, L, sx0, sx1, HAS_SRC, ROUND)
    v3 = _token(x_ptr, src_ptr, l0 + 3, c64, cmask, L, sx0, sx1, HAS_SRC, ROUND)
    v4 = _token(x_ptr, src_ptr, l0 + 4, c64, cmask, L, sx0, sx1, HAS_SRC, ROUND)
    v5 = _token(x_ptr, src_ptr, l0 + 5, c64, cmask, L, sx0, sx1, HAS_SRC, ROUND)
    v6 = _token(x_ptr, src_ptr, l0 + 6, c64, cmask, L, sx0, sx1, HAS_SRC, ROUND)
    v7 = _token(x_ptr, src_ptr, l0 + 7, c64, cmask, L, sx0, sx1, HAS_SRC, ROUND)
    v8 = _token(x_ptr, src_ptr, l0 + 8, c64, cmask, L, sx0, sx1, HAS_SRC, ROUND)
    v9 = _token(x_ptr, src_ptr, l0 + 9, c64, cmask, L, sx0, sx1, HAS_SRC, ROUND)
    v10 = _token(x_ptr, src_ptr, l0 + 10, c64, cmask, L, sx0, sx1, HAS_SRC, ROUND)
    v11 = _token(x_ptr, src_ptr, l0 + 11, c64, cmask, L, sx0, sx1, HAS_SRC, ROUND)
    v12 = _token(x_ptr, src_ptr, l0 + 12, c64, cmask, L, sx0, sx1, HAS_SRC, ROUND)
    v13 = _token(x_ptr, src_ptr, l0 + 13, c64, cmask, L, sx0, sx1, HAS_SRC, ROUND)
    v14 = _token(x_ptr, src_ptr, l0 + 14, c64, cmask, L, sx0, sx1, HAS_SRC, ROUND)
    v15 = _token(x_ptr, src_ptr, l0 + 15, c64, cmask, L, sx0, sx1, HAS_SRC, ROUND)
    if HADAMARD:
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _h16(
            v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15, SIGNS, ROUND
        )
    return v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15


@triton.jit
def _abs0(v):
    """|v| with NaN -> 0."""
    return tl.where(v != v, 0.0, tl.abs(v))


@triton.jit
def _amax16(
    v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15, IGNORE_NAN: tl.constexpr,
):  # fmt: skip
    """Block amax [NB, BC] over the 16 element tensors, NaN ignored (te; an all-NaN block gives 0) or
    propagated, as ``quantize_rows._block_amax``. GPU: ``max.f32`` skips NaN, ``max.NaN.f32``
    propagates; the interpreter (numpy) propagates in both, so there NaNs are filtered explicitly."""
    if INTERPRETED:
        m = tl.maximum(
            tl.maximum(
                tl.maximum(tl.maximum(_abs0(v0), _abs0(v1)), tl.maximum(_abs0(v2), _abs0(v3))),
                tl.maximum(tl.maximum(_abs0(v4), _abs0(v5)), tl.maximum(_abs0(v6), _abs0(v7))),
            ),
            tl.maximum(
                tl.maximum(tl.maximum(_abs0(v8), _abs0(v9)), tl.maximum(_abs0(v10), _abs0(v11))),
                tl.maximum(tl.maximum(_abs0(v12), _abs0(v13)), tl.maximum(_abs0(v14), _abs0(v15))),
            ),
        )
        if not IGNORE_NAN:
            m = tl.where(_nan16(v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15) > 0,
                         float("nan"), m)  # fmt: skip
    elif IGNORE_NAN:
        m = tl.maximum(
            tl.maximum(
                tl.maximum(tl.maximum(tl.abs(v0), tl.abs(v1)), tl.maximum(tl.abs(v2), tl.abs(v3))),
                tl.maximum(tl.maximum(tl.abs(v4), tl.abs(v5)), tl.maximum(tl.abs(v6), tl.abs(v7))),
            ),
            tl.maximum(
                tl.maximum(tl.maximum(tl.abs(v8), tl.abs(v9)), tl.maximum(tl.abs(v10), tl.abs(v11))),
                tl.maximum(tl.maximum(tl.abs(v12), tl.abs(v13)), tl.maximum(tl.abs(v14), tl.abs(v15))),
            ),
        )
        m = tl.where(m != m, 0.0, m)  # an all-NaN block
    else:
        m = max_nan(
            max_nan(
                max_nan(max_nan(tl.abs(v0), tl.abs(v1)), max_nan(tl.abs(v2), tl.abs(v3))),
                max_nan(max_nan(tl.abs(v4), tl.abs(v5)), max_nan(tl.abs(v6), tl.abs(v7))),
            ),
            max_nan(
                max_nan(max_nan(tl.abs(v8), tl.abs(v9)), max_nan(tl.abs(v10), tl.abs(v11))),
                max_nan(max_nan(tl.abs(v12), tl.abs(v13)), max_nan(tl.abs(v14), tl.abs(v15))),
            ),
        )
    return m


@triton.jit
def _nan16(v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15):
    """int32 [NB, BC]: 1 where the block holds a NaN."""
    n = (v0 != v0) | (v1 != v1) | (v2 != v2) | (v3 != v3) | (v4 != v4) | (v5 != v5) | (v6 != v6)
    n = n | (v7 != v7) | (v8 != v8) | (v9 != v9) | (v10 != v10) | (v11 != v11) | (v12 != v12)
    return (n | (v13 != v13) | (v14 != v14) | (v15 != v15)).to(tl.int32)


@triton.jit
def _code(
    v, f, base, J: tl.constexpr, keyu,
    PROFILE: tl.constexpr, STOCHASTIC: tl.constexpr, SIGNBIT: tl.constexpr,
):  # fmt: skip
    """E2M1 code (int32) of element J of the blocks: the scaled value (``quantize_rows._apply_factor``:
    ``v·f`` for te/torchao, ``v/f`` otherwise) rounded by ``e2m1_code``; the stochastic stream index
    is ``base + J`` (mod 2^32)."""
    if PROFILE <= 1:
        s = v * f
    else:
        s = tl.math.div_rn(v, f)
    if STOCHASTIC:
        u24 = fmix32((base + J) ^ keyu) >> 8
    else:
        u24 = 0
    return e2m1_code(s, u24, STOCHASTIC, SIGNBIT)


@triton.jit
def _word(q0, q1, q2, q3, q4, q5, q6, q7):
    """Eight E2M1 codes (int32) -> their four packed bytes as one int32 (element 2i in byte i's low nibble)."""
    w = q0 | (q1 << 4) | (q2 << 8) | (q3 << 12)
    return w | (q4 << 16) | (q5 << 20) | (q6 << 24) | (q7 << 28)


@fast_launch
@triton.jit
def _amax_colwise_kernel(
    x_ptr, src_ptr, buf_ptr, C, L, sx0, sx1, TILES,
    PER_ROW: tl.constexpr, PROPAGATE_NAN: tl.constexpr, HADAMARD: tl.constexpr, ROUND: tl.constexpr,
    SIGNS: tl.constexpr, HAS_SRC: tl.constexpr, BC: tl.constexpr, NB: tl.constexpr,
):  # fmt: skip
    """NaN-free amax of Y (through the Hadamard transform if asked) over ``TILES`` consecutive
    ``16·NB``-token tiles × ``BC`` channels: one integer ``atomic_max`` of the fp32 bits into
    ``buf[0]`` (tensor) or ``buf[2c]`` per channel (row); ``buf[.. + 1]`` flags a NaN when
    ``PROPAGATE_NAN``. ``buf`` is zeroed by the caller."""
    pid_t, pid_c = tl.program_id(0), tl.program_id(1)
    c = pid_c * BC + tl.arange(0, BC)
    cmask = c < C
    c64 = c.to(tl.int64)
    m = tl.zeros((NB, BC), tl.float32)
    has_nan = tl.zeros((NB, BC), tl.int32)
    for i in range(TILES):
        l0 = (pid_t * TILES + i) * (16 * NB) + 16 * tl.arange(0, NB)
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _load16(
            x_ptr, src_ptr, l0, c64, cmask, L, sx0, sx1, HAS_SRC, ROUND, HADAMARD, SIGNS
        )
        m = tl.maximum(
            m, _amax16(v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15, True)
        )  # both NaN-free
        if PROPAGATE_NAN:
            has_nan = has_nan | _nan16(
                v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15
            )
    if PER_ROW:
        tl.atomic_max(buf_ptr + 2 * c, tl.max(m, axis=0).to(tl.int32, bitcast=True), mask=cmask)
        if PROPAGATE_NAN:
            tl.atomic_max(buf_ptr + 2 * c + 1, tl.max(has_nan, axis=0), mask=cmask)
    else:
        publish_amax(buf_ptr, m, has_nan, PROPAGATE_NAN)


@fast_launch
@triton.jit(do_not_specialize=["key", "enc_arg", "dec_arg", "amax_arg"])
def _quantize_colwise_kernel(
    x_ptr, src_ptr, data_ptr, scale_ptr, exp_ptr, enc_ptr, dec_ptr, amax_ptr, group_amax_ptr,
    enc_arg, dec_arg, amax_arg, C, L, LP, sx0, sx1, key,
    PROFILE: tl.constexpr, OUTER: tl.constexpr, HADAMARD: tl.constexpr, ROUND: tl.constexpr,
    STOCHASTIC: tl.constexpr, SIGNBIT: tl.constexpr, SIGNS: tl.constexpr, WRITE_AMAX: tl.constexpr,
    EXPANDED: tl.constexpr, HAS_SRC: tl.constexpr, BC: tl.constexpr, NB: tl.constexpr,
    SEED_PTR: tl.constexpr = False, NONFINITE: tl.constexpr = False,
):  # fmt: skip
    """Y's 16-blocks ``pid_t·NB ..`` of rows (channels) ``pid_c·BC ..``: codes to ``data_ptr`` (int32
    view of ``[C, LP/2]`` bytes: two words per block), scale bytes to ``scale_ptr`` ``[C, LP/16]``,
    optionally the exact ``q·s`` to ``exp_ptr`` (int32 view of ``[C, LP]`` bf16/fp16: 8 words per
    block). ``OUTER``: 0 given as arguments, 1 one amax (``group_amax_ptr[0:2]``), 2 one per channel
    (``group_amax_ptr[2c : 2c+2]``); the outer scales are written once (by the ``pid_t == 0`` programs).
    ``NONFINITE`` (:func:`columns_plan`'s ``nonfinite``; the amax pass ran with its NaN flag): the stored
    decode scale is NaN where Y (its channel, per channel) holds a NaN or its amax is Inf, the layers'
    non-finite rule; codes and block scales are computed from the finite scale as without it."""
    pid_t, pid_c = tl.program_id(0), tl.program_id(1)
    c = pid_c * BC + tl.arange(0, BC)
    cmask = c < C
    c64 = c.to(tl.int64)
    blk = pid_t * NB + tl.arange(0, NB)  # Y's block columns [NB]
    l0 = blk * 16
    one = tl.full((1, BC), 1.0, tl.float32)
    if OUTER == 2:  # per channel (Y row), from the amax pass
        amax = reduced_amax(group_amax_ptr, c, cmask, PROFILE)
        enc, dec = outer_from_row_amax(amax[None, :], PROFILE)
        first = cmask & (c * 0 + pid_t == 0)
        tl.store(amax_ptr + c, amax, mask=first)
        if NONFINITE:  # the layers' non-finite rule, per channel, on the stored decode scale only
            bad = (tl.load(group_amax_ptr + 2 * c + 1, mask=cmask, other=0) > 0) | (amax == float("inf"))
            store_outer(enc_ptr, dec_ptr, c, enc, tl.where(bad[None, :], float("nan"), dec), first, BC)
        else:
            store_outer(enc_ptr, dec_ptr, c, enc, dec, first, BC)
    elif OUTER == 1:  # one for the whole tensor
        amax = tl.load(group_amax_ptr + c * 0).to(tl.float32, bitcast=True)
        if PROFILE == 3:
            flag = tl.load(group_amax_ptr + c * 0 + 1)
            amax = tl.where(flag > 0, float("nan"), amax)
        enc, dec = outer_from_row_amax(amax[None, :], PROFILE)
        first = c + pid_t == 0  # program (0, 0), channel 0
        tl.store(amax_ptr + c * 0, amax, mask=first)
        if NONFINITE:  # the layers' non-finite rule on the stored decode scale only
            bad = (tl.load(group_amax_ptr + c * 0 + 1) > 0) | (amax == float("inf"))
            store_outer(enc_ptr, dec_ptr, c * 0, enc, tl.where(bad[None, :], float("nan"), dec), first, BC)
        else:
            store_outer(enc_ptr, dec_ptr, c * 0, enc, dec, first, BC)
    else:  # given as arguments (static / checkpoint / none)
        enc = one * enc_arg
        dec = one * dec_arg
        first = c + pid_t == 0  # program (0, 0), channel 0
        store_outer(enc_ptr, dec_ptr, c * 0, enc, dec, first, BC)
        if WRITE_AMAX:
            tl.store(amax_ptr + c * 0, tl.zeros((BC,), tl.float32) + amax_arg, mask=first)
    r6 = tl.math.div_rn(one, one * 6.0)  # RN(1/6)
    v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _load16(
        x_ptr, src_ptr, l0, c64, cmask, L, sx0, sx1, HAS_SRC, ROUND, HADAMARD, SIGNS
    )
    b = _amax16(v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15, PROFILE == 0)
    code, sval = block_scale(b, enc, dec, one, r6, PROFILE)  # [NB, BC]
    f = block_factor(sval, enc, dec, one, PROFILE)
    if STOCHASTIC:  # the stream index mod 2^32: Y's row-major linear index c·LP + l
        keyu = stream_key(key, SEED_PTR)
        base = (c64 * LP).to(tl.uint32)[None, :] + l0.to(tl.uint32)[:, None]
    else:
        keyu = 0
        base = 0
    q0 = _code(v0, f, base, 0, keyu, PROFILE, STOCHASTIC, SIGNBIT)
    q1 = _code(v1, f, base, 1, keyu, PROFILE, STOCHASTIC, SIGNBIT)
    q2 = _code(v2, f, base, 2, keyu, PROFILE, STOCHASTIC, SIGNBIT)
    q3 = _code(v3, f, base, 3, keyu, PROFILE, STOCHASTIC, SIGNBIT)
    q4 = _code(v4, f, base, 4, keyu, PROFILE, STOCHASTIC, SIGNBIT)
    q5 = _code(v5, f, base, 5, keyu, PROFILE, STOCHASTIC, SIGNBIT)
    q6 = _code(v6, f, base, 6, keyu, PROFILE, STOCHASTIC, SIGNBIT)
    q7 = _code(v7, f, base, 7, keyu, PROFILE, STOCHASTIC, SIGNBIT)
    q8 = _code(v8, f, base, 8, keyu, PROFILE, STOCHASTIC, SIGNBIT)
    q9 = _code(v9, f, base, 9, keyu, PROFILE, STOCHASTIC, SIGNBIT)
    q10 = _code(v10, f, base, 10, keyu, PROFILE, STOCHASTIC, SIGNBIT)
    q11 = _code(v11, f, base, 11, keyu, PROFILE, STOCHASTIC, SIGNBIT)
    q12 = _code(v12, f, base, 12, keyu, PROFILE, STOCHASTIC, SIGNBIT)
    q13 = _code(v13, f, base, 13, keyu, PROFILE, STOCHASTIC, SIGNBIT)
    q14 = _code(v14, f, base, 14, keyu, PROFILE, STOCHASTIC, SIGNBIT)
    q15 = _code(v15, f, base, 15, keyu, PROFILE, STOCHASTIC, SIGNBIT)
    bmask = (blk < LP // 16)[:, None] & cmask[None, :]
    dw = c64[None, :] * (LP // 8) + (blk * 2)[:, None]  # int32 words of Y's row c
    tl.store(data_ptr + dw, _word(q0, q1, q2, q3, q4, q5, q6, q7), mask=bmask)
    tl.store(data_ptr + dw + 1, _word(q8, q9, q10, q11, q12, q13, q14, q15), mask=bmask)
    tl.store(scale_ptr + c64[None, :] * (LP // 16) + blk[:, None], code.to(tl.uint8), mask=bmask)
    if EXPANDED != 0:
        ew = c64[None, :] * (LP // 2) + (blk * 8)[:, None]
        tl.store(exp_ptr + ew, expanded_word(q0, q1, sval, EXPANDED), mask=bmask)
        tl.store(exp_ptr + ew + 1, expanded_word(q2, q3, sval, EXPANDED), mask=bmask)
        tl.store(exp_ptr + ew + 2, expanded_word(q4, q5, sval, EXPANDED), mask=bmask)
        tl.store(exp_ptr + ew + 3, expanded_word(q6, q7, sval, EXPANDED), mask=bmask)
        tl.store(exp_ptr + ew + 4, expanded_word(q8, q9, sval, EXPANDED), mask=bmask)
        tl.store(exp_ptr + ew + 5, expanded_word(q10, q11, sval, EXPANDED), mask=bmask)
        tl.store(exp_ptr + ew + 6, expanded_word(q12, q13, sval, EXPANDED), mask=bmask)
        tl.store(exp_ptr + ew + 7, expanded_word(q14, q15, sval, EXPANDED), mask=bmask)


def _default_tiles(c: int, nblk: int) -> tuple[int, int, int]:
    """(BC channels, NB blocks, num_warps) per program. Interpreter: big tiles (its cost is per op).
    GPU: 128 channels × 4 blocks (64 tokens), 4 warps: 4 elements per thread and tensor, so the 16 block
    elements, codes and temporaries stay in registers (not yet swept on the GPU; see bench_quantize.py
    --columnwise)."""
    if interpreting():
        return min(128, next_power_of_2(max(c, 1))), min(8, next_power_of_2(max(nblk, 1))), 4
    return min(128, next_power_of_2(max(c, 1))), min(4, next_power_of_2(max(nblk, 1))), 4


def _amax_tiles(n_t: int, n_c: int) -> int:
    """Token tiles per program of the amax pass: ~1k programs, one atomic (per channel) each."""
    return max(1, min(64, n_t * n_c // 1024))


def _check_index(t: torch.Tensor | None, name: str, device: torch.device) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(f"quantize_columnwise: {name} must be a 1-D integer tensor")
    if t.device != device:
        raise ValueError(f"quantize_columnwise: {name} is on {t.device}, x on {device}")


def columnwise_matrix(
    x: torch.Tensor,
    *,
    gather: torch.Tensor | None = None,
    dest: torch.Tensor | None = None,
    length: int | None = None,
) -> torch.Tensor:
    """The ``[C, length]`` matrix Y that :func:`quantize_columnwise` quantizes, built explicitly (contiguous):
    column ``dest[r]`` = row r of ``x`` (``x[gather]``), zeros elsewhere; ``xᵀ`` (``x[gather]ᵀ``) without
    ``dest``. The reference path: ``quantize(columnwise_matrix(x, ...), recipe)``."""
    rows = x if gather is None else x.index_select(0, gather)
    if dest is None:
        return rows.t().contiguous()
    return rows.new_zeros((length, x.shape[1])).index_copy_(0, dest.long(), rows).t().contiguous()


def columnwise_source(
    rows: int,
    *,
    gather: torch.Tensor | None = None,
    dest: torch.Tensor | None = None,
    length: int | None = None,
) -> torch.Tensor | None:
    """int32 ``src[length]``: the row of x that column l of Y reads (-1: a zero column); None for a plain
    transpose (``src[l] = l``). Device ops only (one scatter)."""
    if dest is None:
        return None if gather is None else gather.to(torch.int32).contiguous()
    src = torch.full((length,), -1, dtype=torch.int32, device=dest.device)
    vals = gather if gather is not None else torch.arange(rows, device=dest.device)
    return src.index_copy_(0, dest.long(), vals.to(torch.int32))


def quantize_columnwise(
    x: torch.Tensor,
    recipe: QuantRecipe | None = None,
    *,
    seed: int | torch.Tensor | None = None,
    gather: torch.Tensor | None = None,
    dest: torch.Tensor | None = None,
    length: int | None = None,
    emit_expanded: torch.dtype | None = None,
    backend: str = "auto",
    block_c: int | None = None,
    block_t: int | None = None,
    num_warps: int | None = None,
) -> NVFP4Tensor:
    """``quantize(Y, recipe, seed=seed, emit_expanded=emit_expanded)`` for the ``[C, L]`` matrix Y of
    :func:`columnwise_matrix` (``x`` [T, C] fp32/bf16/fp16; Y's column ``dest[r]`` is row r of ``x`` or of
    ``x[gather]``, zeros elsewhere, ``L = length``; without ``dest`` ``Y = x[gather]ᵀ`` / ``xᵀ`` and
    ``L`` = the row count), byte for byte, without materializing Y (module docstring).

    ``L`` not a multiple of 16 needs ``recipe.pad`` (Y is zero-padded, as ``quantize`` does). ``gather``
    and ``dest`` are not bounds-checked on the Triton path (no host sync): indices must lie in
    ``[0, rows)`` / ``[0, L)`` (a negative ``gather`` index reads as a zero row there, where the reference
    path raises; one ≥ the row count reads out of bounds); ``dest`` must not repeat a column. ``x`` may have any strides (rows with contiguous channels are the fast layout; an ``x`` whose
    transpose is contiguous goes straight to the row-major quantizer). ``backend``: as
    :func:`~triage.kernels.nvfp4.api.quantize` (``"auto"``: Triton on CUDA, the reference path elsewhere;
    ``"triton"`` also on CPU under ``TRITON_INTERPRET=1``). ``block_c``/``block_t`` (channels / tokens,
    powers of two, ``block_t`` a multiple of 16) and ``num_warps`` tune the tiles. Recipes other than
    ``block="1x16"`` take the reference path. Never synchronizes with the host."""
    recipe = QuantRecipe() if recipe is None else recipe
    check_quantize_options("quantize_columnwise", backend, seed, emit_expanded, getattr(x, "device", None))
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"quantize_columnwise: x must be a 2-D [T, C] tensor, got {shape}")
    T, C = x.shape
    _check_index(gather, "gather", x.device)
    _check_index(dest, "dest", x.device)
    rows = T if gather is None else gather.numel()
    if dest is None:
        if length is not None and length != rows:
            raise ValueError(
                f"quantize_columnwise: length={length} without dest must equal the row count {rows}"
            )
        L = rows
    else:
        if dest.numel() != rows:
            raise ValueError(f"quantize_columnwise: dest has {dest.numel()} entries for {rows} rows")
        if length is None:
            raise ValueError("quantize_columnwise: dest needs length (the column count of Y)")
        L = int(length)
    use_triton = backend == "triton" or (backend == "auto" and available(x.device))
    if not use_triton or recipe.block != "1x16":
        check_input(torch.empty((C, L), dtype=x.dtype, device="meta"), recipe, name="Y (the columnwise matrix)")
        y = columnwise_matrix(x, gather=gather, dest=dest, length=L)
        return quantize(y, recipe, backend=backend, seed=seed, emit_expanded=emit_expanded)
    check_runnable(x)
    if gather is None and dest is None and x.t().is_contiguous():
        check_input(torch.empty((C, L), dtype=x.dtype, device="meta"), recipe, name="Y (the columnwise matrix)")
        return quantize_triton(  # xᵀ is already a contiguous [C, T]: the row-major path
            x.t(), recipe, seed=seed, emit_expanded=emit_expanded
        )
    has_src = gather is not None or dest is not None
    plan = columns_plan(C, L, x.dtype, recipe, has_src, emit_expanded, block_c, block_t, num_warps, interpreting())
    src = columnwise_source(T if gather is None else gather.numel(), gather=gather, dest=dest, length=L)
    return plan.run(x, seed, src)


@dataclasses.dataclass(frozen=True)
class ColumnsPlan:
    """Everything the Triton path of :func:`quantize_columnwise` derives from Y's shape ``[C, L]``, x's dtype,
    the recipe and the tile options alone (the checks on Y, tiles, grids, the outer-scale mode and its host
    arguments, constexprs): built once per signature by :func:`columns_plan`, so that a call only allocates
    its outputs and launches (:meth:`run`)."""

    recipe: QuantRecipe
    C: int
    L: int
    lp: int
    dtype: torch.dtype
    has_src: bool
    emit_expanded: torch.dtype | None
    n_outer: int
    out_shape: tuple
    write_amax: bool
    mode: int
    nonfinite: bool  # the kernel applies the layers' non-finite rule (columns_plan)
    amax_grid: tuple[int, int] | None  # None: no amax pass (recipe-given outer scales)
    amax_args: tuple  # TILES
    amax_constexprs: dict
    grid: tuple[int, int]
    scalar_args: tuple  # enc_arg, dec_arg, amax_arg, C, L, LP
    constexprs: dict

    def run(self, x: torch.Tensor, seed: int | torch.Tensor | None, src: torch.Tensor | None) -> NVFP4Tensor:
        """Quantize Y of ``x`` [T, C] (any strides, the planned dtype and C); ``src`` the int32 column →
        row map of :func:`columnwise_source` (None, as planned, for a plain transpose)."""
        dev = x.device
        xa = bits_view(x)
        sx0, sx1 = x.stride()
        src_arg = src if self.has_src else xa  # never read without HAS_SRC
        group_amax = None
        if self.amax_grid is not None:
            group_amax = torch.zeros((self.n_outer, 2), dtype=torch.int32, device=dev)
            _amax_colwise_kernel[self.amax_grid](
                xa, src_arg, group_amax, self.C, self.L, sx0, sx1, *self.amax_args, **self.amax_constexprs
            )
        out = QuantOutputs.empty((self.C,), self.lp, self.out_shape, self.write_amax, self.emit_expanded, dev)
        data32, expanded, enc_t = out.data.view(torch.int32), out.expanded, out.enc
        enc_arg, dec_arg, amax_arg, C, L, lp = self.scalar_args
        key = seed_arg(self.recipe, seed)
        _quantize_colwise_kernel[self.grid](
            xa, src_arg, data32, out.scale, data32 if expanded is None else expanded.view(torch.int32),
            enc_t, out.dec, out.amax, enc_t if group_amax is None else group_amax, enc_arg, dec_arg, amax_arg,
            C, L, lp, sx0, sx1, key, **self.constexprs, SEED_PTR=isinstance(key, torch.Tensor),
        )  # fmt: skip
        return out.tensor(self.recipe, torch.Size((C, L)), self.dtype)


@functools.lru_cache(maxsize=1024)
def columns_plan(
    C: int,
    L: int,
    dtype: torch.dtype,
    recipe: QuantRecipe,
    has_src: bool,
    emit_expanded: torch.dtype | None = None,
    block_c: int | None = None,
    block_t: int | None = None,
    num_warps: int | None = None,
    interpreted: bool = False,
    nonfinite: bool = False,
) -> ColumnsPlan:
    """The :class:`ColumnsPlan` of the Triton columnwise quantizer for a ``[C, L]`` matrix Y of x's ``dtype``
    (``has_src``: Y's columns come through a gather / dest map; ``interpreted``:
    :func:`~.device.interpreting`, which picks the tiles). Checks Y as ``quantize`` would (an error names
    it); pure, cached per signature.

    ``nonfinite`` (the NVFP4 layers ask for it), as :func:`~.quantize_rows.rows_plan`'s: for a dynamic
    per-tensor outer scale, or a per-row one (a Y row: a channel) over 1×16 blocks, the kernel applies the
    layers' non-finite rule (:func:`triage.kernels.linear.nan_if_nonfinite` of Y) from the amax pass it runs
    anyway; ``plan.nonfinite`` says whether it does. Only the stored decode scale of a non-finite Y differs
    from the plain quantizer's."""
    check_input(torch.empty((C, L), dtype=dtype, device="meta"), recipe, name="Y (the columnwise matrix)")
    lp = (L + BLOCK - 1) // BLOCK * BLOCK
    nblk = lp // BLOCK
    bc, nb, warps = _default_tiles(C, nblk)
    bc = block_c or bc
    nb = block_t // 16 if block_t else nb
    warps = num_warps or warps
    round_id = ROUND_ID[dtype]
    enc_arg = dec_arg = amax_arg = 1.0
    write_amax = True
    dynamic = recipe.scale_source == "dynamic"
    if dynamic and recipe.scale in ("row", "expert"):  # on a 2-D Y, one expert = one row
        mode, n_outer, out_shape = OUTER_ROW, C, (C, 1)
    elif dynamic and recipe.scale == "tensor":
        mode, n_outer, out_shape = OUTER_GROUP, 1, ()
    else:
        enc_arg, dec_arg, amax_arg, write_amax = given_outer_args(recipe)
        mode, n_outer, out_shape = OUTER_GIVEN, 1, ()
    nonfinite = nonfinite and dynamic and (recipe.scale == "tensor" or (recipe.scale == "row" and recipe.block == "1x16"))
    n_t, n_c = cdiv(nblk, nb), cdiv(C, bc)
    amax_grid, amax_args, amax_constexprs = None, (), {}
    if mode != OUTER_GIVEN:
        tiles = _amax_tiles(n_t, n_c)
        amax_grid, amax_args = (cdiv(n_t, tiles), n_c), (tiles,)
        amax_constexprs = dict(
            PER_ROW=mode == OUTER_ROW, PROPAGATE_NAN=recipe.profile == "compressed-tensors" or nonfinite,
            HADAMARD=recipe.hadamard, ROUND=round_id, SIGNS=SIGN_MASK, HAS_SRC=has_src, BC=bc, NB=nb,
            num_warps=warps,
        )  # fmt: skip
    constexprs = dict(
        PROFILE=PROFILE_ID[recipe.profile], OUTER=mode, HADAMARD=recipe.hadamard, ROUND=round_id,
        STOCHASTIC=recipe.rounding == "stochastic", SIGNBIT=recipe.profile in ("te", "torchao"),
        SIGNS=SIGN_MASK, WRITE_AMAX=write_amax, EXPANDED=0 if emit_expanded is None else EXPANDED_ID[emit_expanded],
        HAS_SRC=has_src, BC=bc, NB=nb, num_warps=warps, NONFINITE=nonfinite,
    )  # fmt: skip
    return ColumnsPlan(
        recipe=recipe, C=C, L=L, lp=lp, dtype=dtype, has_src=has_src, emit_expanded=emit_expanded,
        n_outer=n_outer, out_shape=out_shape, write_amax=write_amax, mode=mode, nonfinite=nonfinite,
        amax_grid=amax_grid,
        amax_args=amax_args, amax_constexprs=amax_constexprs, grid=(n_t, n_c),
        scalar_args=(enc_arg, dec_arg, amax_arg, C, L, lp), constexprs=constexprs,
    )  # fmt: skip
