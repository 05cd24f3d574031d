"""Adversarial NVFP4 test inputs (used by the tests and the GPU check script).

``adversarial(rows, k, ...)`` returns ``[rows, k]`` fp32 whose 16-element blocks are drawn from these kinds:

0. gaussian with a per-block log-normal magnitude (wide dynamic range, e4m3 subnormal block scales);
1. all zero; 2. all -0.0 or a -0.0/+0.0 mix; 3. one huge value, the rest tiny;
4. subnormal values of the target dtype; 5. a constant; 6. exact E2M1 midpoints times 2^e, with 6 * 2^e as
   the block max (exact midpoints after scaling whenever the outer scale is 1, see ``midpoint_tensor``);
7. midpoints nudged one ulp up or down; 8. NaN / +-Inf sprinkled in (only with ``specials=True``).
"""

from __future__ import annotations

import torch

from .hadamard import inverse_hadamard16

__all__ = ["adversarial", "midpoint_tensor"]

MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
N_KINDS = 9


def _midpoint_blocks(n: int, g: torch.Generator) -> torch.Tensor:
    mids = torch.tensor(MIDPOINTS)
    pick = torch.randint(0, len(MIDPOINTS), (n, 16), generator=g)
    sign = torch.where(torch.rand(n, 16, generator=g) < 0.5, -1.0, 1.0)
    e = torch.randint(-6, 8, (n, 1), generator=g).float()
    blocks = mids[pick] * sign
    blocks[:, 0] = 6.0
    return blocks * torch.exp2(e)


def adversarial(
    rows: int,
    k: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    specials: bool = True,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """``[rows, k]`` tensor of ``dtype`` (k a multiple of 16) mixing the block kinds above."""
    if k % 16:
        raise ValueError(f"adversarial: k must be a multiple of 16, got {k}")
    g = torch.Generator().manual_seed(seed)
    n = rows * k // 16
    kinds = N_KINDS if specials else N_KINDS - 1
    kind = torch.randint(0, kinds, (n,), generator=g)
    kind = torch.where(torch.rand(n, generator=g) < 0.4, torch.zeros_like(kind), kind)  # mostly realistic
    mag = torch.exp(torch.randn(n, 1, generator=g) * 4.0)
    out = torch.randn(n, 16, generator=g) * mag
    out[kind == 1] = 0.0
    negz = torch.where(torch.rand(n, 16, generator=g) < 0.7, -0.0, 0.0)
    out[kind == 2] = negz[kind == 2]
    huge = torch.randn(n, 16, generator=g) * 1e-6
    huge[:, 7] = 3e4
    out[kind == 3] = huge[kind == 3]
    tiny = torch.finfo(dtype).tiny
    sub = torch.randint(-8, 9, (n, 16), generator=g).float() * (tiny / 8)
    out[kind == 4] = sub[kind == 4]
    out[kind == 5] = mag.expand(n, 16)[kind == 5]
    mid = _midpoint_blocks(n, g)
    out[kind == 6] = mid[kind == 6]
    nudged = torch.nextafter(mid, torch.where(torch.rand(n, 16, generator=g) < 0.5, 0.0, 100.0))
    nudged[:, 0] = mid[:, 0]
    out[kind == 7] = nudged[kind == 7]
    if specials:
        sp = torch.randn(n, 16, generator=g)
        choice = torch.randint(0, 4, (n, 16), generator=g)
        sp = torch.where(choice == 0, float("nan"), sp)
        sp = torch.where(choice == 1, float("inf"), sp)
        sp = torch.where(choice == 2, float("-inf"), sp)
        out[kind == 8] = sp[kind == 8]
    return out.reshape(rows, k).to(dtype).to(device)


def midpoint_tensor(
    rows: int, k: int, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16, hadamard: bool = False
) -> torch.Tensor:
    """Blocks of exact E2M1 midpoints (times 2^e, block max 6 * 2^e) and a first block holding 2688, so the
    per-tensor outer scale is exactly 1 in every profile and every midpoint lands exactly on a tie.
    ``hadamard``: pre-rotated (the first block ``2688, 0, ..., 0``), so that the Hadamard transform
    (``hadamard16``) of the bf16 result is that tensor again: its values are sums of few-bit terms, exact in
    bf16 and fp32 (every block is, for these value ranges; the tests check)."""
    g = torch.Generator().manual_seed(seed)
    out = _midpoint_blocks(rows * k // 16, g)
    out[0, 0] = 2688.0
    if hadamard:
        out[0, 1:] = 0.0
        return inverse_hadamard16(out.reshape(rows, k)).to(dtype)
    return out.reshape(rows, k).to(dtype)
