"""The Triton NVFP4 quantizer of rows, :func:`quantize_triton`: bit-identical to ``reference.py`` for every
profile (its inverses, dequantize and expand, are in :mod:`.dequantize_rows`; ``xᵀ`` without a transposed
copy in :mod:`.quantize_columns`; the helpers both quantizers share in :mod:`.device`).

Tiles are 3-D ``[BR rows, NB blocks, 16]``, built straight from pointers, so every thread owns whole halves of
16-element blocks: loads and stores are 16-byte vectors, the block amax is a register max plus one shuffle,
and block scales broadcast back without a layout change. One program quantizes ``BR`` rows across all of K
in ``BK = 16·NB`` chunks: load -> (Hadamard, rounded to the input dtype) -> block amax -> E4M3 block scale ->
scaled values -> E2M1 codes (nearest or stochastic) -> packed bytes (+ optionally the exact ``q·s`` values,
``emit_expanded``, for a stock tensor-core GEMM). bf16 with ``K % 16 == 0`` takes a fast path (``PAIRS``,
:func:`_quantize_pairs_step`): whole blocks per thread as int32 words of bf16 pairs, no shuffles, the
Hadamard transform (if any) as register arithmetic. Outer scale, never through the host (no device sync):

* ``"row"`` (dynamic): one kernel; the program first sweeps its rows for the row amax, then quantizes (the
  second read hits L2);
* ``"tensor"`` / ``"expert"`` (dynamic): an amax kernel (flat 1-D sweep, integer max on the float bits,
  one ``atomic_max`` per program into a zeroed buffer; with Hadamard a sweep of whole blocks), then the quantize kernel, which turns the amax
  into the outer scales itself (same formulas as the reference, ``div_rn``) and writes them out;
* static / checkpoint / none: the outer scales come from the recipe alone, are computed once on the host
  with the reference's own torch code (CPU, IEEE) and passed as fp32 kernel arguments; one pass.

Exactness rules (Triton fp32 ``/`` is approximate, see docs): every division is ``tl.math.div_rn``; products
feeding an add are exact (signs, powers of two) so FMA contraction cannot change a result, except the
Hadamard's ``x·(±1/4)`` of fp32 input below 2^-124, issued as ``mul.rn.f32`` (:func:`~.device.times_quarter`,
never contracted); the E4M3 cast and the bf16 rounding are done with integer arithmetic (the interpreter's
casts truncate, the GPU's round; the integer path is right on both), except the fast path's Hadamard
outputs, rounded by the GPU's own ``cvt.rn.bf16.f32`` (:func:`_bf16_rne_fast`; integer under the
interpreter).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton
import triton.language as tl

from .._launch import cdiv, fast_launch, next_power_of_2
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
    bf16_rne,
    bfly16,
    bits_view,
    block_factor,
    block_scale,
    check_runnable,
    e2m1_abs_code,
    e2m1_code,
    e2m1_value,
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
    times_quarter,
    widen,
)
from .format import BLOCK
from .recipe import QuantRecipe
from .tensor import NVFP4Tensor

__all__ = ["quantize_triton"]


@triton.jit
def _bf16_rne_fast(x):
    """:func:`bf16_rne` (NaN only kept as some NaN) in the GPU's own conversion: ``cvt.rn.bf16.f32``
    (one ``F2F`` per value, subnormals kept; what torch's CUDA ``.to(bfloat16)`` runs too) and an
    exact widening, 2 instructions per value against ~6. The interpreter's cast truncates: there the
    integer path."""
    if INTERPRETED:
        return bf16_rne(x)
    return x.to(tl.bfloat16).to(tl.float32)


@triton.jit
def _block_amax(x3, IGNORE_NAN: tl.constexpr):
    """[BR, NB, 16] -> [BR, NB]: max |x| of each block, NaN ignored (te) or propagated (other profiles).

    GPU: ``max.f32`` already skips NaN and ``max.NaN.f32`` propagates it: one instruction per element.
    The interpreter (numpy) propagates NaN in both, so there the NaNs are filtered explicitly."""
    a = tl.abs(x3)
    if INTERPRETED:
        nan = a != a
        b = tl.max(tl.where(nan, 0.0, a), axis=2)
        if not IGNORE_NAN:
            b = tl.where(tl.max(nan.to(tl.int32), axis=2) > 0, float("nan"), b)
    elif IGNORE_NAN:
        b = tl.max(a, axis=2)
        b = tl.where(b != b, 0.0, b)  # an all-NaN block
    else:
        b = tl.reduce(a, 2, max_nan)
    return b


@triton.jit
def _rht16(x, BR: tl.constexpr, BK: tl.constexpr, SIGNS: tl.constexpr, ROUND: tl.constexpr):
    """Hadamard of each 16-block of the rows of x [BR, BK] (of input dtype ``ROUND``): * sign/4,
    4 butterflies (see hadamard.py)."""
    M: tl.constexpr = BR * BK // 16
    v = tl.reshape(x, (M, 16))
    j = tl.arange(0, 16)
    quarter = 0.25 - 0.5 * ((SIGNS >> j) & 1).to(tl.float32)
    v = times_quarter(v, quarter[None, :], ROUND)
    for _ in tl.static_range(4):
        a, b = tl.split(tl.reshape(v, (M, 8, 2)))
        v = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (M, 16))
    return tl.reshape(v, (BR, BK))


@triton.jit
def _load_blocks(
    x_ptr, row0, rows, n_rows, k0, K,
    BR: tl.constexpr, NB: tl.constexpr, HADAMARD: tl.constexpr, ROUND: tl.constexpr, SIGNS: tl.constexpr,
):  # fmt: skip
    """Rows ``row0 + rows`` ([BR]), columns ``k0 .. k0 + 16·NB`` of x as fp32 ``[BR, NB, 16]`` (0 outside)."""
    j = tl.arange(0, 16)
    cols = (k0 + 16 * tl.arange(0, NB))[None, :, None] + j[None, None, :]
    r = rows[:, None, None]
    ptrs = x_ptr + (row0 + r).to(tl.int64) * K + cols
    x = widen(tl.load(ptrs, mask=(r < n_rows) & (cols < K), other=0), ROUND)
    if HADAMARD:
        M: tl.constexpr = BR * NB
        x = tl.reshape(
            round_to(_rht16(tl.reshape(x, (M, 16)), M, 16, SIGNS, ROUND), ROUND), (BR, NB, 16)
        )
    return x


@triton.jit
def _abs_bits(x, ROUND: tl.constexpr):
    """|x| as the int32 bits of an fp32 (order-preserving for non-negative floats), NaN -> 0, and a NaN mask."""
    if ROUND == 1:
        b = (x.to(tl.int32) & 0x7FFF) << 16
    elif ROUND == 2:
        b = x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF
    else:
        b = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    nan = b > 0x7F800000
    return tl.where(nan, 0, b), nan


@fast_launch
@triton.jit
def _amax_flat_kernel(
    x_ptr, amax_ptr, n_per_group, CHUNK,
    PROPAGATE_NAN: tl.constexpr, ROUND: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """amax of elements ``[pid·CHUNK, (pid+1)·CHUNK)`` of group ``program_id(1)`` (a contiguous run of
    ``n_per_group`` elements): integer max of the fp32 bits, one ``atomic_max`` into ``amax_ptr[2g]``
    (zeroed by the caller); ``amax_ptr[2g+1]`` flags a NaN when ``PROPAGATE_NAN``."""
    pid, g = tl.program_id(0), tl.program_id(1)
    base = x_ptr + g.to(tl.int64) * n_per_group
    start = pid.to(tl.int64) * CHUNK
    m = tl.zeros((BLOCK,), tl.int32)
    has_nan = tl.zeros((BLOCK,), tl.int32)
    for i in range(0, CHUNK, BLOCK):
        offs = start + i + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < n_per_group, other=0)
        b, nan = _abs_bits(x, ROUND)
        m = tl.maximum(m, b)
        has_nan = has_nan | nan.to(tl.int32)
    tl.atomic_max(amax_ptr + 2 * g, tl.max(m, axis=0))
    if PROPAGATE_NAN:
        tl.atomic_max(amax_ptr + 2 * g + 1, tl.max(has_nan, axis=0))


@fast_launch
@triton.jit
def _amax_tiled_kernel(
    x_ptr, amax_ptr, rows_per_group, K, KP,
    PROPAGATE_NAN: tl.constexpr, HADAMARD: tl.constexpr, ROUND: tl.constexpr, SIGNS: tl.constexpr,
    BR: tl.constexpr, NB: tl.constexpr,
):  # fmt: skip
    """As :func:`_amax_flat_kernel` for ``BR`` rows of group ``program_id(1)``, through the Hadamard
    transform (which needs whole 16-blocks of rows)."""
    pid, g = tl.program_id(0), tl.program_id(1)
    rows = pid * BR + tl.arange(0, BR)
    row0 = g.to(tl.int64) * rows_per_group
    m = tl.zeros((BR, NB), tl.float32)
    has_nan = tl.zeros((BR, NB), tl.int32)
    for k0 in range(0, KP, 16 * NB):
        x = _load_blocks(x_ptr, row0, rows, rows_per_group, k0, K, BR, NB, HADAMARD, ROUND, SIGNS)
        a = tl.abs(x)
        nan = a != a
        m = tl.maximum(m, tl.max(tl.where(nan, 0.0, a), axis=2))
        has_nan = has_nan | tl.max(nan.to(tl.int32), axis=2)
    publish_amax(amax_ptr + 2 * g, m, has_nan, PROPAGATE_NAN)


@fast_launch
@triton.jit
def _amax_pairs_kernel(
    x_ptr, amax_ptr, rows_per_group, KP,
    PROPAGATE_NAN: tl.constexpr, SIGNS: tl.constexpr, BR: tl.constexpr, NB: tl.constexpr,
):  # fmt: skip
    """:func:`_amax_tiled_kernel` with Hadamard on the bf16 fast path's layout (``x_ptr`` an int32 view of
    bf16 pairs, ``K == KP``): whole blocks per thread, the transform in registers (:func:`_rht16_pairs`).
    The bf16 rounding is applied to each block's max (:func:`_rht_amax_finish`), so the amax is the
    general path's to the bit."""
    pid, g = tl.program_id(0), tl.program_id(1)
    rows = pid * BR + tl.arange(0, BR)
    rmask = rows < rows_per_group
    grow = g.to(tl.int64) * rows_per_group + rows
    j4 = tl.arange(0, 4)
    m = tl.zeros((NB, BR), tl.float32)
    has_nan = tl.zeros((NB, BR), tl.float32)
    for k0 in range(0, KP, 16 * NB):
        cb = k0 // 16 + tl.arange(0, NB)
        off = grow[None, :, None] * (KP // 2) + (cb[:, None, None] * 8 + j4[None, None, :])
        m3 = ((cb[:, None] < KP // 16) & rmask[None, :])[:, :, None]
        a0, b0, a1, b1 = _load_pairs(x_ptr, off, m3, NB, BR, True, SIGNS, True)
        m = tl.maximum(m, _rht_amax_finish(_amax4(a0, b0, a1, b1, True)))  # NaN-free
        if PROPAGATE_NAN:  # the NaN-propagating block max: NaN iff the block holds one
            n = _amax4(a0, b0, a1, b1, False)
            has_nan = tl.maximum(has_nan, tl.where(n != n, 1.0, 0.0))
    publish_amax(amax_ptr + 2 * g, m, has_nan, PROPAGATE_NAN)


@triton.jit
def _apply_factor(x, f, PROFILE: tl.constexpr):
    """x [BR, NB, W] by the block factor f [BR, NB]: ``x * f`` (te, torchao) or ``x / f``."""
    if PROFILE <= 1:
        return x * f[:, :, None]
    return tl.math.div_rn(x, f[:, :, None])


@triton.jit
def _scaled(x3, sval, enc, dec, one, PROFILE: tl.constexpr):
    """The values rounded to E2M1, per profile (see reference.scaled_values)."""
    return _apply_factor(x3, block_factor(sval, enc, dec, one, PROFILE), PROFILE)


@triton.jit
def _widen_pairs(w):
    """int32 words holding two bf16 (element 2j in the low half) -> (even, odd) elements as fp32 (exact)."""
    return (w << 16).to(tl.float32, bitcast=True), (w & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _split4(v, D0: tl.constexpr, D1: tl.constexpr):
    """``[D0, D1, 4]`` (the 4 in one thread) -> its four ``[D0, D1]`` slices ``v[..., 0..3]`` (register
    renames: no data moves)."""
    p, q = tl.split(tl.reshape(v, (D0, D1, 2, 2)))  # entries {0, 2} and {1, 3}
    v0, v2 = tl.split(p)
    v1, v3 = tl.split(q)
    return v0, v1, v2, v3


@triton.jit
def _join4(v0, v1, v2, v3, D0: tl.constexpr, D1: tl.constexpr):
    """The inverse of :func:`_split4`."""
    return tl.reshape(tl.join(tl.join(v0, v2), tl.join(v1, v3)), (D0, D1, 4))


@triton.jit
def _rht16_pairs(a0, b0, a1, b1, NB: tl.constexpr, BR: tl.constexpr, SIGNS: tl.constexpr,
                 RAW: tl.constexpr):  # fmt: skip
    """Hadamard of whole 16-blocks held in one thread as the fast path's four ``[NB, BR, 4]`` pieces (any
    two leading dims; elements ``2j``, ``2j+1``, ``8+2j``, ``9+2j``, j < 4), returned in the same
    arrangement: the same fp32 operations in the same order as :func:`_rht16` / hadamard.py (* sign/4,
    four butterfly stages) as register arithmetic on 16 ``[NB, BR]`` values, then rounded to bf16 like
    the general path (``round_to(., 1)``). ``RAW``: stop after the butterflies, for amaxes only
    (:func:`_rht_amax_finish` rounds a block max instead)."""
    x0, x2, x4, x6 = _split4(a0, NB, BR)
    x1, x3, x5, x7 = _split4(b0, NB, BR)
    x8, x10, x12, x14 = _split4(a1, NB, BR)
    x9, x11, x13, x15 = _split4(b1, NB, BR)
    v = (
        quarter(x0, SIGNS, 0, 1), quarter(x1, SIGNS, 1, 1), quarter(x2, SIGNS, 2, 1),
        quarter(x3, SIGNS, 3, 1), quarter(x4, SIGNS, 4, 1), quarter(x5, SIGNS, 5, 1),
        quarter(x6, SIGNS, 6, 1), quarter(x7, SIGNS, 7, 1), quarter(x8, SIGNS, 8, 1),
        quarter(x9, SIGNS, 9, 1), quarter(x10, SIGNS, 10, 1), quarter(x11, SIGNS, 11, 1),
        quarter(x12, SIGNS, 12, 1), quarter(x13, SIGNS, 13, 1), quarter(x14, SIGNS, 14, 1),
        quarter(x15, SIGNS, 15, 1),
    )  # fmt: skip
    for _ in tl.static_range(4):
        v = bfly16(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7],
                    v[8], v[9], v[10], v[11], v[12], v[13], v[14], v[15])  # fmt: skip
    a0 = _join4(v[0], v[2], v[4], v[6], NB, BR)
    b0 = _join4(v[1], v[3], v[5], v[7], NB, BR)
    a1 = _join4(v[8], v[10], v[12], v[14], NB, BR)
    b1 = _join4(v[9], v[11], v[13], v[15], NB, BR)
    if not RAW:
        a0 = _bf16_rne_fast(a0)
        b0 = _bf16_rne_fast(b0)
        a1 = _bf16_rne_fast(a1)
        b1 = _bf16_rne_fast(b1)
    return a0, b0, a1, b1


@triton.jit
def _rht_amax_finish(m):
    """The block amax of the transformed values from the max ``m`` of the raw butterfly outputs
    (``RAW``): ``rne_bf16(m)``. The bf16 RNE is monotone and odd, so ``max |rne(s)| = rne(max |s|)`` to
    the bit, NaN staying NaN (ignored or propagated as before); one rounding per block instead of per
    element."""
    return _bf16_rne_fast(m)


@triton.jit
def _load_pairs(x_ptr, off, m3, NB: tl.constexpr, BR: tl.constexpr, HADAMARD: tl.constexpr,
                SIGNS: tl.constexpr, RAW: tl.constexpr):  # fmt: skip
    """Whole bf16 16-blocks from the int32 words at ``off`` (``[NB, BR, 4]``: elements 0..7) and ``off + 4``
    (8..15), widened to fp32 as ``(a0, b0, a1, b1)`` (elements ``2j``, ``2j+1``, ``8+2j``, ``9+2j``),
    Hadamard-rotated if asked (:func:`_rht16_pairs`, ``RAW`` as there); 0 where ``m3`` is false."""
    a0, b0 = _widen_pairs(tl.load(x_ptr + off, mask=m3, other=0))
    a1, b1 = _widen_pairs(tl.load(x_ptr + off + 4, mask=m3, other=0))
    if HADAMARD:
        a0, b0, a1, b1 = _rht16_pairs(a0, b0, a1, b1, NB, BR, SIGNS, RAW)
    return a0, b0, a1, b1


@triton.jit
def _amax4(a0, b0, a1, b1, IGNORE_NAN: tl.constexpr):
    """Block amax [BR, NB] of a block held as four [BR, NB, 4] pieces (all in one thread), NaN ignored
    (te) or propagated, as :func:`_block_amax`."""
    if INTERPRETED:
        nan = (a0 != a0) | (b0 != b0) | (a1 != a1) | (b1 != b1)
        m = tl.maximum(
            tl.maximum(tl.where(a0 != a0, 0.0, tl.abs(a0)), tl.where(b0 != b0, 0.0, tl.abs(b0))),
            tl.maximum(tl.where(a1 != a1, 0.0, tl.abs(a1)), tl.where(b1 != b1, 0.0, tl.abs(b1))),
        )
        b = tl.max(m, axis=2)
        if not IGNORE_NAN:
            b = tl.where(tl.max(nan.to(tl.int32), axis=2) > 0, float("nan"), b)
    elif IGNORE_NAN:
        m = tl.maximum(tl.maximum(tl.abs(a0), tl.abs(b0)), tl.maximum(tl.abs(a1), tl.abs(b1)))
        b = tl.max(m, axis=2)
        b = tl.where(b != b, 0.0, b)  # an all-NaN block
    else:
        m = max_nan(max_nan(tl.abs(a0), tl.abs(b0)), max_nan(tl.abs(a1), tl.abs(b1)))
        b = tl.reduce(m, 2, max_nan)
    return b


@triton.jit
def _tile16_amax(b, BR: tl.constexpr, NB: tl.constexpr, PROFILE: tl.constexpr):
    """Block amaxes [BR, NB] -> the amax of each 16x16 tile, repeated on its 16 rows."""
    t = tl.reshape(b, (BR // 16, 16, NB))
    tb = tl.max(tl.where(t != t, 0.0, t), axis=1)
    if PROFILE != 0:
        tb = tl.where(tl.max((t != t).to(tl.int32), axis=1) > 0, float("nan"), tb)
    return tl.reshape(tl.broadcast_to(tb[:, None, :], (BR // 16, 16, NB)), (BR, NB))


@triton.jit
def _tile16_amax_t(b, BR: tl.constexpr, NB: tl.constexpr, PROFILE: tl.constexpr):
    """As :func:`_tile16_amax` on transposed block amaxes [NB, BR]."""
    t = tl.reshape(b, (NB, BR // 16, 16))
    tb = tl.max(tl.where(t != t, 0.0, t), axis=2)
    if PROFILE != 0:
        tb = tl.where(tl.max((t != t).to(tl.int32), axis=2) > 0, float("nan"), tb)
    return tl.reshape(tl.broadcast_to(tb[:, :, None], (NB, BR // 16, 16)), (NB, BR))


@triton.jit
def _pack8(qa, qb):
    """E2M1 codes of elements (2j, 2j+1), j < 4, as [BR, NB, 4] -> the 4 packed bytes as one int32 word."""
    sh = 8 * tl.arange(0, 4)
    return tl.sum((qa | (qb << 4)) << sh[None, None, :], axis=2)


@triton.jit
def _e2m1_of(x, f, u24, PROFILE: tl.constexpr, STOCHASTIC: tl.constexpr, SIGNBIT: tl.constexpr):
    """E2M1 code of the scaled value of x [NB, BR, 4] (block factor f [NB, BR]). te (a finite positive
    multiplier, sign-bit rule, so v is NaN iff x is): ``|v| = |x|·f`` in one multiply and the sign read
    off x's bits, where ``bits <= 0xFF800000`` (signed) is "negative and not NaN" in one compare. Other
    profiles: the generic path."""
    if PROFILE == 0:
        ab = (tl.abs(x) * f[:, :, None]).to(tl.int32, bitcast=True)
        neg = x.to(tl.int32, bitcast=True) <= -8388608
        return e2m1_abs_code(ab, neg, u24, STOCHASTIC)
    return e2m1_code(_apply_factor(x, f, PROFILE), u24, STOCHASTIC, SIGNBIT)


@triton.jit
def _quantize_pairs_step(
    x_ptr, data_ptr, scale_ptr, exp_ptr, grow, rmask, k0, KP, enc, dec, one, r6, keyu,
    PROFILE: tl.constexpr, TILE16: tl.constexpr, STOCHASTIC: tl.constexpr, SIGNBIT: tl.constexpr,
    EXPANDED: tl.constexpr, BR: tl.constexpr, NB: tl.constexpr, HADAMARD: tl.constexpr = False,
    SIGNS: tl.constexpr = 0,
):  # fmt: skip
    """One ``[BR, 16·NB]`` chunk of the bf16 fast path (``K == KP``). Every thread holds
    whole 16-blocks as int32 words of bf16 pairs (two 16-byte loads), so the block amax, the block scale
    and its reciprocal are computed once per block and thread, widening is one op per element, the
    Hadamard transform (``HADAMARD``) is register arithmetic, and a block's 8 code bytes leave as one
    8-byte store. Tiles are ``[NB, BR, 4]`` (blocks first: Triton
    orders threads along the first of equally contiguous dims, so a warp's lanes walk along a row and
    the scale bytes need no layout change); ``enc``/``dec``/``one``/``r6`` are ``[1, BR]``."""
    cb = k0 // 16 + tl.arange(0, NB)  # block columns [NB]
    j4 = tl.arange(0, 4)
    bmask = (cb[:, None] < KP // 16) & rmask[None, :]  # [NB, BR]
    m3 = bmask[:, :, None]
    off = grow[None, :, None] * (KP // 2) + (cb[:, None, None] * 8 + j4[None, None, :])  # int32 words
    a0, b0, a1, b1 = _load_pairs(x_ptr, off, m3, NB, BR, HADAMARD, SIGNS, False)
    b = _amax4(a0, b0, a1, b1, PROFILE == 0)
    if TILE16:
        b = _tile16_amax_t(b, BR, NB, PROFILE)
    code, sval = block_scale(b, enc, dec, one, r6, PROFILE)
    f = block_factor(sval, enc, dec, one, PROFILE)
    if STOCHASTIC:  # the stream index mod 2^32: row base (per row) + column
        c0 = (grow * KP).to(tl.uint32)[None, :, None] + (
            cb[:, None, None] * 16 + 2 * j4[None, None, :]
        ).to(tl.uint32)
        ua0 = fmix32(c0 ^ keyu) >> 8
        ub0 = fmix32((c0 + 1) ^ keyu) >> 8
        ua1 = fmix32((c0 + 8) ^ keyu) >> 8
        ub1 = fmix32((c0 + 9) ^ keyu) >> 8
    else:
        ua0 = 0
        ub0 = 0
        ua1 = 0
        ub1 = 0
    qa0 = _e2m1_of(a0, f, ua0, PROFILE, STOCHASTIC, SIGNBIT)
    qb0 = _e2m1_of(b0, f, ub0, PROFILE, STOCHASTIC, SIGNBIT)
    qa1 = _e2m1_of(a1, f, ua1, PROFILE, STOCHASTIC, SIGNBIT)
    qb1 = _e2m1_of(b1, f, ub1, PROFILE, STOCHASTIC, SIGNBIT)
    packed = tl.join(_pack8(qa0, qb0), _pack8(qa1, qb1))  # [NB, BR, 2] int32: the block's 8 bytes
    j2 = tl.arange(0, 2)
    tl.store(data_ptr + grow[None, :, None] * (KP // 8) + (cb[:, None, None] * 2 + j2[None, None, :]),
             packed, mask=m3)  # fmt: skip
    tl.store(scale_ptr + grow[None, :] * (KP // 16) + cb[:, None], code.to(tl.uint8), mask=bmask)
    if EXPANDED != 0:
        tl.store(exp_ptr + off, expanded_word(qa0, qb0, sval[:, :, None], EXPANDED), mask=m3)
        tl.store(exp_ptr + off + 4, expanded_word(qa1, qb1, sval[:, :, None], EXPANDED), mask=m3)


@fast_launch
@triton.jit(do_not_specialize=["key", "enc_arg", "dec_arg", "amax_arg"])
def _quantize_kernel(
    x_ptr, data_ptr, scale_ptr, exp_ptr, enc_ptr, dec_ptr, amax_ptr, group_amax_ptr,
    enc_arg, dec_arg, amax_arg,
    N, K, KP, rows_per_outer, key,
    PROFILE: tl.constexpr, OUTER: tl.constexpr, TILE16: tl.constexpr, HADAMARD: tl.constexpr,
    ROUND: tl.constexpr, STOCHASTIC: tl.constexpr, SIGNBIT: tl.constexpr, SIGNS: tl.constexpr,
    WRITE_AMAX: tl.constexpr, EXPANDED: tl.constexpr, BR: tl.constexpr, NB: tl.constexpr,
    PAIRS: tl.constexpr = False, SEED_PTR: tl.constexpr = False, NONFINITE: tl.constexpr = False,
):  # fmt: skip
    """Quantize rows ``[pid·BR, pid·BR + BR)`` of slice ``program_id(1)`` (16x16 tiles never cross slices).

    ``EXPANDED``: 0 none, 1 also write the exact ``q·s`` as bf16 (int16 bits), 2 as fp16, to ``exp_ptr``
    ``[rows, KP]``. ``PAIRS``: the bf16 fast path (``K == KP``, Hadamard or not), where ``x_ptr``, ``data_ptr``
    and ``exp_ptr`` are int32 views (see :func:`_quantize_pairs_step`). ``NONFINITE`` (:func:`rows_plan`'s
    ``nonfinite``): per-tensor outer scale (the amax pass run with its NaN flag): the stored decode scale is
    NaN when the amax pass saw a NaN or its amax is +Inf; per-row: a row's stored decode scale is NaN when
    its sweep saw a NaN (a NaN-propagating max beside the amax, which ignores NaN but for compressed-tensors)
    or its amax is +Inf."""
    BK: tl.constexpr = 16 * NB
    pid, s = tl.program_id(0), tl.program_id(1)
    rows = pid * BR + tl.arange(0, BR)
    row0 = s.to(tl.int64) * N  # first row of this slice
    grow = row0 + rows  # global row index [BR]
    rmask = rows < N
    one = tl.full((BR, 1), 1.0, tl.float32)
    if OUTER == 2:  # per row, computed here: sweep K once for the row amax
        m = tl.zeros((BR, NB), tl.float32)
        seen = tl.zeros((BR, NB), tl.float32)  # NONFINITE, amax ignoring NaN: the NaN-propagating max
        for k0 in range(0, KP, BK):
            if PAIRS:
                cb = k0 // 16 + tl.arange(0, NB)
                off = grow[:, None, None] * (KP // 2) + (
                    cb[None, :, None] * 8 + tl.arange(0, 4)[None, None, :]
                )
                m3 = (rmask[:, None] & (cb[None, :] < KP // 16))[:, :, None]
                a0, b0, a1, b1 = _load_pairs(x_ptr, off, m3, BR, NB, HADAMARD, SIGNS, True)
                bm = _amax4(a0, b0, a1, b1, PROFILE != 3)
                if NONFINITE and PROFILE != 3:
                    seen = max_nan(seen, _amax4(a0, b0, a1, b1, False))
                if HADAMARD:  # the bf16 rounding on the block max, not every element
                    bm = _rht_amax_finish(bm)
                m = max_nan(m, bm)
            else:
                x = _load_blocks(x_ptr, row0, rows, N, k0, K, BR, NB, HADAMARD, ROUND, SIGNS)
                m = max_nan(m, _block_amax(x, PROFILE != 3))  # NaN-free unless compressed-tensors
                if NONFINITE and PROFILE != 3:
                    seen = max_nan(seen, _block_amax(x, False))
        amax = tl.reduce(m, 1, max_nan)
        enc, dec = outer_from_row_amax(amax[:, None], PROFILE)
        tl.store(amax_ptr + grow, amax, mask=rmask)
        if NONFINITE:  # the layers' non-finite rule, per row, on the stored decode scale only (rows_plan)
            if PROFILE != 3:
                seen_row = tl.reduce(seen, 1, max_nan)
            else:
                seen_row = amax
            bad = (seen_row != seen_row) | (amax == float("inf"))
            store_outer(enc_ptr, dec_ptr, grow, enc, tl.where(bad[:, None], float("nan"), dec), rmask, BR)
        else:
            store_outer(enc_ptr, dec_ptr, grow, enc, dec, rmask, BR)
    elif OUTER == 1:  # per group (tensor or expert) from the reduced amax bits
        e = grow // rows_per_outer
        amax = reduced_amax(group_amax_ptr, e, rmask, PROFILE)
        enc, dec = outer_from_row_amax(amax[:, None], PROFILE)
        first = rmask & (grow % rows_per_outer == 0)  # the group's first row reports its scales
        tl.store(amax_ptr + e, amax, mask=first)
        if NONFINITE:  # the layers' non-finite rule on the stored decode scale only (module doc of rows_plan)
            flag = tl.load(group_amax_ptr + 2 * e + 1, mask=first, other=0)  # read where it is stored
            bad = (flag > 0) | (amax == float("inf"))
            store_outer(enc_ptr, dec_ptr, e, enc, tl.where(bad[:, None], float("nan"), dec), first, BR)
        else:
            store_outer(enc_ptr, dec_ptr, e, enc, dec, first, BR)
    else:  # given as arguments (static / checkpoint / none)
        enc = one * enc_arg
        dec = one * dec_arg
        first = rmask & (grow == 0)
        store_outer(enc_ptr, dec_ptr, rows * 0, enc, dec, first, BR)
        if WRITE_AMAX:
            tl.store(amax_ptr + rows * 0, tl.zeros((BR,), tl.float32) + amax_arg, mask=first)
    r6 = tl.math.div_rn(one, one * 6.0)  # RN(1/6)
    if STOCHASTIC:
        keyu = stream_key(key, SEED_PTR)
    else:
        keyu = 0
    if PAIRS:  # the fast path's tiles are [NB, BR, 4]: per-row scalars as [1, BR]
        encT = tl.reshape(enc, (1, BR))
        decT = tl.reshape(dec, (1, BR))
        oneT = tl.reshape(one, (1, BR))
        r6T = tl.reshape(r6, (1, BR))
    else:
        encT = enc
        decT = dec
        oneT = one
        r6T = r6
    for k0 in range(0, KP, BK):
        if PAIRS:
            _quantize_pairs_step(
                x_ptr, data_ptr, scale_ptr, exp_ptr, grow, rmask, k0, KP, encT, decT, oneT, r6T, keyu,
                PROFILE, TILE16, STOCHASTIC, SIGNBIT, EXPANDED, BR, NB, HADAMARD, SIGNS,
            )  # fmt: skip
        else:
            _quantize_step(
                x_ptr, data_ptr, scale_ptr, exp_ptr, row0, rows, grow, rmask, N, K, k0, KP, enc, dec, one, r6,
                keyu, PROFILE, TILE16, HADAMARD, ROUND, STOCHASTIC, SIGNBIT, SIGNS, EXPANDED, BR, NB,
            )  # fmt: skip


@triton.jit
def _quantize_step(
    x_ptr, data_ptr, scale_ptr, exp_ptr, row0, rows, grow, rmask, N, K, k0, KP, enc, dec, one, r6, keyu,
    PROFILE: tl.constexpr, TILE16: tl.constexpr, HADAMARD: tl.constexpr, ROUND: tl.constexpr,
    STOCHASTIC: tl.constexpr, SIGNBIT: tl.constexpr, SIGNS: tl.constexpr, EXPANDED: tl.constexpr,
    BR: tl.constexpr, NB: tl.constexpr,
):  # fmt: skip
    """One ``[BR, 16·NB]`` chunk, general path (any dtype, padding, Hadamard): ``[BR, NB, 16]`` tiles."""
    j = tl.arange(0, 16)
    if True:
        x3 = _load_blocks(x_ptr, row0, rows, N, k0, K, BR, NB, HADAMARD, ROUND, SIGNS)
        b = _block_amax(x3, PROFILE == 0)  # [BR, NB]
        if TILE16:
            b = _tile16_amax(b, BR, NB, PROFILE)
        code, sval = block_scale(b, enc, dec, one, r6, PROFILE)
        v = _scaled(x3, sval, enc, dec, one, PROFILE)
        # ---- E2M1 codes, packing, stores ----
        cb = k0 // 16 + tl.arange(0, NB)  # block columns [NB]
        if STOCHASTIC:
            idx = grow.to(tl.int64)[:, None, None] * KP + (cb[None, :, None] * 16 + j[None, None, :])
            u24 = fmix32(idx.to(tl.uint32) ^ keyu) >> 8
        else:
            u24 = 0
        q = e2m1_code(v, u24, STOCHASTIC, SIGNBIT)
        lo, hi = tl.split(tl.reshape(q, (BR, NB, 8, 2)))
        packed = (lo | (hi << 4)).to(tl.uint8)
        bmask = rmask[:, None] & (cb[None, :] < KP // 16)  # [BR, NB]
        j8 = tl.arange(0, 8)
        tl.store(
            data_ptr + grow[:, None, None] * (KP // 2) + (cb[None, :, None] * 8 + j8[None, None, :]),
            packed,
            mask=bmask[:, :, None],
        )
        tl.store(scale_ptr + grow[:, None] * (KP // 16) + cb[None, :], code.to(tl.uint8), mask=bmask)
        if EXPANDED != 0:
            y = e2m1_value(q) * sval[:, :, None]  # exact: <= 6 significant bits
            if EXPANDED == 1:  # bf16: the low 16 bits are zero, so truncating the fp32 bits is exact
                y = (y.to(tl.int32, bitcast=True) >> 16).to(tl.int16)
            else:
                y = y.to(tl.float16)
            tl.store(
                exp_ptr + grow[:, None, None] * KP + (cb[None, :, None] * 16 + j[None, None, :]),
                y,
                mask=bmask[:, :, None],
            )


#: at most this many rows count as "few" for the tile choice (decode steps, small micro-batches)
FEW_ROWS = 256


def _default_tiles(
    recipe: QuantRecipe, kp: int, pairs: bool = False, rows: int = FEW_ROWS + 1
) -> tuple[int, int, int | None]:
    """(rows, blocks, num_warps or ``None`` for Triton's default) per program. GPU, many rows: 8 rows (16 for
    16x16 tiles) × 256 columns (16 blocks), 4 warps; the bf16 fast path with 1×16 blocks 8 × 512 (32 blocks):
    the best of the H200 sweeps in bench_quantize.py (2026-11-29, two sweeps; fast path 8×512 over 8×256:
    static 61.4 vs 59.1 %, per-row 43.6 vs 40.1 %, per-tensor 37.4 vs 36.7 % of copy). Few rows
    (≤ :data:`FEW_ROWS`, 1×16 blocks): one row per program and up to 512 blocks (8192 columns) per step, 8
    warps (4 below 256 blocks), so that a decode step's handful of rows is spread over as many programs as it
    has rows and each program sweeps K in one or two steps instead of 5–19 serial steps of a mostly masked
    8-row tile (twice for the per-row scale). Tiles change the schedule, never the bytes."""
    if interpreting():  # big tiles: the interpreter's cost is per op, not per element
        return 64, min(64, next_power_of_2(kp // 16)), None
    if recipe.block == "16x16":
        return 16, min(16, next_power_of_2(kp // 16)), None
    if rows <= FEW_ROWS:
        nb = min(512, next_power_of_2(kp // 16))
        return 1, nb, 8 if nb >= 256 else 4
    return 8, min(32 if pairs else 16, next_power_of_2(kp // 16)), None


@dataclasses.dataclass(frozen=True)
class RowsPlan:
    """Everything :func:`quantize_triton` derives from the input's shape and dtype, the recipe and the tile
    options alone (tiles, grids, the outer-scale mode and its host arguments, constexprs): built once per
    signature by :func:`rows_plan`, so that a call only allocates its outputs and launches (:meth:`run`)."""

    recipe: QuantRecipe
    shape: torch.Size
    dtype: torch.dtype
    emit_expanded: torch.dtype | None
    rows: int
    lead: tuple  # shape[:-1]: the rows as the outputs hold them
    k: int
    kp: int
    n: int  # rows per slice (16x16 tiles never cross slices)
    pairs: bool
    nonfinite: bool  # the kernel applies the layers' non-finite rule (rows_plan)
    grid: tuple[int, int]
    groups: int  # 0: no amax pass (per-row or given outer scales)
    amax_kind: str  # the amax pass's kernel: "pairs", "tiled" or "flat" (:func:`_group_amax_launch`)
    amax_grid: tuple[int, int]
    amax_args: tuple
    amax_kwargs: dict
    write_amax: bool
    outer_shape: tuple
    scalar_args: tuple  # enc_arg, dec_arg, amax_arg, N, K, KP, rows_per_outer
    constexprs: dict

    def run(self, x: torch.Tensor, seed: int | torch.Tensor | None = None) -> NVFP4Tensor:
        """Quantize ``x`` (contiguous, of the planned shape and dtype; for ``pairs`` an even storage offset)."""
        dev = x.device
        group_amax = None
        if self.groups:
            group_amax = torch.zeros((self.groups, 2), dtype=torch.int32, device=dev)
            if self.amax_kind == "pairs":
                _amax_pairs_kernel[self.amax_grid](x.view(torch.int32), group_amax, *self.amax_args, **self.amax_kwargs)
            elif self.amax_kind == "tiled":
                _amax_tiled_kernel[self.amax_grid](bits_view(x), group_amax, *self.amax_args, **self.amax_kwargs)
            else:
                _amax_flat_kernel[self.amax_grid](bits_view(x), group_amax, *self.amax_args, **self.amax_kwargs)
        out = QuantOutputs.empty(self.lead, self.kp, self.outer_shape, self.write_amax, self.emit_expanded, dev)
        data, expanded, enc_t = out.data, out.expanded, out.enc
        if self.pairs:  # int32 views: bf16 pairs in, 8 code bytes (two words) and bf16/fp16 pairs out
            xa, da = x.view(torch.int32), data.view(torch.int32)
            ea = da if expanded is None else expanded.view(torch.int32)
        else:
            xa, da, ea = bits_view(x), data, data if expanded is None else bits_view(expanded)
        key = seed_arg(self.recipe, seed)
        _quantize_kernel[self.grid](
            xa, da, out.scale, ea, enc_t, out.dec, out.amax, enc_t if group_amax is None else group_amax,
            *self.scalar_args, key, **self.constexprs, SEED_PTR=isinstance(key, torch.Tensor),
        )  # fmt: skip
        return out.tensor(self.recipe, self.shape, self.dtype)


@functools.lru_cache(maxsize=1024)
def rows_plan(
    shape: torch.Size,
    dtype: torch.dtype,
    recipe: QuantRecipe,
    emit_expanded: torch.dtype | None = None,
    pairs: bool = True,
    block_rows: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    interpreted: bool = False,
    nonfinite: bool = False,
) -> RowsPlan:
    """The :class:`RowsPlan` of :func:`quantize_triton` for a contiguous input of ``shape`` and ``dtype``
    (``pairs``: the bf16 fast path is allowed, i.e. asked for and the input's storage offset is even;
    ``interpreted``: :func:`~.device.interpreting`, which picks the tiles). Pure, cached per signature.

    ``nonfinite`` (the NVFP4 layers ask for it): for a dynamic per-tensor outer scale, or a per-row one over
    1×16 blocks, the kernel applies the layers' non-finite rule itself
    (:func:`triage.kernels.linear.nan_if_nonfinite`: a NaN decode scale when the input, per row for per-row
    scales, or with the Hadamard transform its rotation, holds a NaN or ±Inf), from the amax pass or sweep it
    runs anyway, so the layer skips the rule's two torch ops; ``plan.nonfinite`` says whether it does (other
    outer scales: no, the layer applies the rule). Codes, block scales, encode scale and amax are the same
    bytes either way; only the stored decode scale of a non-finite input differs from the plain quantizer's."""
    k = shape[-1]
    kp = (k + BLOCK - 1) // BLOCK * BLOCK
    rows = math.prod(shape) // k
    if recipe.block == "16x16":
        n = shape[-2]
        slices = rows // n
    else:
        n, slices = rows, 1
    pairs = pairs and dtype == torch.bfloat16 and k == kp
    # a tile given in part is completed from the many-rows rule (the few-rows tile is one choice, all or nothing)
    default_tile = block_rows is None and block_k is None
    br_default, nb_default, warps_default = _default_tiles(recipe, kp, pairs, n if default_tile else FEW_ROWS + 1)
    br = block_rows or br_default
    nb = block_k // 16 if block_k else nb_default
    if num_warps is None and default_tile:
        num_warps = warps_default
    if recipe.block == "16x16" and br % 16:
        raise ValueError(f"block_rows must be a multiple of 16 for 16x16 tiles, got {br}")
    gshape = tuple(shape[:-1]) + (1,)
    enc_arg = dec_arg = amax_arg = 1.0
    write_amax = True
    groups, amax_kind, amax_grid, amax_args, amax_kwargs = 0, "", (0, 0), (), {}
    # per tensor: from the amax pass; per row: from the kernel's own sweep (1×16 blocks: the rule is per row)
    nonfinite = nonfinite and recipe.scale_source == "dynamic" and (
        recipe.scale == "tensor" or (recipe.scale == "row" and recipe.block == "1x16")
    )
    if recipe.scale == "row" and recipe.scale_source == "dynamic":
        mode, rows_per_outer, out_shape = OUTER_ROW, 1, gshape
    elif recipe.scale_source == "dynamic" and recipe.scale in ("tensor", "expert"):
        groups = shape[0] if recipe.scale == "expert" else 1
        amax_kind, amax_grid, amax_args, amax_kwargs = _group_amax_launch(
            recipe, dtype, rows, k, groups, kp, br, nb, pairs, interpreted
        )
        if amax_kind != "flat" and num_warps is not None:  # the Hadamard amax passes run the quantizer's tile
            amax_kwargs = dict(amax_kwargs, num_warps=num_warps)
        if nonfinite:  # the NaN flag: read by the kernel's non-finite rule (reduced_amax ignores it but for CT)
            amax_kwargs = dict(amax_kwargs, PROPAGATE_NAN=True)
        mode, rows_per_outer = OUTER_GROUP, rows // groups
        out_shape = (groups,) + (1,) * (len(shape) - 1) if recipe.scale == "expert" else ()
    else:
        enc_arg, dec_arg, amax_arg, write_amax = given_outer_args(recipe)
        mode, rows_per_outer, out_shape = OUTER_GIVEN, rows, ()
    constexprs = dict(
        PROFILE=PROFILE_ID[recipe.profile], OUTER=mode, TILE16=recipe.block == "16x16",
        HADAMARD=recipe.hadamard, ROUND=ROUND_ID[dtype], STOCHASTIC=recipe.rounding == "stochastic",
        SIGNBIT=recipe.profile in ("te", "torchao"), SIGNS=SIGN_MASK, WRITE_AMAX=write_amax,
        EXPANDED=0 if emit_expanded is None else EXPANDED_ID[emit_expanded], BR=br, NB=nb, PAIRS=pairs,
        NONFINITE=nonfinite,
    )  # fmt: skip
    if num_warps is not None:
        constexprs["num_warps"] = num_warps
    return RowsPlan(
        recipe=recipe, shape=torch.Size(shape), dtype=dtype, emit_expanded=emit_expanded, rows=rows,
        lead=tuple(shape[:-1]), k=k,
        kp=kp, n=n, pairs=pairs, nonfinite=nonfinite, grid=(cdiv(n, br), slices), groups=groups, amax_kind=amax_kind, amax_grid=amax_grid,
        amax_args=amax_args, amax_kwargs=amax_kwargs, write_amax=write_amax,
        outer_shape=out_shape, scalar_args=(enc_arg, dec_arg, amax_arg, n, k, kp, rows_per_outer),
        constexprs=constexprs,
    )  # fmt: skip


def _group_amax_launch(
    recipe: QuantRecipe,
    dtype: torch.dtype,
    rows: int,
    k: int,
    groups: int,
    kp: int,
    br: int,
    nb: int,
    pairs: bool,
    interpreted: bool,
) -> tuple[str, tuple[int, int], tuple, dict]:
    """(kernel, grid, scalar arguments, constexprs) of the amax pass that fills the int32 ``[groups, 2]``
    buffer with the bits of each group's NaN-free amax and a NaN flag (device only). Kernels: ``"pairs"``
    (:func:`_amax_pairs_kernel`) for Hadamard on an input that qualifies for the bf16 fast path (whole
    blocks per thread, the transform in registers); ``"tiled"`` (:func:`_amax_tiled_kernel`) for other
    Hadamard recipes (the transform needs whole 16-blocks of rows); ``"flat"`` (:func:`_amax_flat_kernel`)
    otherwise."""
    rows_per_group = rows // groups
    nan = recipe.profile == "compressed-tensors"
    grid = (cdiv(rows_per_group, br), groups)
    if recipe.hadamard and pairs:
        return "pairs", grid, (rows_per_group, kp), dict(PROPAGATE_NAN=nan, SIGNS=SIGN_MASK, BR=br, NB=nb)
    if recipe.hadamard:
        kwargs = dict(PROPAGATE_NAN=nan, HADAMARD=True, ROUND=ROUND_ID[dtype], SIGNS=SIGN_MASK, BR=br, NB=nb)
        return "tiled", grid, (rows_per_group, k, kp), kwargs
    n = rows_per_group * k  # padding zeros never change an amax: sweep the real elements only
    block = 1024 if interpreted else 4096
    chunk = block * max(1, min(16, cdiv(n, block * 1024)))  # ~1k programs, one atomic each
    kwargs = dict(PROPAGATE_NAN=nan, ROUND=ROUND_ID[dtype], BLOCK=block, num_warps=4 if interpreted else 8)
    return "flat", (cdiv(n, chunk), groups), (n, chunk), kwargs


def quantize_triton(
    x: torch.Tensor,
    recipe: QuantRecipe,
    seed: int | torch.Tensor | None = None,
    block_rows: int | None = None,
    block_k: int | None = None,
    emit_expanded: torch.dtype | None = None,
    num_warps: int | None = None,
    pairs: bool = True,
) -> NVFP4Tensor:
    """Triton twin of ``reference.quantize_reference`` (same bytes). ``block_rows``/``block_k`` (a multiple
    of 16) tune tiles. ``emit_expanded`` (bf16 or fp16): also return the exact ``q·s`` as
    ``NVFP4Tensor.expanded`` ``[..., Kp]``, written in the same pass. ``pairs``: use the bf16 fast path
    when it applies (bf16, ``K % 16 == 0``; the default); ``False`` forces the general path (for A/B
    timing and tests). Never synchronizes with the host. The data-independent work is cached per signature
    (:func:`rows_plan`)."""
    check_runnable(x)
    if emit_expanded is not None and emit_expanded not in EXPANDED_ID:
        raise ValueError(f"emit_expanded must be torch.bfloat16 or torch.float16, got {emit_expanded}")
    x = x.contiguous()
    plan = rows_plan(
        x.shape, x.dtype, recipe, emit_expanded, pairs and x.storage_offset() % 2 == 0, block_rows, block_k,
        num_warps, interpreting(),
    )  # fmt: skip
    return plan.run(x, seed)
