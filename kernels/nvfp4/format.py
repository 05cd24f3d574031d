"""The NVFP4 storage format: E2M1 codes, E4M3 block scales, nibble packing, the 128x4 scale swizzle.

A quantized value is ``e2m1(code) * f32(scale_e4m3) * global_scale``.

E2M1 (4 bits): sign in bit 3, codes 0..7 are the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; codes 8..15 are the
negatives (code 8 is -0). There is no Inf and no NaN.

Rounding a real value ``v`` to a code (:func:`e2m1_codes`), round to nearest, ties to even mantissa:

    |code|(a) = (a > 0.25) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5)

so 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4, and everything above 5 (Inf
included) saturates to 6. NaN becomes +6 (code 0x7), as the hardware ``cvt.rn.satfinite.e2m1x2.f32`` does.
The sign of a value that rounds to zero follows one of two documented rules (``negative_zero``):

* ``"signbit"`` (hardware, TE, torchao): the sign bit is copied, so -0.0 and -0.1 both give code 0x8;
* ``"negative"`` (ModelOpt, compressed-tensors): the sign is ``v < 0``, so -0.0 gives 0x0, -0.1 gives 0x8.

E4M3 block scales (float8_e4m3fn): :func:`e4m3_encode` is round-to-nearest-even with satfinite (anything
above 448, Inf included, becomes 448; NaN becomes 0x7F), i.e. ``cvt.rn.satfinite.e4m3x2.f32``.

Packing: element ``2i`` goes to the LOW nibble of byte ``i`` and element ``2i+1`` to the high nibble (every
engine agrees; PTX ``cvt...e2m1x2 d, a, b`` puts ``a`` high, so kernels pass ``(odd, even)``).

Swizzled scales (cuBLAS/CUTLASS/vLLM/torchao "128x4"): the scale at row ``r`` and block column ``c`` of a
``[rows, cols]`` scale matrix lives at flat offset

    ((r // 128) * ceil(cols / 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4

with rows zero-padded to a multiple of 128 and columns to a multiple of 4. :func:`swizzle_scales` returns it as
a ``[ceil(rows/128) * 32, ceil(cols/4) * 16]`` tensor (torchao's ``to_blocked`` shape; same bytes).
"""

from __future__ import annotations

import torch

__all__ = [
    "BLOCK",
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "FLT_MAX",
    "e2m1_codes",
    "e2m1_decode",
    "e4m3_decode",
    "e4m3_encode",
    "pack_nibbles",
    "swizzle_scales",
    "unpack_nibbles",
    "unswizzle_scales",
]

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
FLT_MAX = torch.finfo(torch.float32).max

#: code -> value, codes 0..15 (code 8 is -0.0).
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)

NEGATIVE_ZERO_RULES = ("signbit", "negative")


def e2m1_codes(v: torch.Tensor, negative_zero: str = "signbit") -> torch.Tensor:
    """Round fp32 ``v`` to E2M1 codes (uint8, one code per element): nearest-even, saturating, NaN -> 0x7."""
    if negative_zero not in NEGATIVE_ZERO_RULES:
        raise ValueError(f"negative_zero must be one of {NEGATIVE_ZERO_RULES}, got {negative_zero!r}")
    v = v.float()
    a = v.abs()
    mag = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75).to(torch.uint8)
        + (a > 1.25).to(torch.uint8)
        + (a >= 1.75).to(torch.uint8)
        + (a > 2.5).to(torch.uint8)
        + (a >= 3.5).to(torch.uint8)
        + (a > 5.0).to(torch.uint8)
    )
    negative = torch.signbit(v) if negative_zero == "signbit" else v < 0
    nan = torch.isnan(v)
    mag = torch.where(nan, torch.full_like(mag, 7), mag)
    sign = (negative & ~nan).to(torch.uint8) << 3
    return mag | sign


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, low 4 bits) -> fp32 values."""
    return E2M1_VALUES.to(codes.device)[(codes & 0xF).long()]


def e4m3_encode(s: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn, round to nearest even, satfinite (|s| > 448 and Inf -> 448, NaN -> 0x7F)."""
    return s.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e4m3_decode(s: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn (or its uint8 bytes) -> fp32 (exact)."""
    if s.dtype == torch.uint8:
        s = s.view(torch.float8_e4m3fn)
    return s.float()


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``[..., K]`` (K even) -> bytes ``[..., K/2]`` with element 2i in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles needs an even last dimension, got shape {tuple(codes.shape)}")
    codes = codes.to(torch.uint8)
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Bytes ``[..., K/2]`` -> codes ``[..., K]`` (low nibble first)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_nibbles needs uint8 data, got {packed.dtype}")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def _ceil_to(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def swizzle_scales(scale: torch.Tensor) -> torch.Tensor:
    """Linear ``[..., rows, cols]`` scales -> 128x4 swizzled ``[..., ceil(rows/128)*32, ceil(cols/4)*16]``.

    Leading dimensions (experts) are swizzled independently. Padding is zero.
    """
    if scale.dim() < 2:
        raise ValueError(f"swizzle_scales needs [..., rows, cols] scales, got shape {tuple(scale.shape)}")
    *lead, rows, cols = scale.shape
    raw = scale.view(torch.uint8) if scale.dtype == torch.float8_e4m3fn else scale
    rp, cp = _ceil_to(rows, 128), _ceil_to(cols, 4)
    padded = raw.new_zeros((*lead, rp, cp))
    padded[..., :rows, :cols] = raw
    # r = rb*128 + r4*32 + r32 ; c = cb*4 + c4  ->  order (rb, cb, r32, r4, c4)
    t = padded.reshape(*lead, rp // 128, 4, 32, cp // 4, 4)
    n = len(lead)
    t = t.permute(*range(n), n, n + 3, n + 2, n + 1, n + 4)
    out = t.reshape(*lead, rp // 128 * 32, cp // 4 * 16)
    return out.view(scale.dtype) if scale.dtype == torch.float8_e4m3fn else out


def unswizzle_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_scales`: back to linear ``[..., rows, cols]``."""
    *lead, a, b = swizzled.shape
    rp, cp = _ceil_to(rows, 128), _ceil_to(cols, 4)
    if (a, b) != (rp // 128 * 32, cp // 4 * 16):
        raise ValueError(f"swizzled scale shape {(a, b)} does not match rows={rows}, cols={cols}")
    raw = swizzled.view(torch.uint8) if swizzled.dtype == torch.float8_e4m3fn else swizzled
    n = len(lead)
    t = raw.reshape(*lead, rp // 128, cp // 4, 32, 4, 4)
    t = t.permute(*range(n), n, n + 3, n + 2, n + 1, n + 4)  # (rb, r4, r32, cb, c4)
    out = t.reshape(*lead, rp, cp)[..., :rows, :cols].contiguous()
    return out.view(swizzled.dtype) if swizzled.dtype == torch.float8_e4m3fn else out
