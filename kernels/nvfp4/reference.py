"""Plain-torch NVFP4 quantization: the ground truth every kernel is tested against, for every profile.

Notation: ``RN(e)`` is one fp32 round-to-nearest-even operation (one torch fp32 op), ``A`` the outer amax
(per tensor / row / expert), ``b`` a block's amax, ``enc``/``dec`` the outer encode/decode scales,
``s`` the stored E4M3 block scale, ``e4m3(.)`` the satfinite RNE cast, ``R6 = RN(1/6)``.

==================  ===================================  =====================================  ============================
profile             outer scale                          block scale ``s``                      scaled value ``v``
==================  ===================================  =====================================  ============================
te                  enc = min(RN(2688/A), FLT_MAX),      e4m3(b * RN(enc * R6));                x * min(RN(1/RN(s*dec)),
                    1 if A == 0 or enc == 0;             b ignores NaN                          FLT_MAX)
                    dec = RN(1/enc)
torchao             dec = RN(A/2688); enc = RN(1/dec)    e4m3(clamp(RN(RN(b/6)/dec),            x * RN(enc / s)
                                                         2^-6, 448))
modelopt            dec = RN(A/2688); enc = RN(1/dec)    p = RN(b / RN(6*dec)); p==0 -> 1;      x / RN(s * dec)
                                                         e4m3(clamp(p, 2^-9, 448))
compressed-tensors  enc = RN(2688 / max(A, tiny)),       e4m3(RN(enc * RN(b/6))); 0 -> 0.125    x / RN(s / enc)
                    1 if not finite; dec = RN(1/enc)
==================  ===================================  =====================================  ============================

Every division above is a tensor/tensor fp32 division. (PyTorch on CUDA turns ``t / python_float`` into
``t * RN(1/python_float)`` and ``python_float / t`` is always ``reciprocal(t) * python_float``; torchao and
ModelOpt write ``amax / 6.0`` and ``amax / 2688.0``, so on CUDA they compute ``amax * RN(1/6)`` there, while
on CPU they divide. These profiles follow the division form, i.e. those engines run on CPU.)

Codes: ``e2m1_codes(v)`` (nearest-even, saturating, NaN -> 0x7); the sign of a value rounding to zero is its
sign bit for te/torchao and ``v < 0`` for modelopt/compressed-tensors. Degenerate outer amax (0, Inf, or
the decode scale underflowing to 0) gives outer scale 1 in every profile (TE's rule; torchao and ModelOpt
would divide by zero). The outer amax ignores NaN, except in compressed-tensors where a NaN anywhere makes
the global scale 1 (its ``nan -> 1`` rule). Block amaxes propagate NaN (scale byte 0x7F) except in ``te``.
``scale="none"`` means enc = dec = 1 in the same formulas (torchao/ModelOpt "single level").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .format import BLOCK, E2M1_VALUES, FLT_MAX, e2m1_codes, e4m3_encode, pack_nibbles
from .hadamard import hadamard16
from .recipe import QuantRecipe
from .rng import uniform24
from .tensor import NVFP4Tensor

__all__ = [
    "OuterScale",
    "block_amax",
    "block_scale",
    "check_input",
    "dequantize_reference",
    "outer_amax",
    "outer_scale",
    "outer_scale_from_recipe",
    "prepare_input",
    "quantize_reference",
    "round_codes",
    "scaled_values",
    "stochastic_codes",
]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP4_TIMES_E4M3 = 2688.0  # 6 * 448, exact in fp32
NEGATIVE_ZERO = {
    "te": "signbit",
    "torchao": "signbit",
    "modelopt": "negative",
    "compressed-tensors": "negative",
}
_TINY = torch.finfo(torch.float32).tiny


def _f32(v: float, device) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32, device=device)


def _recip6(device) -> torch.Tensor:
    return _f32(1.0, device) / _f32(6.0, device)  # RN(1/6) = 0x3E2AAAAB


@dataclass
class OuterScale:
    """Outer scales shaped by granularity (0-d, ``shape[:-1]+(1,)`` or ``(E,1,..,1)``), fp32."""

    encode: torch.Tensor
    decode: torch.Tensor
    amax: torch.Tensor | None


def check_input(x: torch.Tensor, recipe: QuantRecipe, name: str = "x") -> None:
    """Raise a clear error for input the quantizer does not accept."""
    if not isinstance(recipe, QuantRecipe):
        raise TypeError(f"recipe must be a QuantRecipe, got {type(recipe).__name__}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"quantize: {name} has dtype {x.dtype}; NVFP4 quantizes float16, bfloat16 or float32")
    if x.dim() == 0 or x.numel() == 0:
        raise ValueError(
            f"quantize: {name} must be a non-empty tensor with at least 1 dim, got {tuple(x.shape)}"
        )
    k = x.shape[-1]
    if k % BLOCK and not recipe.pad:
        raise ValueError(
            f"quantize: {name} has last dim K={k}, not a multiple of {BLOCK}; use QuantRecipe(pad=True) to "
            f"zero-pad K to {(k + BLOCK - 1) // BLOCK * BLOCK}"
        )
    if recipe.block == "16x16" and x.dim() < 2:
        raise ValueError(
            f"quantize: block='16x16' needs a tensor with >= 2 dims, {name} has {tuple(x.shape)}"
        )
    if recipe.scale == "expert" and x.dim() < 2:
        raise ValueError(
            f"quantize: scale='expert' needs a tensor with >= 2 dims, {name} has {tuple(x.shape)}"
        )


def prepare_input(x: torch.Tensor, recipe: QuantRecipe) -> torch.Tensor:
    """fp32 copy of ``x``, K zero-padded to a multiple of 16, Hadamard-rotated if the recipe asks."""
    pad = (-x.shape[-1]) % BLOCK
    if pad:
        x = F.pad(x, (0, pad))
    if recipe.hadamard:
        x = hadamard16(x)
    return x.float()


def _nan_to_zero_abs(x: torch.Tensor) -> torch.Tensor:
    a = x.abs()
    return torch.where(torch.isnan(a), torch.zeros_like(a), a)


def outer_amax(xf: torch.Tensor, recipe: QuantRecipe) -> torch.Tensor:
    """Outer amax shaped by granularity. NaN-ignoring, except compressed-tensors (NaN propagates)."""
    a = xf.abs() if recipe.profile == "compressed-tensors" else _nan_to_zero_abs(xf)
    if recipe.scale == "tensor":
        return a.amax()
    if recipe.scale == "row":
        return a.amax(dim=-1, keepdim=True)
    if recipe.scale == "expert":
        return a.amax(dim=tuple(range(1, a.dim())), keepdim=True)
    raise ValueError(f"outer_amax: no amax for scale={recipe.scale!r}")


def _outer_from_amax(a: torch.Tensor, profile: str) -> tuple[torch.Tensor, torch.Tensor]:
    one = torch.ones_like(a)
    k2688 = _f32(FP4_TIMES_E4M3, a.device)
    if profile == "te":
        enc = torch.clamp(k2688 / a, max=FLT_MAX)
        enc = torch.where((a == 0) | (enc == 0), one, enc)
        return enc, one / enc
    if profile in ("torchao", "modelopt"):
        dec = a / k2688
        dec = torch.where(torch.isfinite(a) & (dec > 0), dec, one)
        return one / dec, dec
    if profile == "compressed-tensors":
        enc = k2688 / torch.clamp(a, min=_TINY)
        enc = torch.where(torch.isfinite(enc) & (enc > 0), enc, one)
        return enc, one / enc
    raise ValueError(f"unknown profile {profile!r}")


def outer_scale_from_recipe(recipe: QuantRecipe, device) -> OuterScale:
    """Outer scales that do not depend on the data: ``scale="none"``, static amax, checkpoint scale."""
    one = _f32(1.0, device)
    if recipe.scale == "none":
        return OuterScale(one, one.clone(), None)
    if recipe.scale_source == "checkpoint":
        stored = _f32(recipe.checkpoint_scale, device)
        if recipe.profile in ("te", "compressed-tensors"):  # the checkpoint stores the encode scale
            return OuterScale(stored, one / stored, None)
        return OuterScale(one / stored, stored, None)
    if recipe.scale_source == "static":
        amax = _f32(recipe.static_amax, device)
        enc, dec = _outer_from_amax(amax, recipe.profile)
        return OuterScale(enc, dec, amax)
    raise ValueError("outer_scale_from_recipe: a dynamic outer scale needs the data")


def outer_scale(xf: torch.Tensor, recipe: QuantRecipe) -> OuterScale:
    """The outer encode/decode scales for the recipe's granularity and source."""
    if recipe.scale == "none" or recipe.scale_source != "dynamic":
        return outer_scale_from_recipe(recipe, xf.device)
    amax = outer_amax(xf, recipe)
    enc, dec = _outer_from_amax(amax, recipe.profile)
    return OuterScale(enc, dec, amax)


