"""16-point random Hadamard transform (RHT) with Transformer Engine's fixed sign vector.

``H = (1/4) * diag(sign) * H16`` with ``H16`` the Sylvester Hadamard matrix (``H16[j, i] = (-1)^popcount(i & j)``)
and ``sign = TE_SIGNS``. ``H`` is orthogonal (``H @ H.T = I``), so a GEMM whose two operands are both rotated
along the contraction dim computes the same product. Each 16-element block ``x_b`` along the last dim becomes
``x_b @ H``.

Bit-exact definition (torch reference and Triton kernels evaluate the same fp32 operations in the same order):
multiply element ``i`` by ``sign[i] / 4`` (:data:`QUARTER_SIGNS`), then four radix-2 butterfly stages (each
maps index ``2h + b`` to ``b * 8 + h`` with ``(a + b, a - b)``), then round to the input dtype (bf16/fp16;
fp32 stays fp32), like TE's default (non fast-math) path which rounds the RHT output to bf16. The fp32 sums
are exact whenever a block's exponents span <= 12 bits (bf16 inputs), so then any summation order (TE's MMA
included) agrees.

Range. A stage maps ``(a, b)`` to ``(a + b, a - b)`` and ``max(|a + b|, |a - b|) = |a| + |b|``, so the
largest magnitude of a block never decreases from stage to stage: the fp32 values never exceed the block's
largest rotated value, and a block overflows only where its correct result does. That result is bounded by
``|x_b @ H|_max <= 4 |x_b|_max``: a block with ``max |x| <= max(dtype) / 4`` (about 8.5e37 for bf16/fp32,
16376 for fp16) always fits. Beyond, a rotated value outside the dtype's range is ±Inf (IEEE overflow, as
any rounding to that dtype), and where two overflowed halves meet in a later stage, ``Inf - Inf`` makes
other values of that block NaN: the block is non-finite, and is quantized like non-finite input
(docs/nvfp4.md §6).

The factor ``1/4`` comes first because scaling at the end lets the unscaled sums (up to ``16 |x_b|_max``)
overflow fp32 from ``|x| >= 2^124`` on. Both orders give the same bits wherever the former did not
overflow, since a power-of-two factor commutes with every rounding while no value is subnormal: ``x / 4``
is exact for every bf16/fp16 input, and for fp32 inputs down to ``2^-124`` (below, an fp32 input's two
lowest subnormal bits are rounded off before the sums instead of after).
"""

from __future__ import annotations

import torch

__all__ = ["QUARTER_SIGNS", "TE_SIGNS", "hadamard16", "hadamard16_matrix", "inverse_hadamard16"]

#: TE ``get_wgrad_sign_vector``.
TE_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
#: ``TE_SIGNS / 4``: the transform's first step multiplies element ``i`` of a block by ``QUARTER_SIGNS[i]``.
QUARTER_SIGNS = tuple(s * 0.25 for s in TE_SIGNS)


def hadamard16_matrix(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 16x16 matrix ``H = 0.25 * diag(TE_SIGNS) @ H16`` (entries +-0.25, exact in bf16)."""
    idx = torch.arange(16)
    parity = torch.zeros(16, 16, dtype=torch.int64)
    both = idx[:, None] & idx[None, :]
    for bit in range(4):
        parity += (both >> bit) & 1
    h16 = 1.0 - 2.0 * (parity % 2).float()
    signs = torch.tensor(TE_SIGNS, dtype=torch.float32)
    return (0.25 * signs[:, None] * h16).to(dtype)


def _butterfly16(v: torch.Tensor) -> torch.Tensor:
    """Unnormalised Sylvester transform ``v @ H16`` of the last dim (size 16), four fixed radix-2 stages."""
    for _ in range(4):
        pairs = v.unflatten(-1, (8, 2))
        a, b = pairs[..., 0], pairs[..., 1]
        v = torch.stack((a + b, a - b), dim=-2).flatten(-2)
    return v


def hadamard16(x: torch.Tensor) -> torch.Tensor:
    """RHT of every 16-element block of the last dim (K % 16 == 0), returned in ``x.dtype``:
    ``RN_dtype(butterflies(x_b * TE_SIGNS / 4))`` in fp32 (module docstring)."""
    if x.shape[-1] % 16:
        raise ValueError(f"hadamard16 needs the last dim to be a multiple of 16, got shape {tuple(x.shape)}")
    quarter = torch.tensor(QUARTER_SIGNS, dtype=torch.float32, device=x.device)
    return _butterfly16(x.float().unflatten(-1, (-1, 16)) * quarter).flatten(-2).to(x.dtype)


def inverse_hadamard16(y: torch.Tensor) -> torch.Tensor:
    """Undo :func:`hadamard16`: ``y_b @ H.T = TE_SIGNS * (y_b / 4 @ H16)``, in fp32 (the same butterflies,
    so no fp32 value exceeds the result's largest magnitude; not bit-exact: for checks and dequantized
    views)."""
    signs = torch.tensor(TE_SIGNS, dtype=torch.float32, device=y.device)
    return (_butterfly16(y.float().unflatten(-1, (-1, 16)) * 0.25) * signs).flatten(-2)
