"""Triton NVFP4 quantize / dequantize kernels, bit-identical to ``reference.py`` for every profile.

One program quantizes ``BR`` rows (a multiple of 16 for 16x16 tiles) across all of K, in ``BK``-wide chunks:
load -> (Hadamard, rounded to the input dtype) -> block amax -> E4M3 block scale -> scaled values -> E2M1
codes (nearest or stochastic) -> packed bytes. Outer scale:

* ``"row"`` (dynamic): one pass; the program first sweeps its rows for the row amax, then quantizes (the
  second read mostly hits L2);
* ``"tensor"`` / ``"expert"`` (dynamic): two passes, a partial-amax kernel then the quantize kernel, with the
  outer scales computed from the amax by the same torch code as the reference;
* static / checkpoint / none: one pass.

Exactness rules (Triton fp32 ``/`` is approximate, see docs): every division is ``tl.math.div_rn``; products
feeding an add are exact (signs, powers of two) so FMA contraction cannot change a result; the E4M3 cast and
the bf16 rounding are done with integer arithmetic (the interpreter's casts truncate, the GPU's round; the
integer path is right on both).
"""

from __future__ import annotations

import os

import torch

from .format import BLOCK
from .recipe import QuantRecipe
from .reference import OuterScale, _outer_from_amax, outer_scale_from_recipe
from .rng import seed_key
from .tensor import NVFP4Tensor

try:  # triton is a hard dependency, but keep the torch reference importable without it
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover
    HAVE_TRITON = False

__all__ = ["available", "dequantize_triton", "quantize_triton"]

PROFILE_ID = {"te": 0, "torchao": 1, "modelopt": 2, "compressed-tensors": 3}
# TE_SIGNS as a bit mask of the negative positions: 3, 5, 6, 7, 8, 9, 10, 12, 14, 15
SIGN_MASK = sum(1 << j for j in (3, 5, 6, 7, 8, 9, 10, 12, 14, 15))
OUTER_SCALAR, OUTER_EXPERT, OUTER_ROW = 0, 1, 2


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(device: torch.device) -> bool:
    """Whether ``backend="auto"`` should use Triton for tensors on ``device`` (CUDA only)."""
    return HAVE_TRITON and torch.device(device).type == "cuda" and not interpreting()


def _check_runnable(t: torch.Tensor) -> None:
    if not HAVE_TRITON:
        raise RuntimeError("backend='triton' needs the triton package")
    if t.device.type != "cuda" and not interpreting():
        raise RuntimeError(
            f"backend='triton' got a tensor on {t.device}; Triton runs on CUDA, or on CPU under "
            "TRITON_INTERPRET=1 (set before triton is imported)"
        )


