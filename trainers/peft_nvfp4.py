"""PEFT's LoRA layer over a frozen NVFP4 base (the QeRL setting), and the calls that set a model up for it.

:func:`nvfp4_lora` freezes the base (``triage.kernels.convert`` with ``NVFP4Config.frozen``: every linear layer
becomes a :class:`~triage.kernels.frozen_linear.FrozenNVFP4Linear`, only the quantized weight is kept: ~0.56
byte per base parameter, no master copy) and registers
:class:`NVFP4LoraLinear` as PEFT's LoRA layer for it (``LoraConfig._register_custom_module``), so PEFT's
``get_peft_model`` — which TRL's trainer calls when given ``peft_config`` — wraps the frozen layers. The LoRA
forward is PEFT's own: ``y = base(x) + B·A·dropout(x)·α/r``, the adapters in their own dtype (fp32 by PEFT's
default). Only ``lora_A`` / ``lora_B`` train; the base receives no gradient and its bytes never change.

Sampler and learner share the base: the built-in ``HFSampler`` samples with the trainer's own model by default
(``sampler_model="shared"``); with ``sampler_model="copy"`` the deep copy shares the frozen bytes too (see
``FrozenNVFP4Linear.__deepcopy__``), so only the adapters are duplicated. The mismatch left between sampler
and learner is the adapters' precision (if the copy casts them) and the kernels' paths (decode vs full
sequence).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from peft.tuners.tuners_utils import check_adapters_to_merge
from peft.utils import ModulesToSaveWrapper
from torch import nn

from triage.kernels.conversion import NVFP4Config, convert
from triage.kernels.frozen_linear import FrozenNVFP4Linear, NVFP4FrozenConfig, base_nbytes
from triage.kernels.linear import NVFP4Linear

__all__ = [
    "NVFP4LoraLinear",
    "adapter_parameters",
    "describe",
    "is_adapter_key",
    "nvfp4_lora",
    "nvfp4_lora_model",
]

#: ``init_lora_weights`` values that do not read the base weight (the others need a dense one).
_PLAIN_INITS = (True, False, "gaussian")
#: State-dict name parts of adapter tensors: LoRA's and PEFT's ``modules_to_save`` copies.
_ADAPTER_NAMES = (*PeftLoraLinear.adapter_layer_names, *ModulesToSaveWrapper.adapter_layer_names)


class NVFP4LoraLinear(PeftLoraLinear):
    """PEFT's LoRA ``Linear`` over a :class:`FrozenNVFP4Linear` base (vanilla LoRA: no DoRA or variants).

    Forward and the adapters are PEFT's. ``merge`` re-quantizes ``Ŵ + ΔW`` with the base's weight recipe
    (dynamic outer scale) — like PEFT does for other quantized bases, the merged weight carries a new
    rounding; ``unmerge`` restores the original bytes exactly (they are kept while merged).
    """

    @property
    def lora_variants(self):
        return {(): None}

    def _get_in_out_features(self, module: nn.Module):
        base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
        return base.in_features, base.out_features

    def _get_base_layer_device_and_dtype(self, base_layer):
        return base_layer.device, base_layer.compute_dtype

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        adapter_names = [a for a in check_adapters_to_merge(self, adapter_names) if a in self.lora_A]
        if not adapter_names:
            return
        base: FrozenNVFP4Linear = self.get_base_layer()
        for a in adapter_names:
            if self.lora_bias[a]:
                raise NotImplementedError(f"NVFP4LoraLinear: merging adapter {a!r} with lora_bias=True")
        w = base.dequantized_weight(torch.float32)
        for a in adapter_names:
            w = w + self.get_delta_weight(a).float()
        if safe_merge and not torch.isfinite(w).all():
            raise ValueError(
                f"NaNs detected in the merged weights. The adapters {adapter_names} seem to be broken"
            )
        from triage.kernels.nvfp4 import quantize

        self._caches.setdefault("nvfp4_unmerged", base.quantized_weight())
        recipe = replace(base.weight_recipe, scale_source="dynamic", static_amax=None, checkpoint_scale=None)
        base.replace_weight(quantize(w.to(base.weight_dtype), recipe, backend=base.config.quant_backend))
        self.merged_adapters.extend(adapter_names)

    def unmerge(self) -> None:
        if not self.merged:
            return
        self.get_base_layer().replace_weight(self._caches.pop("nvfp4_unmerged"))
        self.merged_adapters.clear()

    def __repr__(self) -> str:
        return super().__repr__().replace("lora.Linear", "lora.NVFP4LoraLinear", 1)


def nvfp4_lora(
    model: nn.Module, lora_config: LoraConfig, config: NVFP4Config | None = None
) -> tuple[nn.Module, LoraConfig]:
    """Freeze the NVFP4 base of ``model`` and make ``lora_config`` wrap it; returns ``(model, lora_config)``.

    ``config``: an ``NVFP4Config`` with ``frozen`` set, applied with ``triage.kernels.convert`` (e.g.
    ``NVFP4Config.from_recipe(recipe, frozen="w4a16")``: every ``nn.Linear`` quantized with ``recipe`` and
    frozen; lm_head/embeddings skipped). None: only the ``NVFP4Linear`` layers are frozen, each holding its
    ``W_q`` and computing as it did (``NVFP4FrozenConfig.like`` their config, which they must share).
    ``lora_config`` (modified in place and returned) gets the custom-module registration; pass both to
    ``TriageGRPOTrainer(model=model, peft_config=lora_config)`` or ``peft.get_peft_model``.
    """
    if not isinstance(lora_config, LoraConfig):
        raise TypeError(f"nvfp4_lora needs a peft.LoraConfig, got {type(lora_config).__name__}")
    if lora_config.use_dora:
        raise ValueError(
            "nvfp4_lora: DoRA needs the dense base weight norm; use plain LoRA over an NVFP4 base"
        )
    if lora_config.init_lora_weights not in _PLAIN_INITS:
        raise ValueError(
            f"nvfp4_lora: init_lora_weights={lora_config.init_lora_weights!r} reads/rewrites the dense base weight; "
            f"use one of {_PLAIN_INITS} over a frozen NVFP4 base"
        )
    if isinstance(model, PeftModel):
        raise ValueError("nvfp4_lora: the model already has adapters; freeze the base before wrapping it")
    if config is not None and config.frozen is None:
        raise ValueError(
            "nvfp4_lora: config.frozen is None; LoRA trains over a frozen base (NVFP4Config(frozen=...))"
        )
    freeze = config if config is not None else _frozen_as_computed(model)
    if freeze is not None:
        convert(model, freeze)
    frozen = [n for n, m in model.named_modules() if isinstance(m, FrozenNVFP4Linear)]
    if not frozen:
        raise ValueError(
            "nvfp4_lora: the model has no NVFP4 layer; convert it first (triage.kernels.convert) or pass a "
            "config with linear and frozen set (NVFP4Config.from_recipe(recipe, frozen='w4a4'))"
        )
    if config is not None:
        for n, m in model.named_modules():
            if isinstance(m, FrozenNVFP4Linear) and m.config != config.frozen:
                raise ValueError(f"nvfp4_lora: layer {n!r} was frozen earlier with another NVFP4FrozenConfig")
    if isinstance(lora_config.target_modules, str) and lora_config.target_modules == "all-linear":
        # PEFT resolves "all-linear" to nn.Linear modules only; here it means every frozen NVFP4 layer.
        lora_config.target_modules = {n.rsplit(".", 1)[-1] for n in frozen}
    lora_config._register_custom_module({FrozenNVFP4Linear: NVFP4LoraLinear})
    return model, lora_config


def _frozen_as_computed(model: nn.Module) -> NVFP4Config | None:
    """The config freezing the ``NVFP4Linear`` layers of ``model`` as they compute (None: it has none)."""
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, NVFP4Linear)]
    if not layers:
        return None
    first_name, first = layers[0]
    for name, m in layers:
        if m.config != first.config:
            raise ValueError(
                f"nvfp4_lora: layers {first_name!r} and {name!r} have different NVFP4LinearConfigs; pass "
                "config=NVFP4Config(linear=None, moe=None, frozen=NVFP4FrozenConfig(...)) to say how the base "
                "computes"
            )
    return NVFP4Config(linear=None, moe=None, frozen=NVFP4FrozenConfig.like(first.config))


def nvfp4_lora_model(
    model,
    lora_config: LoraConfig,
    config: NVFP4Config | None = None,
    *,
    model_init_kwargs: dict | None = None,
) -> tuple[nn.Module, LoraConfig]:
    """:func:`nvfp4_lora` from a model id/path or a model: load it (``AutoModelForCausalLM.from_pretrained``
    with ``model_init_kwargs``), then freeze its base with ``config`` (default
    ``NVFP4Config.from_recipe(None, frozen="w4a4")``: Transformer Engine's recipe, W4A4) and register the LoRA
    layer. A model that already has NVFP4 layers keeps its plain ``nn.Linear`` layers (``config.linear`` is
    not applied). The one call a trainer needs for ``learner_precision="nvfp4"`` + ``peft_config`` (before
    ``get_peft_model``)."""
    if isinstance(model, (str, Path)):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(model), **(model_init_kwargs or {}))
    elif model_init_kwargs:
        raise ValueError(
            "nvfp4_lora_model: model_init_kwargs only apply when the model is given by name/path"
        )
    if any(isinstance(m, (NVFP4Linear, FrozenNVFP4Linear)) for m in model.modules()):
        config = None if config is None else replace(config, linear=None)
    else:
        config = config or NVFP4Config.from_recipe(None, frozen="w4a4")
    return nvfp4_lora(model, lora_config, config)


def is_adapter_key(key: str) -> bool:
    """Whether a parameter / state-dict name belongs to an adapter (LoRA or a ``modules_to_save`` copy)."""
    return any(f".{n}." in key or key.startswith(f"{n}.") for n in _ADAPTER_NAMES)


def adapter_parameters(model: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """The adapter parameters (name, tensor): LoRA's and the ``modules_to_save`` copies."""
    return [(n, p) for n, p in model.named_parameters() if is_adapter_key(n)]


def describe(model: nn.Module) -> dict[str, Any]:
    """Byte counts of a LoRA-over-NVFP4 model: base (frozen NVFP4), adapters, everything else."""
    base_bytes, base_params = base_nbytes(model)
    adapters = sum(p.numel() * p.element_size() for _, p in adapter_parameters(model))
    other = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not is_adapter_key(n))
    return {
        "base_bytes": base_bytes,
        "base_params": base_params,
        "base_bytes_per_param": base_bytes / max(base_params, 1),
        "adapter_bytes": adapters,
        "other_param_bytes": other,
    }
