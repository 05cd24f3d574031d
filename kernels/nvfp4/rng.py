"""Counter-based random bits for stochastic rounding, identical in torch and Triton.

``uniform24(i, seed)`` = top 24 bits of ``fmix32(i mod 2^32  XOR  fmix32(seed + 0x9E3779B9))``, where
``fmix32`` is MurmurHash3's 32-bit finaliser and ``i`` is the element's linear index in the (K-padded)
row-major tensor. Pure integer math, so the Triton kernel reproduces it bit for bit. Streams repeat after
2^32 elements (8 GiB of bf16); change ``seed`` per call (e.g. per optimizer step) to decorrelate steps.

A seed is a Python int, or an int64 tensor holding it (taken mod 2^32): then the key is computed from the
tensor's value on its device (no host read), by the Triton kernels too (``device.stream_key``), so a CUDA
graph replay uses the seed the tensor holds at replay time.
"""

from __future__ import annotations

import torch

__all__ = ["fmix32", "seed_key", "uniform24"]

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9
C1 = 0x85EBCA6B
C2 = 0xC2B2AE35


def fmix32_int(h: int) -> int:
    """MurmurHash3 fmix32 on a Python int."""
    h &= MASK32
    h ^= h >> 16
    h = (h * C1) & MASK32
    h ^= h >> 13
    h = (h * C2) & MASK32
    h ^= h >> 16
    return h


def seed_key(seed: int | torch.Tensor) -> int | torch.Tensor:
    """The 32-bit key mixed into every element's counter (an int64 tensor of it for a seed tensor)."""
    if isinstance(seed, torch.Tensor):
        return fmix32(seed + GOLDEN)
    return fmix32_int((seed + GOLDEN) & MASK32)


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """fmix32 on an int64 tensor holding uint32 values."""
    h = h & MASK32
    h = h ^ (h >> 16)
    h = (h * C1) & MASK32
    h = h ^ (h >> 13)
    h = (h * C2) & MASK32
    return h ^ (h >> 16)


def uniform24(index: torch.Tensor, seed: int | torch.Tensor) -> torch.Tensor:
    """24 random bits (int64 in [0, 2^24)) per element index."""
    return fmix32((index.long() & MASK32) ^ seed_key(seed)) >> 8
