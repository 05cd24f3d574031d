"""Save, merge and load LoRA-over-NVFP4 models: the PEFT adapters plus the frozen base as an NVFP4 checkpoint.

* :func:`base_state`: the base's quantized weights (bytes as they are) and its other tensors, under plain
  model names (adapters excluded, AQN noise removed);
* :func:`merged_state_dict`: a plain state dict with ``Ŵ + Σ B·A·α/r`` merged in;
* :func:`save_nvfp4_lora` / :func:`load_nvfp4_lora`: the adapters in PEFT's format and the base through the
  kernels' one NVFP4 checkpoint writer (:func:`~triage.kernels.nvfp4.export.write_nvfp4_checkpoint`) and
  loader (:func:`~triage.kernels.frozen_linear.load_nvfp4_base`), bit for bit; or one merged checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel
from peft.tuners.lora.layer import LoraLayer
from peft.utils import ModulesToSaveWrapper
from torch import nn

from triage.kernels.frozen_linear import FrozenNVFP4Linear, NVFP4FrozenConfig, load_nvfp4_base
from triage.kernels.nvfp4.export import model_config, write_nvfp4_checkpoint
from triage.kernels.nvfp4.recipe import QuantRecipe

from .aqn import AdaptiveQuantizationNoise
from .peft_nvfp4 import NVFP4LoraLinear, is_adapter_key

__all__ = ["BASE_SUBDIR", "base_state", "load_nvfp4_lora", "merged_state_dict", "save_nvfp4_lora"]

#: Where :func:`save_nvfp4_lora` writes the NVFP4 base checkpoint, inside the adapter directory.
BASE_SUBDIR = "nvfp4_base"
#: The frozen base's ``NVFP4FrozenConfig`` (compute, activation recipe, cache_expanded), saved beside the base
#: so that :func:`load_nvfp4_lora` rebuilds the same numerics without being told.
BASE_CONFIG_FILE = "triage_base_config.json"


def _unwrapped(model: nn.Module) -> nn.Module:
    return model.get_base_model() if isinstance(model, PeftModel) else model


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
        if key.startswith(tuple(frozen_prefixes)) or is_adapter_key(key):
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
        if t is not None and not is_adapter_key(k):
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
      a plain transformers checkpoint in ``dtype`` (the model's ``save_pretrained`` with the merged state
      dict: tied weights stored once, loadable with ``from_pretrained``); a layout re-quantizes the merged
      weights with :func:`~triage.kernels.nvfp4.export_nvfp4_checkpoint` (for an NVFP4 inference engine).
    """
    out = Path(out_dir)
    base = _unwrapped(model)
    config = model_config(base) if hasattr(base, "config") else None  # names the architecture
    if merged:
        state = merged_state_dict(model, dtype)
        if layout is None:
            if not hasattr(base, "save_pretrained"):
                raise TypeError(
                    f"save_nvfp4_lora(merged=True, layout=None) writes a transformers checkpoint; "
                    f"{type(base).__name__} has no save_pretrained (pass a layout for an NVFP4 checkpoint)"
                )
            base.save_pretrained(out, state_dict=state)  # transformers' writer: shards, tied weights once
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
        write_nvfp4_checkpoint(out / BASE_SUBDIR, quantized, tensors, layout=layout, config=config)
        frozen = next((m for m in base.modules() if isinstance(m, FrozenNVFP4Linear)), None)
        if frozen is not None:
            _write_frozen_config(out / BASE_SUBDIR / BASE_CONFIG_FILE, frozen.config)
    generation = getattr(base, "generation_config", None)
    if generation is not None and hasattr(generation, "save_pretrained"):
        generation.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def load_nvfp4_lora(
    model: nn.Module,
    path,
    config: NVFP4FrozenConfig | None = None,
    *,
    is_trainable: bool = False,
    adapter_name: str = "default",
) -> PeftModel:
    """Inverse of :func:`save_nvfp4_lora` (unmerged): load ``path/nvfp4_base`` into ``model`` (a skeleton of
    the architecture, e.g. ``AutoModelForCausalLM.from_config``) as frozen NVFP4 layers, then the PEFT
    adapters. Returns the ``PeftModel``. ``config`` (the frozen layers' ``NVFP4FrozenConfig``) defaults to the
    one saved with the base (compute, activation recipe, cache_expanded; backends stay "auto"), else
    ``NVFP4FrozenConfig()``."""
    path = Path(path)
    if not (path / BASE_SUBDIR).is_dir():
        raise FileNotFoundError(f"{path}: no {BASE_SUBDIR}/ (not written by save_nvfp4_lora(merged=False))")
    saved = path / BASE_SUBDIR / BASE_CONFIG_FILE
    if config is None and saved.is_file():
        config = _read_frozen_config(saved)
    load_nvfp4_base(model, path / BASE_SUBDIR, config)
    lora_config = LoraConfig.from_pretrained(str(path))
    lora_config._register_custom_module({FrozenNVFP4Linear: NVFP4LoraLinear})
    return PeftModel.from_pretrained(
        model, str(path), adapter_name=adapter_name, is_trainable=is_trainable, config=lora_config
    )


def _write_frozen_config(path: Path, config: NVFP4FrozenConfig) -> None:
    data = {
        "compute": config.compute,
        "activation": dataclasses.asdict(config.activation),
        "cache_expanded": config.cache_expanded,
    }
    path.write_text(json.dumps(data, indent=2) + "\n")


#: Aliases accepted when reading a saved frozen-base config (never written): key → alias.
_KEY_ALIASES = {"compute": "mode", "activation": "input_recipe"}


def _read_frozen_config(path: Path) -> NVFP4FrozenConfig:
    data = json.loads(path.read_text())
    fields = {}
    for key, alias in _KEY_ALIASES.items():
        if key not in data and alias not in data:
            raise ValueError(f"{path}: not a valid NVFP4 frozen-base config (no {key!r})")
        fields[key] = data[key] if key in data else data[alias]
    try:
        return NVFP4FrozenConfig(
            compute=fields["compute"],
            activation=QuantRecipe(**fields["activation"]),
            cache_expanded=bool(data.get("cache_expanded", False)),
        )
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}: not a valid NVFP4 frozen-base config ({err})") from None
