"""Shared pieces of the NVFP4 Triton kernels: every ``@triton.jit`` helper that more than one kernel module
calls, and the host-side rules those modules share. No kernel is launched from here.

**The interpreter rule** (one, used everywhere): :func:`interpreting` is Triton's own switch,
``triton.knobs.runtime.interpret``, i.e. ``TRITON_INTERPRET`` read as a boolean (``1``, ``true``, ``yes``,
``on``, any case). ``@triton.jit`` reads it when a kernel is decorated, so set it before the kernel modules
are imported; host code reads it at each call (tile sizes, dot dtypes, whether CPU tensors can run).
:data:`INTERPRETED` is its value at import, as the constexpr the kernels branch on: the interpreter's float
casts truncate where the GPU rounds, its max propagates NaN, it decodes e4m3 ``0x7F`` as 480 and its bf16
``tl.dot`` is wrong, so a few helpers keep a GPU path and an interpreter path (same results).

Contents, by section:

* where the kernels run (:func:`triton_runs_on`, :func:`available`, :func:`check_runnable`) and how
  arguments travel (:func:`bits_view`, :data:`ROUND_ID`, :func:`given_outer`, :func:`seed_arg`, ...);
* number formats: E2M1 / E4M3 codes and values, bf16 round-to-nearest-even by integer arithmetic, exact
  widening of loaded tiles;
* quantizer steps shared by :mod:`.quantize_rows` and :mod:`.quantize_columns` (Hadamard first step and
  butterfly, block scales, outer scales; the formulas of ``reference.py``; the amax pass, at the end);
* GEMM pieces shared by :mod:`.gemm_dense`, :mod:`.gemm_decode` and ``triage.kernels.moe.grouped_triton``
  (operand tile loader, epilogue, tile order; on the host the operand strides and the unpack
  multiplier).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from .recipe import QuantRecipe
from .reference import outer_scale_from_recipe
from .rng import GOLDEN, seed_key
from .tensor import NVFP4Tensor


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (module docstring: the one rule)."""
    return bool(triton.knobs.runtime.interpret)


#: :func:`interpreting` when the kernel modules were imported, as a constexpr for kernels
INTERPRETED = tl.constexpr(interpreting())


def triton_runs_on(device: torch.device) -> bool:
    """Whether the Triton kernels can run on tensors of ``device``: CUDA, or anything under the interpreter."""
    return torch.device(device).type == "cuda" or interpreting()


def available(device: torch.device) -> bool:
    """Whether ``backend="auto"`` should use Triton for tensors on ``device`` (CUDA only)."""
    return torch.device(device).type == "cuda" and not interpreting()


def check_runnable(t: torch.Tensor) -> None:
    """Raise unless the Triton kernels can run on ``t`` (:func:`triton_runs_on`)."""
    if not triton_runs_on(t.device):
        raise RuntimeError(
            f"backend='triton' got a tensor on {t.device}; Triton runs on CUDA, or on CPU under "
            "TRITON_INTERPRET=1 (set before triton is imported)"
        )


# ---------------------------------------------------------------------------------------------------
# Kernel arguments
# ---------------------------------------------------------------------------------------------------

#: the quantizers' ``PROFILE`` constexpr
PROFILE_ID = {"te": 0, "torchao": 1, "modelopt": 2, "compressed-tensors": 3}
#: TE_SIGNS as a bit mask of the negative positions: 3, 5, 6, 7, 8, 9, 10, 12, 14, 15
SIGN_MASK = sum(1 << j for j in (3, 5, 6, 7, 8, 9, 10, 12, 14, 15))
#: outer-scale modes of the quantize kernels: fp32 arguments / per group from a reduced amax / per row
OUTER_GIVEN, OUTER_GROUP, OUTER_ROW = 0, 1, 2
#: the ``ROUND`` constexpr: the input dtype (loads are widened from it, Hadamard outputs rounded to it)
ROUND_ID = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
#: dtypes ``emit_expanded`` can write (both hold every ``q·s`` exactly)
EXPANDED_ID = {torch.bfloat16: 1, torch.float16: 2}


def bits_view(x: torch.Tensor) -> torch.Tensor:
    """bf16 tensors travel as their int16 bits (widened exactly in the kernel: :func:`widen`)."""
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x


