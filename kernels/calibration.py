"""The static outer scales of a served NVFP4 checkpoint: calibrated activation amax, fused-group weight amax.

A served NVFP4 checkpoint (ModelOpt, compressed-tensors) quantizes each Linear layer's input with one outer
scale computed from an amax that calibration measured when the checkpoint was made, not from each forward's
own input; and an engine that fuses sibling layers into one GEMM (vLLM: q/k/v into ``qkv_proj``, gate/up into
``gate_up_proj``) gives the fused layer's weight ONE outer scale, that of the group amax (the max over the
shards' per-tensor amax; the groups and that amax are defined in :mod:`triage.kernels.fused_groups`). This
module turns them into the recipes of a model's layers, for every user (the diagnostics' ``act_scale="static"``
and ``fused_scales="shared"`` paths, the HF sampler's ``activation_scale="calibrated"`` and
``fused_weight_scale="shared"``):

* :func:`decoder_linears`: the ``nn.Linear`` layers inside a decoder layer (``.layers.<i>.`` in the name);
* :func:`calibrate_activation_amax`: max |input| of each of them over one forward of a batch;
* :func:`static_activation_recipe`: a per-tensor activation recipe with its outer amax fixed to the
  calibrated one (``QuantRecipe(scale_source="static", static_amax=amax)``);
* :func:`set_static_activation_scales`: give the ``NVFP4Linear`` layers of a converted model those recipes,
  layer by layer (each layer's ``config``: a sampler copy refreshed in place keeps them);
* :func:`shared_weight_recipe`: a per-tensor weight recipe with its outer amax fixed to the fused group's;
* :func:`set_fused_weight_scales`: give the fused-shard ``NVFP4Linear`` layers of a converted model a static
  weight outer scale from their group's current amax (repeated whenever the weights change).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping

import torch
from torch import nn

from triage.kernels.fused_groups import FUSED_GROUPS, fused_group_amax, fused_group_key
from triage.kernels.nvfp4.recipe import QuantRecipe

__all__ = [
    "calibrate_activation_amax",
    "decoder_linears",
    "set_fused_weight_scales",
    "set_static_activation_scales",
    "shared_weight_recipe",
    "static_activation_recipe",
]

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def decoder_linears(model: nn.Module) -> list[tuple[str, int, nn.Linear]]:
    """``(qualified name, decoder layer index, module)`` of every ``nn.Linear`` inside a decoder layer."""
    out = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            m = _LAYER_RE.search(name)
            if m:
                out.append((name, int(m.group(1)), module))
    return out


@torch.no_grad()
def calibrate_activation_amax(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
) -> dict[str, float]:
    """Static activation amax of every decoder Linear: max |input| over one forward of the batch, padded
    positions included (pass unpadded sequences, one at a time, to keep padding out, as ``HFSampler`` does)."""
    amax: dict[str, float] = {}
    handles = []
    for name, _, module in decoder_linears(model):

        def hook(mod, args, name=name):
            value = float(args[0].detach().abs().amax())
            amax[name] = max(amax.get(name, 0.0), value)

        handles.append(module.register_forward_pre_hook(hook))
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    bad = [n for n, v in amax.items() if not (v > 0 and v < float("inf"))]
    if bad:
        raise ValueError(f"calibration gave a non-positive or non-finite activation amax for {bad[:3]}")
    return amax


def static_activation_recipe(recipe: QuantRecipe, amax: float) -> QuantRecipe:
    """``recipe`` with its outer scale fixed to the calibrated ``amax`` (``scale_source="static"``).

    ``recipe`` must have one outer scale per tensor (``scale="tensor"``) computed from the input
    (``scale_source="dynamic"``): a per-row (per-token) scale has no single amax to calibrate; and no Hadamard
    rotation (``hadamard=False``): the calibration measures max|x|, a rotated recipe scales H·x."""
    if recipe.scale != "tensor":
        raise ValueError(
            f"a calibrated (static) activation scale replaces one per-tensor amax: the activation recipe needs "
            f"scale='tensor', got scale={recipe.scale!r}"
        )
    if recipe.scale_source != "dynamic":
        raise ValueError(
            "a calibrated (static) activation scale replaces a dynamic amax: the activation recipe needs "
            f"scale_source='dynamic', got {recipe.scale_source!r}"
        )
    if recipe.hadamard:
        raise ValueError(
            "a calibrated (static) activation scale is max|x| of the calibration batch, but a Hadamard recipe "
            "scales the rotated H·x: the activation recipe needs hadamard=False"
        )
    return dataclasses.replace(recipe, scale_source="static", static_amax=float(amax))


def set_static_activation_scales(model: nn.Module, amax: Mapping[str, float]) -> nn.Module:
    """Give every ``NVFP4Linear`` of ``model`` the static activation recipe of its calibrated amax, in place;
    returns ``model``.

    Only ``layer.config`` changes, to its config with ``activation=static_activation_recipe(...)`` (the module
    and its parameters stay, its weight recipe is untouched: the weights stay quantized from their current
    values at every forward). Names in ``amax`` that are not converted layers (those the
    conversion skips, e.g. MoE routers) are ignored. ``ValueError`` when a converted layer has no amax in
    ``amax``, a layer's activation recipe is not per tensor and dynamic, or the model has NVFP4 MoE experts
    or frozen NVFP4 layers (their activation scales are not calibrated here); nothing is changed then."""
    from triage.kernels.frozen_linear import FrozenNVFP4Linear
    from triage.kernels.linear import NVFP4Linear
    from triage.kernels.moe.experts import NVFP4MoeExperts

    layers = {name: m for name, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    if not layers:
        raise ValueError(
            "calibrated activation scales: the model has no NVFP4Linear layer (convert it first)"
        )
    others = [
        (name, kind)
        for name, m in model.named_modules()
        for cls, kind in ((NVFP4MoeExperts, "NVFP4 MoE experts"), (FrozenNVFP4Linear, "a frozen NVFP4 layer"))
        if isinstance(m, cls)
    ]
    if others:
        raise ValueError(
            f"calibrated activation scales cover NVFP4Linear layers only; {others[0][0]!r} is {others[0][1]}"
        )
    missing = sorted(set(layers) - set(amax))
    if missing:
        raise ValueError(
            f"calibrated activation scales: no calibrated amax for the NVFP4 layers {missing[:3]}"
        )
    configs = {}
    for name, layer in layers.items():
        try:
            activation = static_activation_recipe(layer.config.activation, amax[name])
        except ValueError as err:
            raise ValueError(f"layer {name!r}: {err}") from None
        configs[name] = dataclasses.replace(layer.config, activation=activation)
    for name, config in configs.items():
        layers[name].config = config
    return model


def shared_weight_recipe(recipe: QuantRecipe, amax: float) -> QuantRecipe:
    """``recipe`` with its outer scale fixed to the fused group's ``amax`` (``scale_source="static"``).

    ``recipe`` must have one outer scale per tensor (``scale="tensor"``) computed from the weight
    (``scale_source="dynamic"``), and no
    Hadamard rotation (the group amax is max|W|, a rotated recipe scales the rotated blocks). A group amax that
    is not a valid static amax (0: all-zero weights; NaN/Inf: non-finite weights) gives the dynamic recipe:
    each shard's own amax, whose non-finite check then propagates a NaN as the layer does."""
    if recipe.scale != "tensor":
        raise ValueError(
            "a fused group's shared weight scale replaces one per-tensor amax: the weight recipe needs "
            f"scale='tensor', got scale={recipe.scale!r}"
        )
    if recipe.scale_source != "dynamic":
        raise ValueError(
            "a fused group's shared weight scale replaces the weight's own amax: the weight recipe needs "
            f"scale_source='dynamic', got {recipe.scale_source!r}"
        )
    if recipe.hadamard:
        raise ValueError(
            "a fused group's shared weight scale is max|W| of its shards, but a Hadamard recipe scales the "
            "rotated blocks: the weight recipe needs hadamard=False"
        )
    if math.isfinite(amax) and amax > 0:
        try:
            return dataclasses.replace(recipe, scale_source="static", static_amax=float(amax))
        except ValueError:  # positive but no finite fp32 reciprocal (a subnormal amax)
            pass
    return dataclasses.replace(recipe, scale_source="dynamic", static_amax=None)


