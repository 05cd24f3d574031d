"""Triton NVFP4 quantize/dequantize kernels (placeholder until the kernels land: reports unavailable)."""

from __future__ import annotations

import torch


def available(device: torch.device) -> bool:
    return False