@functools.lru_cache(maxsize=256)
def given_outer(recipe: QuantRecipe) -> tuple[float, float, float | None]:
    """(encode, decode, amax) as Python floats (exact fp32 values) for data-independent outer scales,
    computed by the reference's own torch code on the CPU (IEEE, so the same bits as on CUDA)."""
    o = outer_scale_from_recipe(recipe, "cpu")
    return float(o.encode), float(o.decode), None if o.amax is None else float(o.amax)


def given_outer_args(recipe: QuantRecipe) -> tuple[float, float, float, bool]:
    """The quantizers' outer-scale arguments for data-independent outer scales: ``(encode, decode, amax,
    WRITE_AMAX)`` of :func:`given_outer`; a recipe without an amax passes 1.0, never written."""
    enc, dec, amax = given_outer(recipe)
    return enc, dec, 1.0 if amax is None else amax, amax is not None


@dataclasses.dataclass
class QuantOutputs:
    """The output buffers of one quantizer launch over the rows ``lead`` (their product: the kernel's rows)
    of ``length`` (a multiple of 16) elements, allocated in the shapes the :class:`NVFP4Tensor` holds (the
    kernels read only their contiguous storage): codes ``data`` uint8 [*lead, length/2], block-scale bits
    ``scale`` uint8 [*lead, length/16], the optional exact expansion ``expanded`` [*lead, length], and the
    outer scales ``enc`` / ``dec`` / ``amax`` fp32 of ``outer_shape`` (``amax`` is ``enc`` when the kernel
    does not write it)."""

    data: torch.Tensor
    scale: torch.Tensor
    expanded: torch.Tensor | None
    enc: torch.Tensor
    dec: torch.Tensor
    amax: torch.Tensor
    write_amax: bool

    @classmethod
    def empty(
        cls, lead: tuple, length: int, outer_shape: tuple, write_amax: bool, emit_expanded: torch.dtype | None, device
    ) -> QuantOutputs:
        enc = torch.empty(outer_shape, dtype=torch.float32, device=device)
        return cls(
            data=torch.empty((*lead, length // 2), dtype=torch.uint8, device=device),
            scale=torch.empty((*lead, length // 16), dtype=torch.uint8, device=device),
            expanded=None if emit_expanded is None else torch.empty((*lead, length), dtype=emit_expanded, device=device),
            enc=enc, dec=torch.empty_like(enc), amax=torch.empty_like(enc) if write_amax else enc,
            write_amax=write_amax,
        )  # fmt: skip

    def tensor(self, recipe: QuantRecipe, shape: torch.Size, dtype: torch.dtype) -> NVFP4Tensor:
        """The :class:`NVFP4Tensor` of a quantized ``shape`` (the buffers' shapes as allocated: no reshape)."""
        return NVFP4Tensor(
            data=self.data,
            scale=self.scale.view(torch.float8_e4m3fn),
            global_scale=self.dec,
            recipe=recipe,
            shape=shape,
            dtype=dtype,
            global_encode_scale=self.enc,
            amax=self.amax if self.write_amax else None,
            expanded=self.expanded,
        )


#: ``rng.GOLDEN`` as a kernel constant (:func:`stream_key`)
_GOLDEN = tl.constexpr(GOLDEN)


def seed_arg(recipe: QuantRecipe, seed: int | torch.Tensor | None) -> int | torch.Tensor:
    """The quantizers' ``key`` argument: the stochastic-rounding key of ``seed`` (default ``recipe.seed``)
    as an int32 (the kernels reinterpret it as uint32); a seed tensor (:mod:`.rng`) is passed as it is,
    with ``SEED_PTR``: the kernel computes its key (:func:`stream_key`)."""
    if isinstance(seed, torch.Tensor):
        return seed
    key = seed_key(recipe.seed if seed is None else seed)
    return key - 2**32 if key >= 2**31 else key


#: 2**14 undoes the fp16 bit trick of one packed operand (:func:`load_tile`; docs in :mod:`.gemm_dense`)
UNPACK_FACTOR = 16384.0
#: the GEMM epilogue's outer-scale modes (``GA_MODE`` / ``GB_MODE``): none, one scalar, one per row / column
SCALE_NONE, SCALE_SCALAR, SCALE_ROW = 0, 1, 2


def scale_mode(g: torch.Tensor | None) -> int:
    """The epilogue mode of an outer scale ``g``: None, 1 element, or one per row (column)."""
    if g is None:
        return SCALE_NONE
    return SCALE_SCALAR if g.numel() == 1 else SCALE_ROW


def unpack_mult(*packed: bool) -> float:
    """The epilogue's ``out_mult`` of a GEMM whose operands are packed or not (``packed``, one flag per
    operand): ``UNPACK_FACTOR ** (number of packed operands)``, undoing :func:`load_tile`'s 2⁻¹⁴ each."""
    if not all(isinstance(p, bool) for p in packed):
        raise TypeError(f"unpack_mult takes one bool per operand (packed or not), got {packed!r}")
    return UNPACK_FACTOR ** sum(packed)


def operand_strides(t: torch.Tensor, scale: torch.Tensor | None) -> tuple[int, ...]:
    """The stride arguments of one GEMM operand: ``t``'s strides, then its block scales' (zeros for a dense
    operand, ``scale`` None: the kernel never reads them)."""
    return (*t.stride(), *(scale.stride() if scale is not None else (0,) * t.dim()))


# ---------------------------------------------------------------------------------------------------
# Number formats
# ---------------------------------------------------------------------------------------------------


@triton.jit
def max_nan(a, b):
    """``max(a, b)``, NaN if either is NaN (also a ``tl.reduce`` combiner)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _rne_bits(x):
    """The fp32 bits of x plus the bf16 round-to-nearest-even increment: the nearest-even bf16 is the high
    half (one rule for :func:`bf16_rne` and :func:`to_bf16_rne`; NaN is the callers' business)."""
    bits = x.to(tl.uint32, bitcast=True)
    return bits + 0x7FFF + ((bits >> 16) & 1)


@triton.jit
def bf16_rne(x):
    """fp32 -> the nearest-even bf16 value (as fp32), NaN kept."""
    r = _rne_bits(x) & 0xFFFF0000
    return tl.where(x != x, x, r.to(tl.float32, bitcast=True))


@triton.jit
def to_bf16_rne(x):
    """fp32 → bf16, round to nearest even, NaN kept (bit arithmetic; same result as the GPU cvt)."""
    rounded = _rne_bits(x) >> 16
    out = rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return tl.where(x != x, x.to(tl.bfloat16), out)


@triton.jit
def widen(v, ROUND: tl.constexpr):
    """A loaded tile as fp32. bf16 (``ROUND == 1``) is passed as int16 bits and widened exactly (the
    interpreter's bf16 cast is wrong)."""
    if ROUND == 1:
        if INTERPRETED:
            v = ((v.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        else:
            v = v.to(tl.bfloat16, bitcast=True).to(tl.float32)
    else:
        v = v.to(tl.float32)
    return v


@triton.jit
def round_to(x, ROUND: tl.constexpr):
    """Round fp32 to the input dtype (0: fp32 as is, 1: bf16, 2: fp16), back as fp32."""
    if ROUND == 1:
        x = bf16_rne(x)
    elif ROUND == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x


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
def e4m3_value(code):
    """E4M3 code (int32) -> fp32 value (exact); 0x7F -> NaN."""
    sub = code.to(tl.float32) * 0.001953125
    nb = (((code >> 3) + 120) << 23) | ((code & 7) << 20)
    val = tl.where(code < 8, sub, nb.to(tl.float32, bitcast=True))
    return tl.where(code == 0x7F, float("nan"), val)


@triton.jit
def e4m3_nan(s, v):
    """``v``, a value computed from the e4m3 scale bytes ``s``, with NaN where ``s`` is NaN (``0x7F`` /
    ``0xFF``) under the interpreter, which decodes those as 480 where the GPU's cvt gives NaN; ``v`` as it
    is on the GPU."""
    if INTERPRETED:  # the interpreter decodes e4m3 0x7F as 480, the GPU cvt as NaN: restore NaN
        v = tl.where((s.to(tl.uint8, bitcast=True) & 0x7F) == 0x7F, float("nan"), v)
    return v


@triton.jit
def e2m1_value(q):
    """E2M1 code (int32) -> fp32 value (exact), -0 for code 8: the bits of codes >= 2 are
    ``(code << 22) + 0x3F000000`` (the inverse of :func:`_e2m1_rn_code`), codes 0/1 are 0 and 0.5."""
    mag = q & 7
    vb = tl.where(mag < 2, mag * 0x3F000000, (mag << 22) + 0x3F000000)
    return (vb | ((q & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_abs_code(ab, neg, u24, STOCHASTIC: tl.constexpr):
    """E2M1 code (int32) from the int32 bits ``ab`` of ``|v|`` (NaN allowed) and the sign predicate ``neg``
    (already false for NaN), round to nearest even or stochastic.

    Nearest, ``|v| >= 1``: RNE of the fp32 bits to one mantissa bit, ``(bits + 0x1FFFFF + lsb) >> 22``, is
    ``(exponent, mantissa)`` of the rounded value, i.e. the code + 252 (carries into the exponent are
    right: 1.75 -> 2); |v| is first clamped to 8.0 (Inf, NaN, huge -> code 7). ``|v| < 1``: the code is
    RNE(2|v|) in {0, 1, 2}, read off the bits of ``2|v| + 2^23`` (one correctly rounded add; as an FMA
    too, since 2|v| is exact).

    Stochastic: the grid point ``lo <= |v|`` below, plus one iff ``u24 < (|v| - lo) / (hi - lo) · 2^24``
    (see reference.stochastic_codes); |v| >= 6, Inf, NaN -> 6. ``|v| >= 1``: ``lo``'s code is the fp32
    bits truncated to one mantissa bit, and the fraction times 2^22 is the 22 mantissa bits below it, so
    the test is ``u24 >> 2 < bits & 0x3FFFFF`` (exact). ``|v| < 1``: ``lo = 0.5·[|v| >= 0.5]`` and the
    fraction times 2^24 is ``(|v| - lo)·2^25`` (exact)."""
    abc = tl.minimum(ab, 0x41000000)
    a = ab.to(tl.float32, bitcast=True)
    if STOCHASTIC:
        half = (abc >= 0x3F000000).to(tl.int32)
        small_up = u24.to(tl.float32) < (a - half.to(tl.float32) * 0.5) * 33554432.0
        lo_big = tl.minimum((abc >> 22) - 252, 7)
        big_up = ((u24 >> 2) < (abc & 0x3FFFFF)) & (lo_big < 7)
        is_small = abc < 0x3F800000
        mag = tl.where(is_small, half, lo_big) + tl.where(is_small, small_up, big_up).to(tl.int32)
    else:
        big = tl.minimum((abc + ((abc >> 22) & 1) + (0x1FFFFF - 0x3F000000)) >> 22, 7)
        small = (a * 2.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
        mag = tl.where(abc < 0x3F800000, small, big)
    return mag | (neg.to(tl.int32) << 3)


@triton.jit
def _e2m1_rn_code(v, SIGNBIT: tl.constexpr):
    """fp32 v -> E2M1 code (int32), round to nearest even, saturating, NaN -> 0x7 (:func:`e2m1_abs_code`).
    The sign rule: sign bit (``bits <= 0xFF800000`` signed: negative and not NaN) or ``v < 0``."""
    bits = v.to(tl.int32, bitcast=True)
    if SIGNBIT:
        neg = bits <= -8388608
    else:
        neg = v < 0.0
    return e2m1_abs_code(bits & 0x7FFFFFFF, neg, 0, False)


@triton.jit
def _e2m1_sr_code(v, u24, SIGNBIT: tl.constexpr):
    """fp32 v -> E2M1 code (int32), stochastic rounding (:func:`e2m1_abs_code`)."""
    bits = v.to(tl.int32, bitcast=True)
    if SIGNBIT:
        neg = bits <= -8388608
    else:
        neg = v < 0.0
    return e2m1_abs_code(bits & 0x7FFFFFFF, neg, u24, True)


@triton.jit
def e2m1_code(v, u24, STOCHASTIC: tl.constexpr, SIGNBIT: tl.constexpr):
    """fp32 v -> E2M1 code (int32); see format.e2m1_codes / reference.stochastic_codes."""
    if STOCHASTIC:
        return _e2m1_sr_code(v, u24, SIGNBIT)
    return _e2m1_rn_code(v, SIGNBIT)


@triton.jit
def fmix32(h):
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def stream_key(key, SEED_PTR: tl.constexpr):
    """The stochastic-rounding key as uint32 from the quantizers' ``key`` argument (:func:`seed_arg`): the
    host's key, or with ``SEED_PTR`` a pointer to the int64 seed, whose key (``rng.seed_key``: fmix32 of
    ``seed + GOLDEN`` mod 2^32) is computed here from the value the seed holds when the kernel runs."""
    # one return, both arms under the constexpr if: Triton compiles only the taken arm of an if/else, but
    # visits a statement after an early return (casting the pointer to uint32 fails to compile for sm_90)
    if SEED_PTR:
        keyu = fmix32(tl.load(key).to(tl.uint32) + _GOLDEN)
    else:
        keyu = key.to(tl.uint32)
    return keyu


@triton.jit
def expanded_word(qa, qb, sval, EXPANDED: tl.constexpr):
    """Exact ``q·s`` of two adjacent elements as one int32 word of two bf16 (1) or fp16 (2)."""
    ya = e2m1_value(qa) * sval  # exact: <= 6 significant bits
    yb = e2m1_value(qb) * sval
    if EXPANDED == 1:  # bf16: the low 16 bits are zero, so the fp32 bits' high half is exact
        w = ((ya.to(tl.int32, bitcast=True) >> 16) & 0xFFFF) | (yb.to(tl.int32, bitcast=True) & -65536)
    else:
        ha = ya.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        w = ha | (yb.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) << 16)
    return w


# ---------------------------------------------------------------------------------------------------
# Quantizer steps (rows and columns)
# ---------------------------------------------------------------------------------------------------


@triton.jit
def times_quarter(v, q, ROUND: tl.constexpr):
    """``v * q`` for ``q = +-1/4`` (the transform's first step), kept a separately rounded product: exact
    for bf16/fp16 inputs (``ROUND`` 1, 2), so an FMA that absorbs it into the next add changes nothing;
    fp32 inputs below 2^-124 round here, so on the GPU the product is ``mul.rn.f32``, which ptxas never
    fuses into an add (FMA contraction would skip that rounding). The interpreter never fuses."""
    if ROUND == 0 and not INTERPRETED:
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=f,f,f", [v, q], dtype=tl.float32, is_pure=True, pack=1
        )
    return v * q


@triton.jit
def quarter(v, SIGNS: tl.constexpr, I: tl.constexpr, ROUND: tl.constexpr):
    """``v`` times the Hadamard sign of position ``I`` over 4 (+-1/4: the transform's first step,
    hadamard.QUARTER_SIGNS; :func:`times_quarter`)."""
    return times_quarter(v, 0.25 - 0.5 * ((SIGNS >> I) & 1), ROUND)


@triton.jit
def bfly16(v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15):
    """One radix-2 stage of hadamard._butterfly16 on 16 values: position ``2h + b`` -> ``8b + h`` with
    ``(a + b, a - b)`` of the pair ``(v[2h], v[2h+1])``."""
    return (
        v0 + v1, v2 + v3, v4 + v5, v6 + v7, v8 + v9, v10 + v11, v12 + v13, v14 + v15,
        v0 - v1, v2 - v3, v4 - v5, v6 - v7, v8 - v9, v10 - v11, v12 - v13, v14 - v15,
    )  # fmt: skip


@triton.jit
def outer_from_row_amax(a, PROFILE: tl.constexpr):
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
def block_scale(b, enc, dec, one, r6, PROFILE: tl.constexpr):
    """Block amax b [BR, NB] -> (E4M3 code (int32), its fp32 value), per profile (see reference)."""
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
    return code, e4m3_value(code)


@triton.jit
def block_factor(sval, enc, dec, one, PROFILE: tl.constexpr):
    """The per-block fp32 factor of the scaled values: a multiplier (te, torchao) or a divisor."""
    if PROFILE == 0:
        f = tl.minimum(tl.math.div_rn(one, sval * dec), 3.4028234663852886e38)
    elif PROFILE == 1:
        f = tl.math.div_rn(tl.broadcast_to(enc, sval.shape), sval)
    elif PROFILE == 2:
        f = sval * dec
    else:
        f = tl.math.div_rn(sval, enc)
    return f


# ---------------------------------------------------------------------------------------------------
# GEMM pieces (dense, decode, grouped)
# ---------------------------------------------------------------------------------------------------


@triton.jit
def load_tile(
    ptr,
    scale_ptr,
    r2,
    k2,
    mask,
    stride_r,
    stride_k,
    sstride_r,
    sstride_k,
    PACKED: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """Load one operand tile at (row index ``r2``, reduction index ``k2``), both broadcast 2-D.

    Packed: byte ``k // 2`` holds element k in its low (k even) or high (k odd) nibble; the block
    scale of element k is ``scale[r, k // 16]``. Returns ``q·s·2⁻¹⁴`` (exact) in ``DOT_DTYPE``.
    Dense: returns the stored value in ``DOT_DTYPE``. Masked-out elements are 0.
    """
    if PACKED:
        byte = tl.load(ptr + r2 * stride_r + (k2 // 2) * stride_k, mask=mask, other=0)
        code = (byte.to(tl.int32) >> ((k2 % 2) * 4)) & 0xF
        bits = ((code & 8) << 12) | ((code & 7) << 9)
        q = bits.to(tl.uint16).to(tl.float16, bitcast=True)
        s = tl.load(scale_ptr + r2 * sstride_r + (k2 // 16) * sstride_k, mask=mask, other=0.0)
        s16 = e4m3_nan(s, s.to(tl.float16))
        return (q * s16).to(DOT_DTYPE)
    else:
        return tl.load(ptr + r2 * stride_r + k2 * stride_k, mask=mask, other=0.0).to(DOT_DTYPE)


@triton.jit
def epilogue(
    acc,
    offs_m,
    offs_n,
    M,
    N,
    c_ptr,
    stride_cm,
    stride_cn,
    ga_ptr,
    gb_ptr,
    bias_ptr,
    out_mult,
    GA_MODE: tl.constexpr,
    GB_MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BF16_BY_HAND: tl.constexpr,
):
    """``C = ((acc·out_mult)·g_a)·g_b + bias``, all in fp32, one final cast to C's dtype.

    ``BF16_BY_HAND``: round fp32 → bf16 with integer RNE (the Triton 3.9 interpreter's cast truncates).
    """
    acc = acc * out_mult
    if GA_MODE == 1:
        acc = acc * tl.load(ga_ptr)
    elif GA_MODE == 2:
        acc = acc * tl.load(ga_ptr + offs_m, mask=offs_m < M, other=0.0)[:, None]
    if GB_MODE == 1:
        acc = acc * tl.load(gb_ptr)
    elif GB_MODE == 2:
        acc = acc * tl.load(gb_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    if BF16_BY_HAND:
        tl.store(c_ptrs, to_bf16_rne(acc), mask=mask)
    else:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def swizzled_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of a 1-D tile index with GROUP_M rows of tiles swept together (L2 reuse of B)."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    group_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % group) % group_m)
    pid_n = (pid % group) // group_m
    return pid_m, pid_n


# ---------------------------------------------------------------------------------------------------
# Outer scales of the quantizers: the amax pass's buffer, the scales written out
# ---------------------------------------------------------------------------------------------------


@triton.jit
def publish_amax(ptr, m, has_nan, PROPAGATE_NAN: tl.constexpr):
    """One program's share of the amax pass: ``ptr[0] = max(ptr[0], bits(max m))`` for the NaN-free
    ``m >= 0`` (2-D fp32: the fp32 bits of non-negative floats order as the floats, so an integer
    ``atomic_max`` is the float max), and with ``PROPAGATE_NAN`` ``ptr[1] = max(ptr[1], max has_nan)``
    (2-D, nonzero where a NaN was seen). ``ptr`` is zeroed by the host; :func:`reduced_amax` reads it."""
    out = tl.max(tl.max(m, axis=1), axis=0)
    tl.atomic_max(ptr, out.to(tl.int32, bitcast=True))
    if PROPAGATE_NAN:
        tl.atomic_max(ptr + 1, tl.max(tl.max(has_nan, axis=1), axis=0).to(tl.int32))


@triton.jit
def reduced_amax(buf_ptr, idx, mask, PROFILE: tl.constexpr):
    """The amax of group ``idx`` after the amax pass (:func:`publish_amax`): the fp32 whose bits are
    ``buf[2·idx]``, NaN where ``buf[2·idx + 1] > 0`` for compressed-tensors (``PROFILE == 3``, whose
    outer scale propagates a NaN amax; the other profiles ignore NaN)."""
    amax = tl.load(buf_ptr + 2 * idx, mask=mask, other=0).to(tl.float32, bitcast=True)
    if PROFILE == 3:
        flag = tl.load(buf_ptr + 2 * idx + 1, mask=mask, other=0)
        amax = tl.where(flag > 0, float("nan"), amax)
    return amax


@triton.jit
def store_outer(enc_ptr, dec_ptr, idx, enc, dec, mask, B: tl.constexpr):
    """Write the outer scales ``enc`` / ``dec`` (``[B, 1]`` per row or ``[1, B]`` per channel; ``dec =
    RN(1/enc)`` or ``enc = RN(1/dec)``, :func:`outer_from_row_amax`) to ``enc_ptr[idx]`` / ``dec_ptr[idx]``
    (``idx`` [B]) where ``mask``."""
    tl.store(enc_ptr + idx, tl.reshape(enc, (B,)), mask=mask)
    tl.store(dec_ptr + idx, tl.reshape(dec, (B,)), mask=mask)