@torch.no_grad()
def set_fused_weight_scales(model: nn.Module) -> nn.Module:
    """Give every fused-shard ``NVFP4Linear`` of ``model`` (q/k/v, gate/up, ...:
    :func:`~triage.kernels.fused_groups.fused_group_key`) the weight recipe of its group's current amax
    (:func:`~triage.kernels.fused_groups.fused_group_amax`, :func:`shared_weight_recipe`), in place; returns
    ``model``.

    Only ``layer.config`` changes (the module, its parameters and its activation recipe stay): the layer's
    weight cache is keyed on the weight and the whole config, so a new group amax re-quantizes the weight at
    the next forward and an unchanged one keeps the cached codes. Other layers (o_proj, down_proj, MoE
    experts, frozen layers) keep their recipes. The amax is of the weights as they are now: call it again
    after every weight update; each call starts from the layer's recipe before the first one (kept as
    ``layer._unshared_weight_recipe``), which must be dynamic. ``ValueError`` when no ``NVFP4Linear`` is a
    fused shard (by its module name), when a fused shard is wrapped (PEFT's ``q_proj.base_layer``: its
    siblings would be grouped without it), or (naming the layer) when a fused-shard layer's weight recipe is
    not per tensor and dynamic, or is rotated; nothing is changed then."""
    from triage.kernels.linear import NVFP4Linear

    layers = {name: m for name, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    if not layers:
        raise ValueError("shared fused weight scales: the model has no NVFP4Linear layer (convert it first)")
    wrapped = [n for n in layers if n.endswith(".base_layer") and fused_group_key(n.rpartition(".")[0])]
    if wrapped:
        raise ValueError(
            f"shared fused weight scales: {wrapped[0]!r} is a wrapped fused shard (its group would be formed "
            "without it); share the scales of the unwrapped model"
        )
    amax = fused_group_amax({name: m.weight for name, m in layers.items()})
    if not amax:
        groups = ", ".join("/".join(g) for g in FUSED_GROUPS)
        raise ValueError(
            f"shared fused weight scales: no NVFP4Linear layer of the model is a fused shard ({groups} by "
            f"module name), e.g. {next(iter(layers))!r}"
        )
    configs, bases = {}, {}
    for name, value in amax.items():
        config = layers[name].config
        bases[name] = getattr(layers[name], "_unshared_weight_recipe", None) or config.weight
        try:
            weight = shared_weight_recipe(bases[name], value)
        except ValueError as err:
            raise ValueError(f"layer {name!r}: {err}") from None
        configs[name] = dataclasses.replace(config, weight=weight)
    for name, config in configs.items():
        layers[name].config = config
        layers[name]._unshared_weight_recipe = bases[name]
    return model
