"""LoRA over frozen NVFP4 base layers (the QeRL setting), with PEFT, for the TRIAGE trainer.

::

    model = AutoModelForCausalLM.from_pretrained(...)
    convert_to_nvfp4(model, recipe)                      # NVFP4Linear layers (master weights)
    model, peft_config = nvfp4_lora(model, LoraConfig(r=32, target_modules="all-linear"))
    trainer = TriageGRPOTrainer(model=model, peft_config=peft_config, args=..., callbacks=[AQNCallback(AQNConfig())])
    ...
    save_nvfp4_lora(trainer.model, "out/")               # PEFT adapter files + the base as an NVFP4 checkpoint

:func:`nvfp4_lora` freezes every ``NVFP4Linear`` into a :class:`~triage.kernels.lora.FrozenNVFP4Linear`
(only the quantized weight is kept: ~0.56 byte per base parameter, no master copy) and registers
:class:`NVFP4LoraLinear` as PEFT's LoRA layer for it (``LoraConfig._register_custom_module``), so PEFT's
``get_peft_model`` — which TRL's trainer calls when given ``peft_config`` — wraps the frozen layers. The LoRA
forward is PEFT's own: ``y = base(x) + B·A·dropout(x)·α/r``, the adapters in their own dtype (fp32 by PEFT's
default). Only ``lora_A`` / ``lora_B`` train; the base receives no gradient and its bytes never change.

Sampler and learner share the base: the built-in ``HFSampler`` samples with the trainer's own model by default
(``sampler_model="shared"``); with ``sampler_model="copy"`` the deep copy shares the frozen bytes too (see
``FrozenNVFP4Linear.__deepcopy__``), so only the adapters are duplicated. The mismatch left between sampler
and learner is the adapters' precision (if the copy casts them) and the kernels' paths (decode vs full
sequence).

Adaptive quantization noise (AQN; QeRL, Huang et al. 2025, arXiv:2510.11696, §3.3): channel-wise Gaussian
noise ``Z ~ N(0, σ²I)`` folded into the RMSNorm scales that feed the quantized projections,
``w_noise = w + Z`` (Eq. 10), so that ``RMSNorm_noise(x)·Ŵᵀ = RMSNorm(x)·(diag(1 + Z/w)·Ŵ)ᵀ`` perturbs every
row of the frozen weight multiplicatively without touching the NVFP4 bytes. σ follows the exponential
schedule of Eq. 8 over K evenly spaced stages k = 0…K−1 of training: the first stage carries the
quantization noise only (σ = 0), as in the paper, and the K−1 noisy stages follow
``σ(k) = σ_start·(σ_end/σ_start)^((k−1)/(K−2))`` (``k/(K−1)`` with ``quant_noise_first_stage=False``). Off by default
(add :class:`AQNCallback`).
"""

from __future__ import annotations

import fnmatch
import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from peft.tuners.lora.layer import LoraLayer
from peft.tuners.tuners_utils import check_adapters_to_merge
from peft.utils import ModulesToSaveWrapper
from torch import nn
from transformers import TrainerCallback

from triage.kernels.lora import (
    FrozenNVFP4Linear,
    NVFP4BaseConfig,
    freeze_nvfp4_base,
    load_nvfp4_base,
    write_nvfp4_base,
)
from triage.kernels.nvfp4.export import model_config
from triage.kernels.nvfp4.recipe import QuantRecipe

__all__ = [
    "BASE_SUBDIR",
    "AQNCallback",
    "AQNConfig",
    "AdaptiveQuantizationNoise",
    "NVFP4LoraLinear",
    "adapter_parameters",
    "aqn_sigma",
    "base_state",
    "describe",
    "load_nvfp4_lora",
    "merged_state_dict",
    "nvfp4_lora",
    "nvfp4_lora_model",
    "save_nvfp4_lora",
]

