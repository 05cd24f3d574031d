"""Two TRIAGE GRPO steps of a tiny Qwen3 converted to NVFP4 + LoRA, with the built-in HF sampler."""

from __future__ import annotations

import math

import pytest
import torch
from lora_testkit import FAST, freeze
from peft import LoraConfig
from trainer_testkit import make_trainer

from triage.kernels import NVFP4Config, NVFP4FrozenConfig, NVFP4LinearConfig, convert
from triage.kernels.frozen_linear import FrozenNVFP4Linear
from triage.trainers.lora import AQNCallback, AQNConfig, load_nvfp4_lora, nvfp4_lora, save_nvfp4_lora


def _reward(completions, completion_ids, **kwargs):
    return [float(sum(ids) % 5) for ids in completion_ids]  # varies within a group: non-zero advantages


def _frozen_buffers(model) -> dict[str, torch.Tensor]:
    return {
        f"{n}.{b}": getattr(m, b)
        for n, m in model.named_modules()
        if isinstance(m, FrozenNVFP4Linear)
        for b in ("qweight", "weight_scale", "weight_scale_2")
    }


@pytest.mark.parametrize(
    "sampler_model, mode", [("shared", "w4a4"), ("copy", "w4a16")], ids=["shared-w4a4", "copy-w4a16"]
)
def test_two_grpo_steps_train_only_the_adapters(tokenizer, tmp_path, sampler_model, mode):
    from triage.trainers.tiny import build_model

    model = convert(build_model(tokenizer, seed=0), NVFP4Config(linear=NVFP4LinearConfig(**FAST)))
    model, peft_config = nvfp4_lora(
        model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"), freeze(mode)
    )
    aqn = AQNCallback(AQNConfig(num_stages=2, sigma_start=1e-2, sigma_end=1e-2))
    trainer = make_trainer(
        model,
        tmp_path / "run",
        rollout=None,
        reward=_reward,
        trainer_kwargs={"processing_class": tokenizer, "peft_config": peft_config, "callbacks": [aqn]},
        max_completion_length=6,
        learning_rate=5e-2,
        sampler="hf",
        sampler_kwargs={"sampler_model": sampler_model},
    )
    learner = trainer.model
    bytes_before = {k: v.clone() for k, v in _frozen_buffers(learner).items()}
    params_before = {n: p.detach().clone() for n, p in learner.named_parameters()}
    trainer.train()

    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) and h["triage/tokens"] > 0 for h in logs)
    assert any(h["grad_norm"] > 0 for h in logs)
    changed = {n for n, p in learner.named_parameters() if not torch.equal(params_before[n], p)}
    trainable = {n for n, p in learner.named_parameters() if p.requires_grad}
    assert changed and changed <= trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    after = _frozen_buffers(learner)
    assert all(torch.equal(after[k], v) for k, v in bytes_before.items())  # base bytes identical
    assert aqn.history == [(0, 0.0), (1, 1e-2)]  # noise-free first stage, then σ; removed after training
    sampler = trainer.rollout_func
    if sampler_model == "copy":  # a separate sampler model, but the SAME frozen NVFP4 base in memory
        copy_buffers = _frozen_buffers(sampler.copy)
        assert copy_buffers.keys() == after.keys()
        assert all(copy_buffers[k].data_ptr() == after[k].data_ptr() for k in after)
    else:
        assert sampler.copy is None

    save_nvfp4_lora(learner, tmp_path / "out")
    ids = torch.randint(3, 400, (1, 7))
    reloaded = load_nvfp4_lora(
        build_model(tokenizer, seed=1), tmp_path / "out", NVFP4FrozenConfig(compute=mode, **FAST)
    )
    learner.eval()
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, learner(ids).logits)


def _wired_trainer(tokenizer, tmp_path, lora: dict | None = None, **overrides):
    """A 1-step trainer that freezes the NVFP4 base itself (learner_precision="nvfp4" + peft_config)."""
    from triage.trainers.tiny import build_model

    lora_config = LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": "all-linear", **(lora or {})})
    args = {
        "max_steps": 1,
        "max_completion_length": 4,
        "sampler": "hf",
        "learner_precision": "nvfp4",
        **overrides,
    }
    return make_trainer(
        build_model(tokenizer, seed=0),
        tmp_path / "run",
        rollout=None,
        reward=_reward,
        trainer_kwargs={"processing_class": tokenizer, "peft_config": lora_config},
        **args,
    )


def test_trainer_wires_peft_config_on_an_nvfp4_learner(tokenizer, tmp_path):
    """`peft_config` + learner_precision="nvfp4": the trainer freezes an NVFP4 base itself (QeRL setting)."""
    trainer = _wired_trainer(
        tokenizer,
        tmp_path,
        learning_rate=5e-2,
        lora_base_mode="w4a16",
        aqn={"num_stages": 2, "sigma_start": 1e-2, "sigma_end": 1e-2},
    )
    frozen = [m for m in trainer.model.modules() if isinstance(m, FrozenNVFP4Linear)]
    assert frozen and all(m.config.compute == "w4a16" for m in frozen)
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert any(isinstance(cb, AQNCallback) for cb in trainer.callback_handler.callbacks)
    before = {k: v.clone() for k, v in _frozen_buffers(trainer.model).items()}
    trainer.train()
    after = _frozen_buffers(trainer.model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_lora_config_fields_are_validated():
    from triage.trainers import TriageGRPOConfig

    with pytest.raises(ValueError, match="lora_base_mode"):
        TriageGRPOConfig(output_dir="x", lora_base_mode="w8a8")
    with pytest.raises(ValueError, match="aqn"):
        TriageGRPOConfig(output_dir="x", aqn="{not json")


def test_trainer_quant_recipe_sets_the_frozen_base_activation_recipe_too(tokenizer, tmp_path):
    trainer = _wired_trainer(tokenizer, tmp_path, lora_base_mode="w4a4", quant_recipe={"scale": "row"})
    frozen = [m for m in trainer.model.modules() if isinstance(m, FrozenNVFP4Linear)]
    assert frozen and all(m.weight_recipe.scale == "row" for m in frozen)
    assert all(m.config.compute == "w4a4" and m.config.activation.scale == "row" for m in frozen)


def test_trainer_refuses_vllm_weight_sync_of_a_frozen_nvfp4_base(tokenizer, tmp_path):
    """TRL's vLLM sync sends named_parameters(); the frozen base lives in buffers and would never arrive."""
    with pytest.raises(ValueError, match="use_vllm=True cannot train LoRA over a frozen NVFP4 base"):
        _wired_trainer(tokenizer, tmp_path, sampler=None, use_vllm=True)


def test_trainer_refuses_dropout_when_it_would_enter_delta(tokenizer, tmp_path):
    """The learner's train-mode forward drops units, the sampler's does not: that is not engine mismatch."""
    with pytest.raises(ValueError, match="disable_dropout=True"):
        _wired_trainer(tokenizer, tmp_path, lora={"lora_dropout": 0.1})
    trainer = _wired_trainer(tokenizer, tmp_path, lora={"lora_dropout": 0.1}, disable_dropout=True)
    assert not any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in trainer.model.modules())
    _wired_trainer(  # no sampler log-probs used: dropout is the user's choice
        tokenizer, tmp_path, lora={"lora_dropout": 0.1}, correction="none", log_mismatch_metrics=False
    )
