"""16-point random Hadamard transform (RHT) with Transformer Engine's fixed sign vector.

``H = (1/4) * diag(sign) * H16`` with ``H16`` the Sylvester Hadamard matrix (``H16[j, i] = (-1)^popcount(i & j)``)
and ``sign = TE_SIGNS``. ``H`` is orthogonal (``H @ H.T = I``), so a GEMM whose two operands are both rotated
along the contraction dim computes the same product. Each 16-element block ``x_b`` along the last dim becomes
``x_b @ H``.

Bit-exact definition (torch reference and Triton kernel evaluate the same fp32 operations in the same order):
multiply by the signs, then four radix-2 butterfly stages (each maps index ``2h + b`` to ``b * 8 + h`` with
``(a + b, a - b)``), then multiply by 0.25, then round to the input dtype (bf16/fp16; fp32 stays fp32), like
TE's default (non fast-math) path which rounds the RHT output to bf16. The fp32 sums are exact whenever a
block's exponents span <= 12 bits (bf16 inputs), so then any summation order (TE's MMA included) agrees.
"""

from __future__ import annotations

import torch

__all__ = ["TE_SIGNS", "hadamard16", "hadamard16_matrix", "inverse_hadamard16"]

#: TE ``get_wgrad_sign_vector``.
TE_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


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
    """Unnormalised Sylvester transform of the last dim (size 16), four fixed radix-2 stages."""
    for _ in range(4):
        pairs = v.unflatten(-1, (8, 2))
        a, b = pairs[..., 0], pairs[..., 1]
        v = torch.stack((a + b, a - b), dim=-2).flatten(-2)
    return v


def hadamard16(x: torch.Tensor) -> torch.Tensor:
    """RHT of every 16-element block of the last dim (K % 16 == 0), returned in ``x.dtype``."""
    if x.shape[-1] % 16:
        raise ValueError(f"hadamard16 needs the last dim to be a multiple of 16, got shape {tuple(x.shape)}")
    signs = torch.tensor(TE_SIGNS, dtype=torch.float32, device=x.device)
    blocks = x.float().unflatten(-1, (-1, 16)) * signs
    y = _butterfly16(blocks) * 0.25
    return y.flatten(-2).to(x.dtype)


def inverse_hadamard16(y: torch.Tensor) -> torch.Tensor:
    """Undo :func:`hadamard16` (``y_b @ H.T``), in fp32 (not bit-exact: for checks and dequantized views)."""
    h = hadamard16_matrix(torch.float32).to(y.device)
    return (y.float().unflatten(-1, (-1, 16)) @ h.T).flatten(-2)