def block_amax(xf: torch.Tensor, recipe: QuantRecipe) -> torch.Tensor:
    """Per-block amax ``[..., Kp/16]``; for 16x16 the tile amax repeated on the tile's rows.

    NaN-ignoring for ``te`` (CUDA ``fmaxf``), NaN-propagating (``torch.amax``) otherwise.
    """
    a = _nan_to_zero_abs(xf) if recipe.profile == "te" else xf.abs()
    blocks = a.unflatten(-1, (-1, BLOCK)).amax(dim=-1)  # [..., rows, nb]
    if recipe.block == "1x16":
        return blocks
    rows = blocks.shape[-2]
    pad = (-rows) % 16
    tiles = F.pad(blocks, (0, 0, 0, pad)).unflatten(-2, (-1, 16)).amax(dim=-2)  # [..., rows/16, nb]
    return tiles.repeat_interleave(16, dim=-2)[..., :rows, :]


def block_scale(bamax: torch.Tensor, outer: OuterScale, profile: str) -> torch.Tensor:
    """The stored E4M3 block scales (float8_e4m3fn) from block amaxes, per profile."""
    enc, dec = outer.encode, outer.decode
    dev = bamax.device
    six, r6 = _f32(6.0, dev), _recip6(dev)
    if profile == "te":
        return e4m3_encode(bamax * (enc * r6))
    if profile == "torchao":
        return e4m3_encode(torch.clamp((bamax / six) / dec, min=2.0**-6, max=448.0))
    if profile == "modelopt":
        p = bamax / (dec * six)
        p = torch.where(p == 0, torch.ones_like(p), p)
        return e4m3_encode(torch.clamp(p, min=2.0**-9, max=448.0))
    if profile == "compressed-tensors":
        s = e4m3_encode(enc * (bamax / six)).float()
        s = torch.where(s == 0, torch.full_like(s, 0.125), s)
        return s.to(torch.float8_e4m3fn)
    raise ValueError(f"unknown profile {profile!r}")