#: Where :func:`save_nvfp4_lora` writes the NVFP4 base checkpoint, inside the adapter directory.
BASE_SUBDIR = "nvfp4_base"
#: The frozen base's compute settings (mode, activation recipe), saved beside the base so that
#: :func:`load_nvfp4_lora` rebuilds the same numerics without being told.
BASE_CONFIG_FILE = "triage_base_config.json"
#: ``init_lora_weights`` values that do not read the base weight (the others need a dense one).
_PLAIN_INITS = (True, False, "gaussian")


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
    model: nn.Module,
    lora_config: LoraConfig,
    base_config: NVFP4BaseConfig | None = None,
    *,
    quantize_linear: bool = False,
    recipe: QuantRecipe | None = None,
) -> tuple[nn.Module, LoraConfig]:
    """Freeze the NVFP4 base of ``model`` and make ``lora_config`` wrap it; returns ``(model, lora_config)``.

    Every ``NVFP4Linear`` (from ``convert_to_nvfp4``) becomes a ``FrozenNVFP4Linear`` holding its ``W_q``
    only (``base_config``: ``mode="w4a4"`` — the same forward — or ``"w4a16"``, see ``NVFP4BaseConfig``);
    ``quantize_linear=True`` also quantizes plain ``nn.Linear`` layers (lm_head/embeddings skipped) with
    ``recipe``. ``lora_config`` (modified in place and returned) gets the custom-module registration; pass
    both to ``TriageGRPOTrainer(model=model, peft_config=lora_config)`` or ``peft.get_peft_model``.
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
    freeze_nvfp4_base(model, base_config, quantize_linear=quantize_linear, recipe=recipe)
    frozen = [n for n, m in model.named_modules() if isinstance(m, FrozenNVFP4Linear)]
    if not frozen:
        raise ValueError(
            "nvfp4_lora: the model has no NVFP4 layer; convert it first (triage.kernels.convert_to_nvfp4) or "
            "pass quantize_linear=True"
        )
    if base_config is not None:
        for n, m in model.named_modules():
            if isinstance(m, FrozenNVFP4Linear) and m.config != base_config:
                raise ValueError(f"nvfp4_lora: layer {n!r} was frozen earlier with another NVFP4BaseConfig")
    if isinstance(lora_config.target_modules, str) and lora_config.target_modules == "all-linear":
        # PEFT resolves "all-linear" to nn.Linear modules only; here it means every frozen NVFP4 layer.
        lora_config.target_modules = {n.rsplit(".", 1)[-1] for n in frozen}
    lora_config._register_custom_module({FrozenNVFP4Linear: NVFP4LoraLinear})
    return model, lora_config


def nvfp4_lora_model(
    model,
    lora_config: LoraConfig,
    *,
    quant_recipe=None,
    base_config: NVFP4BaseConfig | None = None,
    model_init_kwargs: dict | None = None,
) -> tuple[nn.Module, LoraConfig]:
    """:func:`nvfp4_lora` from a model id/path or a model: load it (``AutoModelForCausalLM.from_pretrained``
    with ``model_init_kwargs``), convert its Linear layers with ``convert_to_nvfp4(model, quant_recipe)``
    (a ``QuantRecipe``, an ``NVFP4LinearConfig`` or None)
    unless it already has NVFP4 layers, then freeze the base and register the LoRA layer. The one call a
    trainer needs for ``learner_precision="nvfp4"`` + ``peft_config`` (before ``get_peft_model``)."""
    from triage.kernels import NVFP4Linear, convert_to_nvfp4

    if isinstance(model, (str, Path)):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(model), **(model_init_kwargs or {}))
    elif model_init_kwargs:
        raise ValueError(
            "nvfp4_lora_model: model_init_kwargs only apply when the model is given by name/path"
        )
    if not any(isinstance(m, (NVFP4Linear, FrozenNVFP4Linear)) for m in model.modules()):
        convert_to_nvfp4(model, quant_recipe)
    return nvfp4_lora(model, lora_config, base_config)


# ------------------------------------------------------------------------------------------------------ AQN


@dataclass(frozen=True)
class AQNConfig:
    """QeRL's adaptive quantization noise (module docstring). Defaults: §3.3 of the paper (σ_start = 1e-2,
    10 stages); σ_end = 1e-4 keeps the 100× range of their §4.1 (5e-2 → 5e-4).

    Attributes:
        sigma_start / sigma_end: noise std of the first / last noisy stage (> 0).
        num_stages: K, stages evenly dividing the training steps.
        quant_noise_first_stage: the first stage adds no noise (the quantization noise alone), as in QeRL.
        targets: fnmatch patterns of the RMSNorm modules whose scale carries the noise: those in front of
            q/k/v and gate/up (QeRL Fig. 6).
        seed: the noise of step s is drawn from ``seed + s`` (same on every process).
    """

    sigma_start: float = 1e-2
    sigma_end: float = 1e-4
    num_stages: int = 10
    quant_noise_first_stage: bool = True
    targets: tuple[str, ...] = ("*input_layernorm", "*post_attention_layernorm")
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.targets, list):  # from YAML / JSON
            object.__setattr__(self, "targets", tuple(self.targets))
        for name in ("sigma_start", "sigma_end"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"AQNConfig.{name} must be finite and > 0 (exponential schedule), got {v!r}")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"AQNConfig.num_stages must be an int >= 1, got {self.num_stages!r}")
        if self.quant_noise_first_stage and self.num_stages < 2:
            raise ValueError(
                "AQNConfig: quant_noise_first_stage=True needs num_stages >= 2 (else no noisy stage)"
            )
        if isinstance(self.targets, str) or not self.targets:
            raise ValueError(f"AQNConfig.targets must be a non-empty tuple of patterns, got {self.targets!r}")


def aqn_sigma(step: int, total_steps: int, config: AQNConfig) -> float:
    """σ at optimizer step ``step`` of ``total_steps``: stage k = ⌊step·K/total⌋ (clamped to K−1), then
    QeRL Eq. 8 over the noisy stages (stage 0 is noise-free when ``quant_noise_first_stage``)."""
    if total_steps < 1:
        raise ValueError(f"aqn_sigma: total_steps must be >= 1, got {total_steps}")
    if step < 0:
        raise ValueError(f"aqn_sigma: step must be >= 0, got {step}")
    k_total = config.num_stages
    stage = min(k_total - 1, step * k_total // total_steps)
    if config.quant_noise_first_stage:
        if stage == 0:
            return 0.0
        stage, k_total = stage - 1, k_total - 1
    if k_total == 1:
        return float(config.sigma_start)
    ratio = config.sigma_end / config.sigma_start
    return float(config.sigma_start * ratio ** (stage / (k_total - 1)))


class AdaptiveQuantizationNoise:
    """Folds ``σ·ε`` (ε ~ N(0, I) per channel, fresh each :meth:`apply`) into the target RMSNorm weights.

    The clean weights are kept (``aqn_clean_weight``, a non-persistent buffer on each norm) so that
    :meth:`remove` restores them bit for bit and the exports write them. The norm weights must be frozen
    (an optimizer update on a noisy weight would be lost at the next resample).

    Floor: the noise is folded in the norm weights' own dtype, so a perturbation below half an ulp of ``w``
    rounds away (bf16, ``|w| ≈ 1``: half an ulp is 2⁻⁸ ≈ 3.9e-3, and σ ≲ 1e-3 leaves almost nothing).
    :meth:`apply` measures the realised std of ``w_noise − w`` after the cast and warns (once per σ) when
    it is below half the requested σ.
    """

    BUFFER = "aqn_clean_weight"

    def __init__(self, config: AQNConfig | None = None):
        self.config = config or AQNConfig()
        self.norms: list[tuple[str, nn.Module]] = []
        self.sigma = 0.0
        self._warned: set[float] = set()

    def attach(self, model: nn.Module) -> AdaptiveQuantizationNoise:
        self.norms = [
            (n, m)
            for n, m in model.named_modules()
            if any(fnmatch.fnmatchcase(n, p) for p in self.config.targets)
        ]
        if not self.norms:
            raise ValueError(f"AQN: no module of the model matches {self.config.targets}")
        for name, m in self.norms:
            w = getattr(m, "weight", None)
            if not isinstance(w, torch.Tensor) or w.dim() != 1:
                raise ValueError(
                    f"AQN: {name!r} has no 1-D weight (not an RMSNorm scale); fix AQNConfig.targets"
                )
            if w.requires_grad:
                raise ValueError(
                    f"AQN: {name!r}.weight is trainable; the noise is folded into it, so it must be frozen"
                )
            if getattr(m, self.BUFFER, None) is None:
                m.register_buffer(self.BUFFER, w.detach().clone(), persistent=False)
        return self

    @torch.no_grad()
    def apply(self, step: int, total_steps: int) -> float:
        """Set every target weight to ``clean + σ(step)·ε``; returns σ."""
        if not self.norms:
            raise RuntimeError("AQN.apply before attach(model)")
        self.sigma = aqn_sigma(step, total_steps, self.config)
        gen = torch.Generator().manual_seed(self.config.seed + int(step))
        realised = []
        for _, m in self.norms:
            clean = getattr(m, self.BUFFER)
            if self.sigma == 0.0:
                m.weight.copy_(clean)
                continue
            eps = torch.randn(clean.shape, generator=gen, dtype=torch.float32).to(clean.device)
            m.weight.copy_((clean.float() + self.sigma * eps).to(clean.dtype))
            realised.append((m.weight.float() - clean.float()).flatten())
        if realised and self.sigma not in self._warned:
            std = torch.cat(realised).std(correction=0).item()
            if std < 0.5 * self.sigma:
                self._warned.add(self.sigma)
                warnings.warn(
                    f"AQN: realised noise std {std:.3g} for the requested sigma {self.sigma:.3g}: the noise is "
                    f"below the resolution of the norm weights' dtype ({self.norms[0][1].weight.dtype}; half an "
                    "ulp of |w|) and rounds away; use a larger sigma or keep the norm weights in float32",
                    stacklevel=2,
                )
        return self.sigma

    @torch.no_grad()
    def remove(self) -> None:
        """Restore the clean weights and drop the saved copies."""
        for _, m in self.norms:
            clean = getattr(m, self.BUFFER, None)
            if clean is not None:
                m.weight.copy_(clean)
                delattr(m, self.BUFFER)
        self.norms = []
        self.sigma = 0.0


class AQNCallback(TrainerCallback):
    """Trainer callback running :class:`AdaptiveQuantizationNoise` over ``max_steps``.

    The noise is resampled at the optimizer steps that start a generation (GRPO: every
    ``steps_per_generation × num_iterations`` micro-batches), so the sampler's rollout and the learner's
    forward/backward on it see the same perturbed policy — the noise never enters δ. (Resampling per forward,
    as QeRL's Eq. 7 reads, would add it to the measured engine mismatch.) The windows are those of the whole
    run (micro-step ``global_step × gradient_accumulation_steps``): a run resumed inside a window trains on
    the window's saved rollouts (``TriageGRPOTrainer`` restores them), so it folds the noise of the window's
    first step, that of the uninterrupted run. ``history`` records (step, σ) at every fold.
    """

    def __init__(self, config: AQNConfig | None = None):
        self.noise = AdaptiveQuantizationNoise(config)
        self.history: list[tuple[int, float]] = []
        self._window: int | None = None  # the first step of the window whose noise is folded in

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise ValueError("AQNCallback needs the trainer's model")
        self.noise.attach(model)
        self._window = None

    def on_step_begin(self, args, state, control, **kwargs):
        every = int(getattr(args, "steps_per_generation", None) or 1) * int(
            getattr(args, "num_iterations", 1) or 1
        )
        window = state.global_step  # the last optimizer step <= this one that starts a generation
        while (window * args.gradient_accumulation_steps) % every:
            window -= 1
        if window != self._window:
            sigma = self.noise.apply(window, max(state.max_steps, 1))
            self._window = window
            self.history.append((state.global_step, sigma))

    def on_train_end(self, args, state, control, **kwargs):
        self.noise.remove()


# --------------------------------------------------------------------------------------------- export


def _unwrapped(model: nn.Module) -> nn.Module:
    return model.get_base_model() if isinstance(model, PeftModel) else model


#: State-dict name parts of adapter tensors: LoRA's and PEFT's ``modules_to_save`` copies.
_ADAPTER_NAMES = (*PeftLoraLinear.adapter_layer_names, *ModulesToSaveWrapper.adapter_layer_names)


def _is_adapter_key(key: str) -> bool:
    return any(f".{n}." in key or key.startswith(f"{n}.") for n in _ADAPTER_NAMES)


def _clean_key(name: str) -> str:
    """The plain model name of a PEFT-wrapped module/tensor name (LoRA ``base_layer``, ``modules_to_save``'s
    ``original_module``)."""
    for wrapper in (".base_layer", ".original_module"):
        name = name.replace(f"{wrapper}.", ".").removesuffix(wrapper)
    return name


def base_state(model: nn.Module) -> tuple[dict, dict]:
    """``(quantized, tensors)`` of a (PEFT) model's base under plain model names: ``{"<m>.weight":
    NVFP4Tensor}`` for the frozen NVFP4 layers and ``{name: tensor}`` for everything else, adapters excluded
    (``modules_to_save``: the original module), AQN noise removed (clean norm weights)."""
    base = _unwrapped(model)
    quantized: dict = {}
    tensors: dict[str, torch.Tensor] = {}
    frozen_prefixes = []
    for name, m in base.named_modules():
        if isinstance(m, FrozenNVFP4Linear):
            clean = _clean_key(name)
            quantized[f"{clean}.weight"] = m.quantized_weight()
            if m.bias is not None:
                tensors[f"{clean}.bias"] = m.bias
            frozen_prefixes.append(f"{name}.")
    clean_norms = {
        f"{n}.weight": getattr(m, AdaptiveQuantizationNoise.BUFFER)
        for n, m in base.named_modules()
        if getattr(m, AdaptiveQuantizationNoise.BUFFER, None) is not None
    }
    for key, t in base.state_dict().items():
        if key.startswith(tuple(frozen_prefixes)) or _is_adapter_key(key):
            continue
        tensors[_clean_key(key)] = clean_norms.get(key, t)
    return quantized, tensors


@torch.no_grad()
def merged_state_dict(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """A plain state dict with the active adapters merged, under plain model names.

    Every PEFT LoRA layer (over a frozen NVFP4 base or a high-precision one, e.g. a layer skipped from
    conversion) gets ``W = W_base + Σ B·A·α/r`` and, with ``lora_bias``, ``b = b_base + Σ b_B·α/r`` (fp32,
    then ``dtype``, default the base tensor's dtype); the active ``modules_to_save`` copies replace their
    originals; other frozen NVFP4 layers are dequantized; everything else as in :func:`base_state`. Raises
    ``ValueError`` for what a plain checkpoint of the architecture cannot hold: ``lora_bias`` on a layer
    without a bias, or an adapted tensor tied to another one (e.g. ``lm_head`` with tied embeddings).
    """
    base = _unwrapped(model)
    quantized, tensors = base_state(model)
    out = dict(tensors)
    for key, q in quantized.items():
        out[key] = q.dequantize(torch.float32).to(dtype or q.dtype)
    merged: set[str] = set()
    for name, m in base.named_modules():
        prefix = _clean_key(name)
        if isinstance(m, ModulesToSaveWrapper):
            active = m.active_adapters
            if m.disable_adapters or not active or active[0] not in m.modules_to_save:
                continue
            for k, t in m.modules_to_save[active[0]].state_dict().items():
                out[f"{prefix}.{k}"] = t
                merged.add(f"{prefix}.{k}")
            continue
        if not isinstance(m, LoraLayer) or m.disable_adapters or m.merged:
            continue
        adapters = [a for a in m.active_adapters if a in m.lora_A or a in m.lora_embedding_A]
        if not adapters:
            continue
        key = f"{prefix}.weight"
        q = quantized.get(key)
        w = q.dequantize(torch.float32) if q is not None else tensors[key].float()
        for a in adapters:
            w = w + m.get_delta_weight(a).float()
        out[key] = w.to(dtype or (q.dtype if q is not None else tensors[key].dtype))
        merged.add(key)
        biased = [a for a in adapters if m.lora_bias.get(a)]
        if biased:
            bkey = f"{prefix}.bias"
            if bkey not in tensors:
                raise ValueError(
                    f"merged_state_dict: {prefix!r} has an adapter with lora_bias=True but no base bias, so a "
                    "merged checkpoint of this architecture cannot hold it; save it unmerged"
                )
            b = tensors[bkey].float()
            for a in biased:
                b = b + m.lora_B[a].bias.float() * m.scaling[a]
            out[bkey] = b.to(dtype or tensors[bkey].dtype)
            merged.add(bkey)
    aliases: dict[int, list[str]] = {}
    for k, t in base.state_dict(keep_vars=True).items():
        if t is not None and not _is_adapter_key(k):
            aliases.setdefault(id(t), []).append(_clean_key(k))
    for group in aliases.values():
        if len(group) > 1 and merged.intersection(group) and not merged.issuperset(group):
            raise ValueError(
                f"merged_state_dict: {sorted(group)} are tied, and the adapters change only "
                f"{sorted(merged.intersection(group))}; a merged checkpoint of the tied architecture cannot hold "
                "that (untie the weights before training, or save unmerged)"
            )
    return out


def save_nvfp4_lora(
    model: nn.Module,
    out_dir,
    *,
    merged: bool = False,
    layout: str | None = "modelopt",
    tokenizer=None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Save a LoRA-over-NVFP4 model.

    * ``merged=False``: the adapters in PEFT's format (``model.save_pretrained``: ``adapter_config.json`` +
      ``adapter_model.safetensors``) and the base, bit for bit, as an NVFP4 checkpoint in
      ``out_dir/nvfp4_base`` (``layout`` "modelopt" or "compressed-tensors"; :func:`load_nvfp4_lora` reads both).
    * ``merged=True``: one full checkpoint with ``Ŵ + ΔW`` (:func:`merged_state_dict`): ``layout=None`` writes
      plain safetensors in ``dtype`` (loadable with ``from_pretrained``); a layout re-quantizes the merged
      weights with :func:`~triage.kernels.nvfp4.export_nvfp4_checkpoint` (for an NVFP4 inference engine).
    """
    out = Path(out_dir)
    base = _unwrapped(model)
    config = model_config(base) if hasattr(base, "config") else None  # names the architecture
    if merged:
        state = merged_state_dict(model, dtype)
        if layout is None:
            from safetensors.torch import save_file

            out.mkdir(parents=True, exist_ok=True)
            save_file(_unshared(state), str(out / "model.safetensors"), metadata={"format": "pt"})
            if config is not None:
                config.save_pretrained(out)
        else:
            from triage.kernels.nvfp4 import export_nvfp4_checkpoint

            export_nvfp4_checkpoint(state, out, layout=layout, config=config)
    else:
        if not isinstance(model, PeftModel):
            raise TypeError(
                "save_nvfp4_lora(merged=False) needs a PeftModel (the adapters are saved in PEFT's format)"
            )
        if layout is None:
            raise ValueError(
                "save_nvfp4_lora(merged=False): the base is written in an NVFP4 layout; layout=None"
            )
        model.save_pretrained(out)
        quantized, tensors = base_state(model)
        write_nvfp4_base(out / BASE_SUBDIR, quantized, tensors, layout=layout, config=config)
        frozen = next((m for m in base.modules() if isinstance(m, FrozenNVFP4Linear)), None)
        if frozen is not None:
            _write_base_config(out / BASE_SUBDIR / BASE_CONFIG_FILE, frozen.config)
    generation = getattr(base, "generation_config", None)
    if generation is not None and hasattr(generation, "save_pretrained"):
        generation.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def _unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    seen: set[int] = set()
    out = {}
    for k, t in state.items():
        t = t.detach().cpu()
        ptr = t.untyped_storage().data_ptr()
        out[k] = t.clone() if ptr in seen or not t.is_contiguous() else t
        seen.add(ptr)
    return out


def load_nvfp4_lora(
    model: nn.Module,
    path,
    base_config: NVFP4BaseConfig | None = None,
    *,
    is_trainable: bool = False,
    adapter_name: str = "default",
) -> PeftModel:
    """Inverse of :func:`save_nvfp4_lora` (unmerged): load ``path/nvfp4_base`` into ``model`` (a skeleton of
    the architecture, e.g. ``AutoModelForCausalLM.from_config``) as frozen NVFP4 layers, then the PEFT
    adapters. Returns the ``PeftModel``. ``base_config`` defaults to the one saved with the base (mode and
    activation recipe; Triton/torch backends stay "auto"), else ``NVFP4BaseConfig()``."""
    path = Path(path)
    if not (path / BASE_SUBDIR).is_dir():
        raise FileNotFoundError(f"{path}: no {BASE_SUBDIR}/ (not written by save_nvfp4_lora(merged=False))")
    saved = path / BASE_SUBDIR / BASE_CONFIG_FILE
    if base_config is None and saved.is_file():
        base_config = _read_base_config(saved)
    load_nvfp4_base(model, path / BASE_SUBDIR, base_config)
    config = LoraConfig.from_pretrained(str(path))
    config._register_custom_module({FrozenNVFP4Linear: NVFP4LoraLinear})
    return PeftModel.from_pretrained(
        model, str(path), adapter_name=adapter_name, is_trainable=is_trainable, config=config
    )


def _write_base_config(path: Path, config: NVFP4BaseConfig) -> None:
    import dataclasses
    import json

    recipe = dataclasses.asdict(config.input_recipe)
    data = {"mode": config.mode, "input_recipe": recipe, "cache_expanded": config.cache_expanded}
    path.write_text(json.dumps(data, indent=2) + "\n")


def _read_base_config(path: Path) -> NVFP4BaseConfig:
    import json

    data = json.loads(path.read_text())
    try:
        return NVFP4BaseConfig(
            mode=data["mode"],
            input_recipe=QuantRecipe(**data["input_recipe"]),
            cache_expanded=bool(data.get("cache_expanded", False)),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{path}: not a valid NVFP4 base config ({err})") from None


def adapter_parameters(model: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """The adapter parameters (name, tensor): LoRA's and the ``modules_to_save`` copies."""
    return [(n, p) for n, p in model.named_parameters() if _is_adapter_key(n)]


def describe(model: nn.Module) -> dict[str, Any]:
    """Byte counts of a LoRA-over-NVFP4 model: base (frozen NVFP4), adapters, everything else."""
    from triage.kernels.lora import base_nbytes

    base_bytes, base_params = base_nbytes(model)
    adapters = sum(p.numel() * p.element_size() for _, p in adapter_parameters(model))
    other = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not _is_adapter_key(n))
    return {
        "base_bytes": base_bytes,
        "base_params": base_params,
        "base_bytes_per_param": base_bytes / max(base_params, 1),
        "adapter_bytes": adapters,
        "other_param_bytes": other,
    }