if HAVE_TRITON:

    @triton.jit
    def _bf16_rne(x):
        """fp32 -> the nearest-even bf16 value (as fp32), NaN kept."""
        bits = x.to(tl.uint32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, r.to(tl.float32, bitcast=True))

    @triton.jit
    def _round_to(x, ROUND: tl.constexpr):
        """Round fp32 to the input dtype (0: fp32 as is, 1: bf16, 2: fp16), back as fp32."""
        if ROUND == 1:
            x = _bf16_rne(x)
        elif ROUND == 2:
            x = x.to(tl.float16).to(tl.float32)
        return x

    @triton.jit
    def _rht16(x, BR: tl.constexpr, BK: tl.constexpr, SIGNS: tl.constexpr):
        """Hadamard of each 16-block of the rows of x [BR, BK]: signs, 4 butterflies, * 0.25 (see hadamard.py)."""
        M: tl.constexpr = BR * BK // 16
        v = tl.reshape(x, (M, 16))
        j = tl.arange(0, 16)
        sign = 1.0 - 2.0 * ((SIGNS >> j) & 1).to(tl.float32)
        v = v * sign[None, :]
        for _ in tl.static_range(4):
            a, b = tl.split(tl.reshape(v, (M, 8, 2)))
            v = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (M, 16))
        return tl.reshape(v * 0.25, (BR, BK))

    @triton.jit
    def _e4m3_code(s):
        """fp32 s >= 0 (or NaN) -> E4M3 code (int32): round to nearest even, > 448 -> 448, NaN -> 0x7F."""
        nan = s != s
        s = tl.where(nan, 0.0, s)
        s = tl.where(s > 448.0, 448.0, s)
        sub = ((s * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)  # RNE(s / 2^-9), exact for s < 2^-6
        bits = s.to(tl.int32, bitcast=True)
        nrm = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - 960  # rebias 127 -> 7, keep 3 mantissa bits
        code = tl.where(s < 0.015625, sub, nrm)
        return tl.where(nan, 0x7F, code)

    @triton.jit
    def _e4m3_value(code):
        """E4M3 code (int32) -> fp32 value (exact); 0x7F -> NaN."""
        sub = code.to(tl.float32) * 0.001953125
        nb = (((code >> 3) + 120) << 23) | ((code & 7) << 20)
        val = tl.where(code < 8, sub, nb.to(tl.float32, bitcast=True))
        return tl.where(code == 0x7F, float("nan"), val)

    @triton.jit
    def _fmix32(h):
        h = h ^ (h >> 16)
        h = h * 0x85EBCA6B
        h = h ^ (h >> 13)
        h = h * 0xC2B2AE35
        return h ^ (h >> 16)

    @triton.jit
    def _e2m1_code(v, u24, STOCHASTIC: tl.constexpr, SIGNBIT: tl.constexpr):
        """fp32 v -> E2M1 code (int32); see format.e2m1_codes / reference.stochastic_codes."""
        a = tl.abs(v)
        if STOCHASTIC:
            lo = (
                (a >= 0.5).to(tl.int32)
                + (a >= 1.0).to(tl.int32)
                + (a >= 1.5).to(tl.int32)
                + (a >= 2.0).to(tl.int32)
                + (a >= 3.0).to(tl.int32)
                + (a >= 4.0).to(tl.int32)
                + (a >= 6.0).to(tl.int32)
            )
            lo_val = tl.where(
                lo < 4, lo.to(tl.float32) * 0.5, tl.where(lo == 7, 6.0, (lo - 2).to(tl.float32))
            )
            inv_step = tl.where(a < 2.0, 2.0, tl.where(a < 4.0, 1.0, 0.5))
            frac24 = (a - lo_val) * (inv_step * 16777216.0)
            up = (u24.to(tl.float32) < frac24) & (lo < 7)
            mag = lo + up.to(tl.int32)
        else:
            mag = (
                (a > 0.25).to(tl.int32)
                + (a >= 0.75).to(tl.int32)
                + (a > 1.25).to(tl.int32)
                + (a >= 1.75).to(tl.int32)
                + (a > 2.5).to(tl.int32)
                + (a >= 3.5).to(tl.int32)
                + (a > 5.0).to(tl.int32)
            )
        nan = v != v
        if SIGNBIT:
            neg = v.to(tl.int32, bitcast=True) < 0
        else:
            neg = v < 0.0
        mag = tl.where(nan, 7, mag)
        return mag | ((neg & (~nan)).to(tl.int32) << 3)

    @triton.jit
    def _outer_from_row_amax(a, PROFILE: tl.constexpr):
        """Per-row outer (encode, decode) from the row amax a [BR, 1]; same formulas as reference."""
        one = tl.full(a.shape, 1.0, tl.float32)
        if PROFILE == 0:
            enc = tl.minimum(tl.math.div_rn(one * 2688.0, a), 3.4028234663852886e38)
            enc = tl.where((a == 0.0) | (enc == 0.0), one, enc)
            dec = tl.math.div_rn(one, enc)
        elif PROFILE == 3:
            nan = a != a
            safe = tl.where(nan | (a < 1.1754943508222875e-38), 1.1754943508222875e-38, a)
            enc = tl.math.div_rn(one * 2688.0, safe)
            enc = tl.where(nan | (enc > 3.4028234663852886e38) | (enc <= 0.0), one, enc)
            dec = tl.math.div_rn(one, enc)
        else:
            dec = tl.math.div_rn(a, one * 2688.0)
            dec = tl.where((a <= 3.4028234663852886e38) & (dec > 0.0), dec, one)
            enc = tl.math.div_rn(one, dec)
        return enc, dec

    @triton.jit
    def _load_tile(
        x_ptr,
        row0,
        rows,
        n_rows,
        k0,
        K,
        BR: tl.constexpr,
        BK: tl.constexpr,
        HADAMARD: tl.constexpr,
        ROUND: tl.constexpr,
        SIGNS: tl.constexpr,
    ):
        cols = k0 + tl.arange(0, BK)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < K)
        x = tl.load(x_ptr + (row0 + rows[:, None]).to(tl.int64) * K + cols[None, :], mask=mask, other=0)
        if ROUND == 1:  # bf16 passed as int16 bits: widen exactly (the interpreter's bf16 cast is wrong)
            x = ((x.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        else:
            x = x.to(tl.float32)
        if HADAMARD:
            x = _round_to(_rht16(x, BR, BK, SIGNS), ROUND)
        return x

    @triton.jit
    def _amax_kernel(
        x_ptr, part_ptr, rows_per_group, K, KP,
        PROPAGATE_NAN: tl.constexpr, HADAMARD: tl.constexpr, ROUND: tl.constexpr, SIGNS: tl.constexpr,
        BR: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        """Partial amax of ``rows_per_group`` rows of group ``program_id(1)``: one value per program."""
        pid, g = tl.program_id(0), tl.program_id(1)
        rows = pid * BR + tl.arange(0, BR)
        row0 = g.to(tl.int64) * rows_per_group
        m = tl.zeros((BR, BK), tl.float32)
        has_nan = tl.zeros((BR, BK), tl.int32)
        for k0 in range(0, KP, BK):
            x = _load_tile(x_ptr, row0, rows, rows_per_group, k0, K, BR, BK, HADAMARD, ROUND, SIGNS)
            a = tl.abs(x)
            nan = a != a
            m = tl.maximum(m, tl.where(nan, 0.0, a))
            has_nan = has_nan | nan.to(tl.int32)
        out = tl.max(tl.max(m, axis=1), axis=0)
        if PROPAGATE_NAN:
            out = tl.where(tl.max(tl.max(has_nan, axis=1), axis=0) > 0, float("nan"), out)
        tl.store(part_ptr + g * tl.num_programs(0) + pid, out)

    @triton.jit(do_not_specialize=["key"])
    def _quantize_kernel(
        x_ptr, data_ptr, scale_ptr, enc_ptr, dec_ptr, amax_ptr,
        N, K, KP, rows_per_outer, key,
        PROFILE: tl.constexpr, OUTER: tl.constexpr, TILE16: tl.constexpr, HADAMARD: tl.constexpr,
        ROUND: tl.constexpr, STOCHASTIC: tl.constexpr, SIGNBIT: tl.constexpr, SIGNS: tl.constexpr,
        BR: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        NB: tl.constexpr = BK // 16
        pid, s = tl.program_id(0), tl.program_id(1)
        rows = pid * BR + tl.arange(0, BR)
        row0 = s.to(tl.int64) * N  # first row of this slice (16x16 tiles never cross slices)
        grow = row0 + rows  # global row index [BR]
        rmask = rows < N
        one = tl.full((BR, 1), 1.0, tl.float32)
        if OUTER == 2:  # per row, computed here: sweep K once for the row amax
            m = tl.zeros((BR, BK), tl.float32)
            has_nan = tl.zeros((BR, BK), tl.int32)
            for k0 in range(0, KP, BK):
                x = _load_tile(x_ptr, row0, rows, N, k0, K, BR, BK, HADAMARD, ROUND, SIGNS)
                a = tl.abs(x)
                nan = a != a
                m = tl.maximum(m, tl.where(nan, 0.0, a))
                has_nan = has_nan | nan.to(tl.int32)
            amax = tl.max(m, axis=1)
            if PROFILE == 3:
                amax = tl.where(tl.max(has_nan, axis=1) > 0, float("nan"), amax)
            enc, dec = _outer_from_row_amax(amax[:, None], PROFILE)
            tl.store(amax_ptr + grow, amax, mask=rmask)
            tl.store(enc_ptr + grow, tl.reshape(enc, (BR,)), mask=rmask)
            tl.store(dec_ptr + grow, tl.reshape(dec, (BR,)), mask=rmask)
        elif OUTER == 1:  # per expert
            e = grow // rows_per_outer
            enc = tl.load(enc_ptr + e, mask=rmask, other=1.0)[:, None]
            dec = tl.load(dec_ptr + e, mask=rmask, other=1.0)[:, None]
        else:
            enc = one * tl.load(enc_ptr)
            dec = one * tl.load(dec_ptr)
        r6 = tl.math.div_rn(one, one * 6.0)  # RN(1/6)
        if STOCHASTIC:
            keyu = key.to(tl.uint32)
        for k0 in range(0, KP, BK):
            x = _load_tile(x_ptr, row0, rows, N, k0, K, BR, BK, HADAMARD, ROUND, SIGNS)
            x3 = tl.reshape(x, (BR, NB, 16))
            a = tl.abs(x3)
            nan = a != a
            b = tl.max(tl.where(nan, 0.0, a), axis=2)  # [BR, NB]
            if PROFILE != 0:
                b = tl.where(tl.max(nan.to(tl.int32), axis=2) > 0, float("nan"), b)
            if TILE16:
                t = tl.reshape(b, (BR // 16, 16, NB))
                tb = tl.max(tl.where(t != t, 0.0, t), axis=1)
                if PROFILE != 0:
                    tb = tl.where(tl.max((t != t).to(tl.int32), axis=1) > 0, float("nan"), tb)
                b = tl.reshape(tl.broadcast_to(tb[:, None, :], (BR // 16, 16, NB)), (BR, NB))
            # ---- block scale (per profile) ----
            if PROFILE == 0:  # te
                code = _e4m3_code(b * (enc * r6))
            elif PROFILE == 1:  # torchao
                sf = tl.math.div_rn(tl.math.div_rn(b, one * 6.0), dec)
                sf = tl.where(sf < 0.015625, 0.015625, sf)
                code = _e4m3_code(sf)
            elif PROFILE == 2:  # modelopt
                p = tl.math.div_rn(b, dec * 6.0)
                p = tl.where(p == 0.0, 1.0, p)
                p = tl.where(p < 0.001953125, 0.001953125, p)
                code = _e4m3_code(p)
            else:  # compressed-tensors
                code = _e4m3_code(enc * tl.math.div_rn(b, one * 6.0))
                code = tl.where(code == 0, 0x20, code)
            sval = _e4m3_value(code)
            # ---- scaled values (per profile) ----
            if PROFILE == 0:
                mult = tl.minimum(tl.math.div_rn(one, sval * dec), 3.4028234663852886e38)
                v = x3 * mult[:, :, None]
            elif PROFILE == 1:
                v = x3 * tl.math.div_rn(tl.broadcast_to(enc, sval.shape), sval)[:, :, None]
            elif PROFILE == 2:
                v = tl.math.div_rn(x3, (sval * dec)[:, :, None])
            else:
                v = tl.math.div_rn(x3, tl.math.div_rn(sval, enc)[:, :, None])
            # ---- E2M1 codes, packing, stores ----
            if STOCHASTIC:
                idx = grow.to(tl.int64)[:, None, None] * KP + tl.reshape(k0 + tl.arange(0, BK), (1, NB, 16))
                u24 = _fmix32(idx.to(tl.uint32) ^ keyu) >> 8
            else:
                u24 = 0
            q = _e2m1_code(v, u24, STOCHASTIC, SIGNBIT)
            lo, hi = tl.split(tl.reshape(q, (BR, BK // 2, 2)))
            packed = (lo | (hi << 4)).to(tl.uint8)
            pcols = k0 // 2 + tl.arange(0, BK // 2)
            tl.store(
                data_ptr + grow[:, None] * (KP // 2) + pcols[None, :],
                packed,
                mask=rmask[:, None] & (pcols[None, :] < KP // 2),
            )
            scols = k0 // 16 + tl.arange(0, NB)
            tl.store(
                scale_ptr + grow[:, None] * (KP // 16) + scols[None, :],
                code.to(tl.uint8),
                mask=rmask[:, None] & (scols[None, :] < KP // 16),
            )

    @triton.jit
    def _dequantize_kernel(
        data_ptr, scale_ptr, gs_ptr, out_ptr, R, K, KP, rows_per_outer,
        OUTER: tl.constexpr, ROUND: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        NB: tl.constexpr = BK // 16
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        k0 = tl.program_id(1) * BK
        rmask = rows < R
        grow = rows.to(tl.int64)
        pcols = k0 // 2 + tl.arange(0, BK // 2)
        packed = tl.load(
            data_ptr + grow[:, None] * (KP // 2) + pcols[None, :],
            mask=rmask[:, None] & (pcols[None, :] < KP // 2),
            other=0,
        ).to(tl.int32)
        q = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BR, NB, 16))
        mag = q & 7
        val = tl.where(mag < 4, mag.to(tl.float32) * 0.5, tl.where(mag == 7, 6.0, (mag - 2).to(tl.float32)))
        val = tl.where((q & 8) != 0, -val, val)
        scols = k0 // 16 + tl.arange(0, NB)
        sc = tl.load(
            scale_ptr + grow[:, None] * (KP // 16) + scols[None, :],
            mask=rmask[:, None] & (scols[None, :] < KP // 16),
            other=0,
        ).to(tl.int32)
        y = val * _e4m3_value(sc)[:, :, None]
        if OUTER == 2:
            gs = tl.load(gs_ptr + grow, mask=rmask, other=1.0)[:, None, None]
        elif OUTER == 1:
            gs = tl.load(gs_ptr + grow // rows_per_outer, mask=rmask, other=1.0)[:, None, None]
        else:
            gs = tl.load(gs_ptr)
        y = tl.reshape(y * gs, (BR, BK))
        if ROUND == 1:  # bf16 output written as int16 bits of the nearest-even bf16
            y = (_bf16_rne(y).to(tl.int32, bitcast=True) >> 16).to(tl.int16)
        else:
            y = y.to(out_ptr.dtype.element_ty)
        cols = k0 + tl.arange(0, BK)
        tl.store(out_ptr + grow[:, None] * K + cols[None, :], y, mask=rmask[:, None] & (cols[None, :] < K))


ROUND_ID = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _default_tiles(recipe: QuantRecipe, kp: int) -> tuple[int, int]:
    if interpreting():  # big tiles: the interpreter's cost is per op, not per element
        return 64, min(1024, triton.next_power_of_2(kp))
    return 16, min(256, triton.next_power_of_2(kp))


def _outer_index(recipe: QuantRecipe, shape: torch.Size, rows: int) -> tuple[int, int]:
    """(OUTER mode, rows per outer scale)."""
    if recipe.scale == "row" and recipe.scale_source == "dynamic":
        return OUTER_ROW, 1
    if recipe.scale == "expert":
        return OUTER_EXPERT, rows // shape[0]
    return OUTER_SCALAR, rows


def _bits(x: torch.Tensor) -> torch.Tensor:
    """bf16 tensors travel as their int16 bits (widened exactly in the kernel)."""
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x


def _group_amax(
    x2: torch.Tensor, recipe: QuantRecipe, groups: int, kp: int, br: int, bk: int
) -> torch.Tensor:
    rows_per_group = x2.shape[0] // groups
    nprog = triton.cdiv(rows_per_group, br)
    part = torch.empty((groups, nprog), dtype=torch.float32, device=x2.device)
    _amax_kernel[(nprog, groups)](
        _bits(x2), part, rows_per_group, x2.shape[1], kp,
        PROPAGATE_NAN=recipe.profile == "compressed-tensors", HADAMARD=recipe.hadamard,
        ROUND=ROUND_ID[x2.dtype], SIGNS=SIGN_MASK, BR=br, BK=bk,
    )  # fmt: skip
    return part.amax(dim=1)  # torch.amax propagates NaN, like the reference


def quantize_triton(
    x: torch.Tensor,
    recipe: QuantRecipe,
    seed: int | None = None,
    block_rows: int | None = None,
    block_k: int | None = None,
) -> NVFP4Tensor:
    """Triton twin of ``reference.quantize_reference`` (same bytes). ``block_rows``/``block_k`` tune tiles."""
    _check_runnable(x)
    shape, dtype = x.shape, x.dtype
    x = x.contiguous()
    k = shape[-1]
    kp = (k + BLOCK - 1) // BLOCK * BLOCK
    rows = x.numel() // k
    if recipe.block == "16x16":
        n = shape[-2]
        slices = rows // n
    else:
        n, slices = rows, 1
    br_default, bk_default = _default_tiles(recipe, kp)
    br = block_rows or br_default
    bk = block_k or bk_default
    if recipe.block == "16x16" and br % 16:
        raise ValueError(f"block_rows must be a multiple of 16 for 16x16 tiles, got {br}")
    x2 = x.reshape(rows, k)
    dev = x.device
    outer_mode, rows_per_outer = _outer_index(recipe, shape, rows)
    gshape = shape[:-1] + (1,)
    amax_rows = enc_rows = dec_rows = None
    if outer_mode == OUTER_ROW:
        amax_rows = torch.empty(rows, dtype=torch.float32, device=dev)
        enc_rows = torch.empty_like(amax_rows)
        dec_rows = torch.empty_like(amax_rows)
        enc_t, dec_t, amax_t = enc_rows, dec_rows, amax_rows
    else:
        if recipe.scale_source == "dynamic" and recipe.scale in ("tensor", "expert"):
            groups = shape[0] if recipe.scale == "expert" else 1
            amax = _group_amax(x2, recipe, groups, kp, br, bk)
            amax = amax.reshape((groups,) + (1,) * (len(shape) - 1)) if recipe.scale == "expert" else amax[0]
            enc, dec = _outer_from_amax(amax, recipe.profile)
            outer = OuterScale(enc, dec, amax)
        else:
            outer = outer_scale_from_recipe(recipe, dev)
        enc_t, dec_t = outer.encode.contiguous(), outer.decode.contiguous()
        amax_t = enc_t  # unused
    data = torch.empty((rows, kp // 2), dtype=torch.uint8, device=dev)
    scale = torch.empty((rows, kp // 16), dtype=torch.uint8, device=dev)
    key = seed_key(recipe.seed if seed is None else seed)
    key = key - 2**32 if key >= 2**31 else key  # passed as int32, reinterpreted as uint32 in the kernel
    grid = (triton.cdiv(n, br), slices)
    _quantize_kernel[grid](
        _bits(x2), data, scale, enc_t, dec_t, amax_t,
        n, k, kp, rows_per_outer, key,
        PROFILE=PROFILE_ID[recipe.profile], OUTER=outer_mode, TILE16=recipe.block == "16x16",
        HADAMARD=recipe.hadamard, ROUND=ROUND_ID[dtype], STOCHASTIC=recipe.rounding == "stochastic",
        SIGNBIT=recipe.profile in ("te", "torchao"), SIGNS=SIGN_MASK, BR=br, BK=bk,
    )  # fmt: skip
    lead = shape[:-1]
    if outer_mode == OUTER_ROW:
        outer = OuterScale(enc_rows.reshape(gshape), dec_rows.reshape(gshape), amax_rows.reshape(gshape))
    return NVFP4Tensor(
        data=data.reshape(*lead, kp // 2),
        scale=scale.view(torch.float8_e4m3fn).reshape(*lead, kp // 16),
        global_scale=outer.decode,
        recipe=recipe,
        shape=shape,
        dtype=dtype,
        global_encode_scale=outer.encode,
        amax=outer.amax,
    )


def dequantize_triton(
    t: NVFP4Tensor, dtype: torch.dtype | None = None, block_rows: int = 16, block_k: int = 256
) -> torch.Tensor:
    """Triton twin of ``NVFP4Tensor.dequantize`` (same values)."""
    _check_runnable(t.data)
    out_dtype = t.dtype if dtype is None else dtype
    if out_dtype not in ROUND_ID:
        raise TypeError(f"dequantize: output dtype must be float32/bfloat16/float16, got {out_dtype}")
    k = t.shape[-1]
    kp = t.padded_k
    rows = t.data.numel() // (kp // 2)
    recipe = t.recipe
    gs = t.global_scale.float().contiguous()
    if gs.numel() == 1:
        mode, rpo = OUTER_SCALAR, rows
    elif gs.numel() == rows:
        mode, rpo = OUTER_ROW, 1
    else:
        mode, rpo = OUTER_EXPERT, rows // gs.numel()
    del recipe
    out = torch.empty((rows, k), dtype=out_dtype, device=t.data.device)
    bk = min(block_k, triton.next_power_of_2(kp))
    br = 64 if interpreting() else block_rows
    grid = (triton.cdiv(rows, br), triton.cdiv(kp, bk))
    _dequantize_kernel[grid](
        t.data.contiguous(), t.scale.view(torch.uint8).contiguous(), gs, _bits(out), rows, k, kp, rpo,
        OUTER=mode, ROUND=ROUND_ID[out_dtype], BR=br, BK=bk,
    )  # fmt: skip
    return out.reshape(t.shape)