def scaled_values(xf: torch.Tensor, scale: torch.Tensor, outer: OuterScale, profile: str) -> torch.Tensor:
    """``v``: the fp32 values that get rounded to E2M1, per profile (``xf`` is [..., Kp])."""
    s = scale.float().unsqueeze(-1)  # [..., nb, 1]
    enc = outer.encode.unsqueeze(-1) if outer.encode.dim() else outer.encode
    dec = outer.decode.unsqueeze(-1) if outer.decode.dim() else outer.decode
    blocks = xf.unflatten(-1, (-1, BLOCK))
    if profile == "te":
        mult = torch.clamp(torch.reciprocal(s * dec), max=FLT_MAX)
        v = blocks * mult
    elif profile == "torchao":
        v = blocks * (enc / s)  # torchao then clamps to +-6, which never changes a code
    elif profile == "modelopt":
        v = blocks / (s * dec)
    elif profile == "compressed-tensors":
        v = blocks / (s / enc)  # compressed-tensors then clamps to +-6, which never changes a code
    else:
        raise ValueError(f"unknown profile {profile!r}")
    return v.flatten(-2)


def stochastic_codes(v: torch.Tensor, u24: torch.Tensor, negative_zero: str) -> torch.Tensor:
    """Unbiased stochastic rounding to E2M1: round |v| up to the next grid point with probability
    ``(|v| - lo) / (hi - lo)``, decided as ``u24 < (|v| - lo) / (hi - lo) * 2^24`` (every op exact).
    ``|v| >= 6`` and Inf saturate to 6, NaN gives 0x7; the sign rule is as for nearest rounding."""
    a = v.abs()
    lo = (
        (a >= 0.5).to(torch.uint8)
        + (a >= 1.0).to(torch.uint8)
        + (a >= 1.5).to(torch.uint8)
        + (a >= 2.0).to(torch.uint8)
        + (a >= 3.0).to(torch.uint8)
        + (a >= 4.0).to(torch.uint8)
        + (a >= 6.0).to(torch.uint8)
    )
    grid = E2M1_VALUES[:8].to(v.device)
    lo_val = grid[lo.long()]
    inv_step = torch.where(a < 2.0, 2.0, torch.where(a < 4.0, 1.0, 0.5))  # 1 / (hi - lo), a power of 2
    frac24 = (a - lo_val) * (inv_step * 2.0**24)  # exact: Sterbenz + power-of-2 scaling
    up = (u24.float() < frac24) & (lo < 7)
    mag = lo + up.to(torch.uint8)
    nan = torch.isnan(v)
    mag = torch.where(nan, torch.full_like(mag, 7), mag)
    negative = torch.signbit(v) if negative_zero == "signbit" else v < 0
    return mag | ((negative & ~nan).to(torch.uint8) << 3)


def round_codes(v: torch.Tensor, recipe: QuantRecipe, seed: int | None = None) -> torch.Tensor:
    """E2M1 codes of ``v`` ([..., Kp]) by the recipe's rounding; the stochastic stream is indexed by the
    element's row-major linear index in the K-padded tensor."""
    rule = NEGATIVE_ZERO[recipe.profile]
    if recipe.rounding == "nearest":
        return e2m1_codes(v, rule)
    index = torch.arange(v.numel(), device=v.device).reshape(v.shape)
    return stochastic_codes(v, uniform24(index, recipe.seed if seed is None else seed), rule)


def quantize_reference(
    x: torch.Tensor, recipe: QuantRecipe | None = None, seed: int | None = None
) -> NVFP4Tensor:
    """Quantize ``x`` (fp16/bf16/fp32, any strides) with plain torch ops; see the module table."""
    recipe = QuantRecipe() if recipe is None else recipe
    check_input(x, recipe)
    xf = prepare_input(x, recipe)
    outer = outer_scale(xf, recipe)
    scale = block_scale(block_amax(xf, recipe), outer, recipe.profile)
    codes = round_codes(scaled_values(xf, scale, outer, recipe.profile), recipe, seed)
    return NVFP4Tensor(
        data=pack_nibbles(codes),
        scale=scale,
        global_scale=outer.decode,
        recipe=recipe,
        shape=x.shape,
        dtype=x.dtype,
        global_encode_scale=outer.encode,
        amax=outer.amax,
    )


def dequantize_reference(t: NVFP4Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``e2m1(data) * f32(scale) * global_scale`` cropped to the original shape."""
    return t.dequantize(dtype)
