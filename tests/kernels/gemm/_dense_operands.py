"""Build NVFP4 operands directly from random codes and scales (every code, wide scale range), no quantizer."""

from __future__ import annotations

import torch

from triage.kernels.nvfp4.format import pack_nibbles
from triage.kernels.nvfp4.recipe import QuantRecipe
from triage.kernels.nvfp4.tensor import NVFP4Tensor


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def random_nvfp4(
    shape,
    *,
    gen: torch.Generator,
    scale: str = "tensor",
    scale_exp: tuple[int, int] = (-9, 8),
    zero_block_frac: float = 0.0,
    hadamard: bool = False,
    pad: bool = False,
) -> NVFP4Tensor:
    """Random codes (all 16, incl. -0), e4m3 scales 2^[lo, hi) × 1.xxx (subnormal to 448), outer scale.

    ``zero_block_frac``: that fraction of blocks gets scale 0 (and random codes: must contribute 0).
    """
    *lead, K = shape
    Kp = -(-K // 16) * 16
    codes = torch.randint(0, 16, (*lead, Kp), generator=gen, dtype=torch.uint8)
    if Kp != K:
        codes[..., K:] = 0
    mant = 1 + torch.randint(0, 8, (*lead, Kp // 16), generator=gen).float() / 8
    exp = torch.randint(scale_exp[0], scale_exp[1], (*lead, Kp // 16), generator=gen).float()
    s = (mant * torch.exp2(exp)).clamp(max=448.0)
    if zero_block_frac:
        s = torch.where(torch.rand(s.shape, generator=gen) < zero_block_frac, torch.zeros_like(s), s)
    s = s.to(torch.float8_e4m3fn)
    if scale == "row":
        g = (torch.rand((*lead, 1), generator=gen) * 3 + 0.01).float()
    else:
        g = torch.tensor(float(torch.rand((), generator=gen)) * 3 + 0.01)
    recipe = QuantRecipe(scale=scale, hadamard=hadamard, pad=pad)
    dev = device()
    return NVFP4Tensor(
        data=pack_nibbles(codes).to(dev),
        scale=s.to(dev),
        global_scale=g.to(dev),
        recipe=recipe,
        shape=torch.Size(shape),
        dtype=torch.bfloat16,
    )


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """max |y - ref| / max |ref| (fp64)."""
    y, ref = y.double(), ref.double()
    return float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-300))
