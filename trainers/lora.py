"""LoRA over frozen NVFP4 base layers (the QeRL setting), with PEFT, for the TRIAGE trainer: the one import.

::

    model = AutoModelForCausalLM.from_pretrained(...)
    base = NVFP4Config.from_recipe(recipe, frozen="w4a4")  # Linear layers → frozen NVFP4 (no master weights)
    model, peft_config = nvfp4_lora(model, LoraConfig(r=32, target_modules="all-linear"), base)
    trainer = TriageGRPOTrainer(model=model, peft_config=peft_config, args=..., callbacks=[AQNCallback(AQNConfig())])
    ...
    save_nvfp4_lora(trainer.model, "out/")               # PEFT adapter files + the base as an NVFP4 checkpoint

The pieces live one job per module, and this module gathers their public names:

* :mod:`triage.trainers.peft_nvfp4`: ``NVFP4LoraLinear`` (PEFT's LoRA layer over a ``FrozenNVFP4Linear``),
  ``nvfp4_lora`` / ``nvfp4_lora_model`` (freeze the base, register the layer), adapter byte counts;
* :mod:`triage.trainers.aqn`: QeRL's adaptive quantization noise and its schedule (``AQNCallback``);
* :mod:`triage.trainers.lora_io`: ``save_nvfp4_lora`` / ``load_nvfp4_lora`` / ``merged_state_dict``.
"""

from __future__ import annotations

from .aqn import AdaptiveQuantizationNoise, AQNCallback, AQNConfig, aqn_sigma
from .lora_io import BASE_SUBDIR, base_state, load_nvfp4_lora, merged_state_dict, save_nvfp4_lora
from .peft_nvfp4 import NVFP4LoraLinear, adapter_parameters, describe, nvfp4_lora, nvfp4_lora_model

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
