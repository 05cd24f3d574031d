"""``NVFP4Tensor``: a plain container for one quantized tensor (no torch subclass magic)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .format import BLOCK, e2m1_decode, swizzle_scales, unpack_nibbles
from .recipe import QuantRecipe

__all__ = ["NVFP4Tensor"]


@dataclass
class NVFP4Tensor:
    """An NVFP4-quantized tensor of logical shape ``shape`` (last dim K, padded to Kp = ceil(K/16)*16).

    Attributes:
        data: uint8 ``[..., Kp/2]``, two E2M1 codes per byte, element 2i in the LOW nibble.
        scale: float8_e4m3fn ``[..., Kp/16]``, linear layout (one scale per 16 elements of a row; for
            ``block="16x16"`` each 16x16 tile's scale is repeated on its 16 rows). ``swizzled_scale()`` gives
            the 128x4 layout.
        global_scale: fp32 DECODE multiplier: a 0-d tensor for ``scale="tensor"``/``"none"``,
            ``shape[:-1] + (1,)`` for ``"row"``, ``(E, 1, ..., 1)`` for ``"expert"``.
        recipe: the ``QuantRecipe`` that produced it.
        shape: the original (unpadded) shape.
        dtype: the original dtype.
        global_encode_scale: the outer ENCODE scale the profile computed with (same shape as
            ``global_scale``): TE ``S_enc``, compressed-tensors ``global_scale``; for torchao/modelopt
            ``RN(1/decode)``. Export uses it where a format stores the encode scale.
        amax: the outer amax the scales came from (dynamic or static source; None for checkpoint/none).
        expanded: optional exact ``q·s`` values ``[..., Kp]`` (bf16 or fp16, outer scale NOT applied), written
            by ``quantize(..., emit_expanded=dtype)`` in the same pass as the bytes; a stock tensor-core GEMM
            consumes it directly. Derived data: anything that changes ``data``/``scale`` must drop it.

    Value: ``dequantize() = e2m1(data) * f32(scale) * global_scale`` (the first product is exact).
    """

    data: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor
    recipe: QuantRecipe
    shape: torch.Size
    dtype: torch.dtype
    global_encode_scale: torch.Tensor | None = None
    amax: torch.Tensor | None = None
    expanded: torch.Tensor | None = None

    @property
    def padded_k(self) -> int:
        return self.data.shape[-1] * 2

    @property
    def device(self) -> torch.device:
        return self.data.device

    def codes(self) -> torch.Tensor:
        """Unpacked E2M1 codes ``[..., Kp]`` (uint8)."""
        return unpack_nibbles(self.data)

    def block_values(self) -> torch.Tensor:
        """``e2m1 * f32(scale)`` as fp32 ``[..., Kp]``: exact, and exactly representable in bf16 and fp16."""
        q = e2m1_decode(self.codes())
        s = self.scale.float().repeat_interleave(BLOCK, dim=-1)
        return q * s

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``e2m1(data) * f32(scale) * global_scale``, cropped to ``shape``, cast to ``dtype`` (default: the
        original dtype). Hadamard-quantized tensors stay in the rotated domain (see ``hadamard.py``)."""
        x = self.block_values() * self.global_scale.float()
        x = x[..., : self.shape[-1]]
        return x.to(self.dtype if dtype is None else dtype)

    def swizzled_scale(self) -> torch.Tensor:
        """Scales in the 128x4 swizzled layout of cuBLAS/CUTLASS/vLLM (rows = all but the last dim)."""
        if self.scale.dim() == 1:
            return swizzle_scales(self.scale.unsqueeze(0))
        return swizzle_scales(self.scale)

    def to(self, device: torch.device | str) -> NVFP4Tensor:
        def move(t):
            return None if t is None else t.to(device)

        return NVFP4Tensor(
            data=self.data.to(device),
            scale=self.scale.to(device),
            global_scale=self.global_scale.to(device),
            recipe=self.recipe,
            shape=self.shape,
            dtype=self.dtype,
            global_encode_scale=move(self.global_encode_scale),
            amax=move(self.amax),
            expanded=move(self.expanded),
        )
