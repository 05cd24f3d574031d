"""``quantize`` / ``dequantize``: the public entry points, dispatching to Triton (CUDA) or the torch reference."""

from __future__ import annotations

import torch

from .recipe import QuantRecipe, check_seed
from .reference import check_input, quantize_reference
from .tensor import NVFP4Tensor

__all__ = ["BACKENDS", "dequantize", "quantize"]

BACKENDS = ("auto", "triton", "torch")


def check_quantize_options(
    what: str,
    backend: str,
    seed: int | torch.Tensor | None,
    emit_expanded,
    device: torch.device | None = None,
) -> None:
    """The options every quantizer entry point takes (``what`` names it in the error): ``backend`` one of
    :data:`BACKENDS`, ``seed`` None, a valid seed or a one-element int64 tensor on ``device`` holding one
    (:mod:`.rng`; its value is not checked: that would read it to the host), ``emit_expanded`` None, bf16 or
    fp16."""
    if backend not in BACKENDS:
        raise ValueError(f"{what}: backend must be one of {BACKENDS}, got {backend!r}")
    if isinstance(seed, torch.Tensor):
        if seed.dtype != torch.int64 or seed.numel() != 1 or (device is not None and seed.device != device):
            raise ValueError(
                f"{what}: a seed tensor must be one int64 on the input's device ({device}), got {seed.dtype} "
                f"of shape {tuple(seed.shape)} on {seed.device}"
            )
    elif seed is not None:
        check_seed(seed, f"{what}: seed")
    if emit_expanded not in (None, torch.bfloat16, torch.float16):
        raise ValueError(
            f"{what}: emit_expanded must be None, torch.bfloat16 or torch.float16, got {emit_expanded}"
        )


def _triton_usable(x: torch.Tensor) -> bool:
    from .device import available

    return available(x.device)


def quantize(
    x: torch.Tensor,
    recipe: QuantRecipe | None = None,
    *,
    backend: str = "auto",
    seed: int | torch.Tensor | None = None,
    emit_expanded: torch.dtype | None = None,
) -> NVFP4Tensor:
    """Quantize ``x`` (fp16/bf16/fp32, ``[..., K]``) to NVFP4 with ``recipe`` (default: ``QuantRecipe()``).

    ``backend="auto"`` runs the Triton kernels on CUDA tensors and the torch reference elsewhere;
    ``"triton"`` forces Triton (on CPU only under ``TRITON_INTERPRET=1``); ``"torch"`` forces the reference.
    Both produce identical bytes. ``seed`` overrides ``recipe.seed`` for stochastic rounding: an int, or a
    one-element int64 tensor on x's device holding it (read on the device only: :mod:`.rng`). Non-contiguous
    input is accepted (the Triton path makes one contiguous copy first).

    ``emit_expanded`` (``torch.bfloat16`` or ``torch.float16``): also return the exact block values ``q·s``
    (outer scale not applied, ``[..., Kp]``) as ``t.expanded``; the Triton kernel writes them in the same
    pass (bit-identical to ``expand(t, dtype)``), so a large-M GEMM can run on them without unpacking.
    The Triton path never synchronizes with the host (outer scales stay on the device).
    """
    recipe = QuantRecipe() if recipe is None else recipe
    check_quantize_options("quantize", backend, seed, emit_expanded, getattr(x, "device", None))
    check_input(x, recipe)
    if backend == "torch" or (backend == "auto" and not _triton_usable(x)):
        t = quantize_reference(x, recipe, seed=seed)
        if emit_expanded is not None:
            t.expanded = t.block_values().to(emit_expanded)
        return t
    from .quantize_rows import quantize_triton

    return quantize_triton(x, recipe, seed=seed, emit_expanded=emit_expanded)


def dequantize(t: NVFP4Tensor, dtype: torch.dtype | None = None, *, backend: str = "auto") -> torch.Tensor:
    """``e2m1(data) * f32(scale) * global_scale`` in fp32, cropped to ``t.shape``, cast to ``dtype``
    (default ``t.dtype``). Triton on CUDA for ``backend="auto"``; identical values either way."""
    if not isinstance(t, NVFP4Tensor):
        raise TypeError(f"dequantize expects an NVFP4Tensor, got {type(t).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"dequantize: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch" or (backend == "auto" and not _triton_usable(t.data)):
        return t.dequantize(dtype)
    from .dequantize_rows import dequantize_triton

    return dequantize_triton(t, dtype)
