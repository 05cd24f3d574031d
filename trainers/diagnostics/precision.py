"""How one engine computes a model's Linear layers: ``Precision`` and the model conversion it implies.

A ``Precision`` names one point on every Linear-layer axis of the gap table
(:mod:`~triage.trainers.diagnostics.gap_table`):

* ``mode``: ``"bf16"`` (the Linear layers as they are, in the path's dtype), ``"w4a16"`` (NVFP4 weights,
  activations unquantized — Hopper vLLM's Marlin path) or ``"w4a4"`` (NVFP4 weights and activations);
* ``act_scale``: the activation outer scale — ``"tensor"`` (one dynamic amax over every token of the call),
  ``"token"`` (one per row: ``QuantRecipe(scale="row")``) or ``"static"`` (a calibrated amax per layer);
* ``weights_from``: ``"online"`` (quantize the master weights in memory) or ``"checkpoint"`` (the offline
  route: cast the master to ``checkpoint_dtype``, export an NVFP4 checkpoint with the kernels' exporter in
  ``checkpoint_profile``'s layout — compressed-tensors for that profile, ModelOpt otherwise — and load its
  codes back; with ``act_scale="static"`` the calibrated amaxes are written as the checkpoint's activation
  scales and the engine quantizes with what ``load_activation_recipes`` reads back, i.e. the layout's
  producer formulas, not ``profile``'s);
* ``fused_scales``: ``"independent"`` (q, k, v, gate, up each get their own weight outer scale) or
  ``"shared"`` (one outer scale per fused group q/k/v and gate/up: the group amax, as a fused QKV weight
  or vLLM's ``max`` over shards gives);
* ``profile``, ``weight_block``: whose quantizer formulas and which weight tiles (``QuantRecipe``).

Conversion (:func:`convert_linears`) replaces the decoder layers' ``nn.Linear`` modules (never ``lm_head``)
in place by the kernels' own layers: the online W4A4 learner gets ``NVFP4Linear`` (master weight kept,
quantized by the layer's cache, as in training; :func:`triage.kernels.convert` with a config per layer);
every other path an engine-side ``FrozenNVFP4Linear`` built from the NVFP4 weights an engine loads (fixed
codes quantized from the master or read from a checkpoint; ``compute="w4a4"`` with the activation recipe
as its ``activation``, or ``"w4a16"``). The offline route writes a real NVFP4 checkpoint with
``export_nvfp4_checkpoint`` and loads it back with ``load_nvfp4_checkpoint`` (+ ``load_activation_recipes``
for static activation scales), as an engine loads it. Backends: ``auto`` on CUDA (Triton quantizer,
Triton/cuBLAS GEMMs); on CPU the torch reference quantizer and the fp64 reference GEMM (never the Triton
interpreter), on both the learner's and the engine's layers.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass

import torch
from torch import nn

from triage.kernels.calibration import (
    calibrate_activation_amax,
    decoder_linears,
    shared_weight_recipe,
    static_activation_recipe,
)
from triage.kernels.frozen_linear import FrozenNVFP4Linear, NVFP4FrozenConfig
from triage.kernels.fused_groups import FUSED_GROUPS, fused_group_amax
from triage.kernels.nvfp4 import (
    NVFP4Tensor,
    QuantRecipe,
    export_nvfp4_checkpoint,
    load_activation_recipes,
    load_nvfp4_checkpoint,
    quantize,
)

__all__ = [
    "ACT_SCALES",
    "FUSED_GROUPS",
    "MODES",
    "Precision",
    "activation_recipe",
    "calibrate_activation_amax",
    "convert_linears",
    "decoder_linears",
    "weight_recipe",
]

MODES = ("bf16", "w4a16", "w4a4")
ACT_SCALES = ("tensor", "token", "static")
WEIGHT_SOURCES = ("online", "checkpoint")
FUSED_SCALES = ("independent", "shared")


@dataclass(frozen=True)
class Precision:
    """One engine's Linear-layer numerics (see the module docstring for each axis)."""

    mode: str = "bf16"
    act_scale: str = "tensor"
    profile: str = "te"
    weight_block: str = "1x16"
    weights_from: str = "online"
    checkpoint_profile: str = "modelopt"
    checkpoint_dtype: torch.dtype = torch.bfloat16
    fused_scales: str = "independent"
    #: decoder-layer indices to convert (None: all); a partial set plants a mismatch in those layers.
    layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name, allowed in (
            ("mode", MODES),
            ("act_scale", ACT_SCALES),
            ("weights_from", WEIGHT_SOURCES),
            ("fused_scales", FUSED_SCALES),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"Precision.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        # Let QuantRecipe validate profile / block names with its own messages.
        QuantRecipe(profile=self.profile, block=self.weight_block)
        QuantRecipe(profile=self.checkpoint_profile)
        if self.layers is not None and not all(isinstance(i, int) and i >= 0 for i in self.layers):
            raise ValueError(
                f"Precision.layers must be None or non-negative layer indices, got {self.layers!r}"
            )

    @property
    def quantized(self) -> bool:
        return self.mode != "bf16"

    def label(self) -> str:
        """Short description, e.g. ``w4a4 act=token te online``."""
        if not self.quantized:
            return "bf16"
        parts = [self.mode]
        if self.mode == "w4a4":
            parts.append(f"act={self.act_scale}")
        parts.append(self.checkpoint_profile if self.weights_from == "checkpoint" else self.profile)
        parts.append(self.weights_from)
        if self.fused_scales == "shared":
            parts.append("shared-fused")
        return " ".join(parts)


def weight_recipe(precision: Precision, profile: str | None = None, amax: float | None = None) -> QuantRecipe:
    """The weight recipe: per-tensor outer scale, dynamic or (shared fused scales) the group ``amax``."""
    profile = profile or precision.profile
    recipe = QuantRecipe(block=precision.weight_block, scale="tensor", profile=profile)
    return recipe if amax is None else shared_weight_recipe(recipe, amax)


def activation_recipe(precision: Precision, amax: float | None = None) -> QuantRecipe | None:
    """The activation recipe (None for bf16 / w4a16). ``amax``: the calibrated amax for ``"static"``."""
    if precision.mode != "w4a4":
        return None
    if precision.act_scale == "token":
        return QuantRecipe(scale="row", profile=precision.profile)
    if precision.act_scale == "static":
        if amax is None:
            raise ValueError("Precision(act_scale='static') needs a calibrated activation amax per layer")
        return static_activation_recipe(QuantRecipe(scale="tensor", profile=precision.profile), amax)
    return QuantRecipe(scale="tensor", profile=precision.profile)


def _backends(model: nn.Module) -> tuple[str, str]:
    """(gemm_backend, quant_backend): the kernels' ``auto`` on CUDA; on CPU the fp64 reference GEMM and the
    torch quantizer (``auto`` would run the Triton interpreter when TRITON_INTERPRET is set)."""
    cuda = next(model.parameters()).device.type == "cuda"
    return ("auto", "auto") if cuda else ("reference", "torch")


def _online_weights(
    weights: dict[str, torch.Tensor], precision: Precision, quant_backend: str
) -> dict[str, NVFP4Tensor]:
    """Quantize in memory with the precision's weight recipe (the group amax for shared fused scales)."""
    shared = fused_group_amax(weights) if precision.fused_scales == "shared" else {}
    return {
        name: quantize(w, weight_recipe(precision, amax=shared.get(name)), backend=quant_backend)
        for name, w in weights.items()
    }


def _checkpoint_weights(
    weights: dict[str, torch.Tensor],
    precision: Precision,
    calibration: dict[str, float] | None,
    quant_backend: str,
) -> tuple[dict[str, NVFP4Tensor], dict[str, QuantRecipe]]:
    """The offline route: cast to ``checkpoint_dtype``, write an NVFP4 checkpoint with the kernels' exporter
    (``checkpoint_profile``'s layout and formulas, shared fused scales as vLLM loads them), read it back.

    Returns the loaded weights by layer name and, for W4A4 with static activation scales, the checkpoint's
    activation recipes (``input_scale`` / ``input_global_scale`` read with the layout's formulas)."""
    profile = precision.checkpoint_profile
    layout = "compressed-tensors" if profile == "compressed-tensors" else "modelopt"
    static = precision.mode == "w4a4" and precision.act_scale == "static"
    state = {f"{name}.weight": w.detach().to(precision.checkpoint_dtype) for name, w in weights.items()}
    device = next(iter(weights.values())).device
    with tempfile.TemporaryDirectory() as tmp:
        export_nvfp4_checkpoint(
            state,
            tmp,
            layout=layout,
            recipe=QuantRecipe(block=precision.weight_block, scale="tensor", profile=profile),
            skip=(),
            input_amax={name: calibration[name] for name in weights} if static else None,
            share_fused_scales=precision.fused_scales == "shared",
            fused_groups=FUSED_GROUPS,
            backend=quant_backend,
        )
        loaded = load_nvfp4_checkpoint(tmp, device=device)
        inputs = load_activation_recipes(tmp) if static else {}
    return {name: loaded[f"{name}.weight"] for name in weights}, inputs


def convert_linears(
    model: nn.Module,
    precision: Precision,
    calibration: dict[str, float] | None = None,
    master: nn.Module | None = None,
    learner: bool = False,
) -> nn.Module:
    """Replace (in place) the decoder Linear layers of ``model`` as ``precision`` says; returns ``model``.

    ``calibration``: per-layer activation amax (``act_scale="static"``); ``master``: the model whose
    weights are quantized (default ``model``; pass the fp32 master when ``model`` is a bf16 copy).
    ``learner=True`` with online W4A4 uses the trainer's own ``triage.kernels.NVFP4Linear`` (sharing the
    master's weight, quantized by the layer's cache, as in training); everything else an engine-side
    ``triage.kernels.frozen_linear.FrozenNVFP4Linear`` with fixed codes (online, or through an NVFP4 checkpoint).
    """
    if not precision.quantized:
        return model
    targets = [t for t in decoder_linears(model) if precision.layers is None or t[1] in set(precision.layers)]
    if not targets:
        raise ValueError(
            f"convert_linears: no decoder nn.Linear matched (layers={precision.layers!r}); is this a "
            "decoder model with `.layers.<i>.` module names?"
        )
    for name, _, module in targets:
        if module.in_features % 16:
            raise ValueError(
                f"convert_linears: layer {name!r} has in_features={module.in_features}, not a multiple of 16"
            )
    if precision.act_scale == "static" and precision.mode == "w4a4":
        missing = [n for n, _, _ in targets if calibration is None or n not in calibration]
        if missing:
            raise ValueError(f"act_scale='static' needs a calibrated amax for {missing[:3]} (calibration=)")
    gemm_backend, quant_backend = _backends(model)
    source = dict((master or model).named_modules())
    if learner and precision.mode == "w4a4" and precision.weights_from == "online":
        masters = {name: source[name] for name, _, _ in targets}
        return _convert_learner(model, masters, precision, calibration, gemm_backend, quant_backend)
    weights = {name: source[name].weight.detach() for name, _, _ in targets}
    if precision.weights_from == "checkpoint":
        qweights, inputs = _checkpoint_weights(weights, precision, calibration, quant_backend)
    else:
        qweights, inputs = _online_weights(weights, precision, quant_backend), {}
    for name, _, module in targets:
        activation = inputs.get(name) or activation_recipe(
            precision, calibration.get(name) if calibration else None
        )
        config = NVFP4FrozenConfig(
            compute="w4a4" if precision.mode == "w4a4" else "w4a16",
            activation=activation or QuantRecipe(),  # unused by w4a16
            gemm_backend=gemm_backend,
            quant_backend=quant_backend,
        )
        model.set_submodule(name, FrozenNVFP4Linear(qweights[name], module.bias, config))
    return model


def _convert_learner(
    model: nn.Module,
    masters: dict[str, nn.Linear],
    precision: Precision,
    calibration: dict[str, float] | None,
    gemm_backend: str,
    quant_backend: str,
) -> nn.Module:
    """Online W4A4 learner: the master's Linear layers put into ``model`` and converted to ``NVFP4Linear``
    (sharing the master's parameters) by ``triage.kernels.convert``, one config per layer."""
    from triage.kernels.conversion import NVFP4Config, convert
    from triage.kernels.linear import NVFP4LinearConfig

    shared = {}
    if precision.fused_scales == "shared":
        shared = fused_group_amax({name: m.weight for name, m in masters.items()})
    layers = {}
    for name in masters:
        config = NVFP4LinearConfig(
            activation=activation_recipe(precision, calibration.get(name) if calibration else None),
            weight=weight_recipe(precision, amax=shared.get(name)),
            gemm_backend=gemm_backend,
            quant_backend=quant_backend,
        )
        layers[name] = NVFP4Config(linear=config, moe=None, skip=())
    for name, linear in masters.items():
        model.set_submodule(name, _sharing_linear(linear))
    return convert(model, NVFP4Config(linear=None, moe=None, skip=()), layers=layers)


def _sharing_linear(master: nn.Linear) -> nn.Linear:
    """A plain ``nn.Linear`` holding ``master``'s own weight and bias parameters (shared, not copied), so that
    ``convert`` builds the learner's layer from it whatever ``master`` is (an ``nn.Linear`` subclass, an
    ``NVFP4Linear`` with its own config) and the master's module stays untouched."""
    linear = nn.Linear(master.in_features, master.out_features, bias=master.bias is not None, device="meta")
    linear.weight = master.weight
    linear.bias = master.bias
    return linear.train(master.training)
