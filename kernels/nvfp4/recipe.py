"""``QuantRecipe``: every choice that changes NVFP4 bytes, as one frozen dataclass; ``LayerConfig``: the
recipes of a trainable NVFP4 layer's operands (the fields the dense and the MoE layer configs share).

Field names are a public contract (the GEMM, diagnostics and export build on them). See docs/nvfp4.md for
the formulas each ``profile`` implements.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import ClassVar

import torch

__all__ = ["BLOCKS", "PROFILES", "QuantRecipe", "ROUNDINGS", "SCALES", "SCALE_SOURCES", "check_seed"]

BLOCKS = ("1x16", "16x16")
SCALES = ("tensor", "row", "expert", "none")
SCALE_SOURCES = ("dynamic", "static", "checkpoint")
ROUNDINGS = ("nearest", "stochastic")
PROFILES = ("te", "torchao", "modelopt", "compressed-tensors")


@dataclass(frozen=True)
class QuantRecipe:
    """How to quantize a tensor to NVFP4.

    Attributes:
        block: ``"1x16"`` (16 consecutive elements of the last dim share a scale) or ``"16x16"`` (a 16x16 tile
            of the last two dims shares one scale, so W and W^T quantize identically; stored per 1x16 row, the
            tile's scale repeated along its 16 rows).
        scale: the outer (second-level) scale granularity: ``"tensor"``, ``"row"`` (one per row of the last
            dim, i.e. per token), ``"expert"`` (one per index of the leading dim) or ``"none"`` (outer scale 1).
        scale_source: ``"dynamic"`` (outer amax computed from the input), ``"static"`` (outer amax given as
            ``static_amax``, e.g. a calibrated activation amax) or ``"checkpoint"`` (the outer scale given as
            ``checkpoint_scale`` in the profile's native convention: an ENCODE scale ``2688/amax`` for ``te``
            and ``compressed-tensors`` (``input_global_scale``), a DECODE scale ``amax/2688`` for ``torchao``
            and ``modelopt`` (``input_scale`` / ``weight_scale_2``)). Static and checkpoint need
            ``scale="tensor"``.
        static_amax: the outer amax for ``scale_source="static"`` (a real number, finite and > 0 in fp32 with
            a finite fp32 reciprocal: the outer scales are computed in fp32).
        checkpoint_scale: the stored outer scale for ``scale_source="checkpoint"`` (same rule).
        rounding: ``"nearest"`` (ties to even) or ``"stochastic"`` (unbiased, seeded by ``seed``).
        seed: stochastic-rounding seed (``quantize(..., seed=)`` overrides it per call).
        hadamard: apply the 16-point random Hadamard transform (TE's fixed sign vector) to every 16-element
            block along the last dim before quantizing; the output is rounded back to the input dtype.
        profile: whose formulas to reproduce bit for bit: ``"te"``, ``"torchao"``, ``"modelopt"``,
            ``"compressed-tensors"``.
        pad: if the last dim K is not a multiple of 16, zero-pad it to one (``data``/``scale`` then cover the
            padded K, ``NVFP4Tensor.shape`` keeps the original); if False, such K is an error.
    """

    block: str = "1x16"
    scale: str = "tensor"
    scale_source: str = "dynamic"
    static_amax: float | None = None
    checkpoint_scale: float | None = None
    rounding: str = "nearest"
    seed: int = 0
    hadamard: bool = False
    profile: str = "te"
    pad: bool = False

    def __post_init__(self) -> None:
        for name, allowed in (
            ("block", BLOCKS),
            ("scale", SCALES),
            ("scale_source", SCALE_SOURCES),
            ("rounding", ROUNDINGS),
            ("profile", PROFILES),
        ):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"QuantRecipe.{name} must be one of {allowed}, got {value!r}")
        for name in ("hadamard", "pad"):  # a truthy "no" must not switch a feature on
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"QuantRecipe.{name} must be a bool, got {value!r}")
        if self.block == "16x16" and self.scale == "row":
            raise ValueError("QuantRecipe: block='16x16' tiles span 16 rows, so scale='row' is not allowed")
        if self.scale_source == "static":
            _check_positive("static_amax", self.static_amax)
        if self.scale_source == "checkpoint":
            _check_positive("checkpoint_scale", self.checkpoint_scale)
        if self.scale_source != "dynamic" and self.scale != "tensor":
            raise ValueError(
                f"QuantRecipe: scale_source={self.scale_source!r} gives one outer scale, so it needs "
                f"scale='tensor' (got scale={self.scale!r})"
            )
        if self.scale_source != "static" and self.static_amax is not None:
            raise ValueError("QuantRecipe: static_amax is only used with scale_source='static'")
        if self.scale_source != "checkpoint" and self.checkpoint_scale is not None:
            raise ValueError("QuantRecipe: checkpoint_scale is only used with scale_source='checkpoint'")
        check_seed(self.seed, "QuantRecipe.seed")


@dataclass(frozen=True)
class LayerConfig:
    """What :class:`~triage.kernels.NVFP4LinearConfig` and :class:`~triage.kernels.NVFP4MoEConfig` share: the
    recipes of the forward operands (``activation``, ``weight``: a subclass sets the weight's default) and of
    the ``nvfp4-backward`` ones (``grad``: dy, ``wgrad``: dyᵀ and xᵀ), the ``backward`` mode (one of the
    subclass's ``backward_modes``) and the GEMM and quantizer backends. ``__post_init__`` checks the mode and
    the recipes' types, naming the subclass; a subclass adds its rules after ``super().__post_init__()``.
    """

    backward_modes: ClassVar[tuple[str, ...]] = ("bf16-backward", "nvfp4-backward")

    activation: QuantRecipe = field(default_factory=QuantRecipe)
    weight: QuantRecipe = field(default_factory=QuantRecipe)
    grad: QuantRecipe = field(default_factory=lambda: QuantRecipe(rounding="stochastic"))
    wgrad: QuantRecipe = field(
        default_factory=lambda: QuantRecipe(rounding="stochastic", hadamard=True, pad=True)
    )
    backward: str = "bf16-backward"
    gemm_backend: str = "auto"
    quant_backend: str = "auto"

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.backward not in self.backward_modes:
            raise ValueError(f"{name}.backward must be one of {self.backward_modes}, got {self.backward!r}")
        for operand in ("activation", "weight", "grad", "wgrad"):
            r = getattr(self, operand)
            if not isinstance(r, QuantRecipe):
                raise TypeError(f"{name}.{operand} must be a QuantRecipe, got {type(r).__name__}")


def check_seed(seed, name: str) -> None:
    """A stochastic-rounding seed is an int in [0, 2**32) (a bool is refused: ``seed=True`` is a mistake)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(f"{name} must be an int in [0, 2**32), got {seed!r}")


def _check_positive(name: str, value: float | None) -> None:
    """The outer scales are computed in fp32 (``2688/amax``, ``1/scale``): the value must be finite and > 0
    as an fp32, and so must its fp32 reciprocal (else the global scale becomes inf or 0: NaN / zero output)."""
    if value is None:
        raise ValueError(f"QuantRecipe.{name} is required for this scale_source")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"QuantRecipe.{name} must be a real number (int or float), got {value!r}")
    try:
        v32 = torch.tensor(float(value), dtype=torch.float32)  # rounds 1e39 to inf, 1e-50 to 0
    except OverflowError:  # an int beyond float64
        v32 = torch.tensor(math.inf)
    if not (torch.isfinite(v32) and v32 > 0 and torch.isfinite(1 / v32)):
        raise ValueError(
            f"QuantRecipe.{name} must be finite and > 0 in float32, with a finite float32 reciprocal "
            f"(about 2.9e-39 to 3.4e38), got {value!r}"
        )
