"""PEFT LoRA over frozen NVFP4 layers: what trains, merge/unmerge, export/import round trips, AQN."""

from __future__ import annotations

import copy
import dataclasses
import warnings
import zlib
from types import SimpleNamespace

import pytest
import torch
from lora_testkit import FAST, freeze
from peft import LoraConfig, get_peft_model

from triage.kernels import NVFP4FrozenConfig
from triage.kernels.frozen_linear import FrozenNVFP4Linear
from triage.kernels.nvfp4 import load_nvfp4_checkpoint
from triage.trainers.aqn import AdaptiveQuantizationNoise, AQNCallback, AQNConfig, aqn_sigma
from triage.trainers.lora_io import BASE_SUBDIR, load_nvfp4_lora, merged_state_dict, save_nvfp4_lora
from triage.trainers.peft_nvfp4 import NVFP4LoraLinear, adapter_parameters, describe, nvfp4_lora


def _lora(model, mode="w4a4", **lora):
    cfg = LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": "all-linear", **lora})
    model, cfg = nvfp4_lora(model, cfg, freeze(mode))
    torch.manual_seed(0)  # lora_A's init: the same adapters whatever ran before
    peft_model = get_peft_model(model, cfg)
    with (
        torch.no_grad()
    ):  # non-zero B so that the adapters change the output (crc32: stable across processes)
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
    return peft_model


def _on_reference_kernels(model):
    """``model``'s frozen layers, loaded without a config, switched to the torch reference kernels: the saved
    base config keeps no backends (they load as "auto": the Triton kernels, interpreted on CPU), so the
    logits comparison checks the restored numerics (compute, activation recipe) and not the backend. The
    Triton paths of ``FrozenNVFP4Linear`` are checked against the reference in test_frozen_base.py."""
    frozen = [m for m in model.modules() if isinstance(m, FrozenNVFP4Linear)]
    assert frozen and all(m.config.gemm_backend == m.config.quant_backend == "auto" for m in frozen)
    for m in frozen:
        m.config = dataclasses.replace(m.config, **FAST)
    return model


def _base_bytes(model) -> dict[str, bytes]:
    return {
        f"{n}.{b}": getattr(m, b).cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
        for n, m in model.named_modules()
        if isinstance(m, FrozenNVFP4Linear)
        for b in ("qweight", "weight_scale", "weight_scale_2")
    }


def test_only_adapters_train_and_the_base_bytes_do_not_change(nvfp4_model):
    model = _lora(nvfp4_model)
    assert all(
        isinstance(m.base_layer, FrozenNVFP4Linear) for m in model.modules() if isinstance(m, NVFP4LoraLinear)
    )
    assert sum(isinstance(m, NVFP4LoraLinear) for m in model.modules()) == 14  # 7 projections × 2 layers
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and trainable == [n for n, _ in adapter_parameters(model)]
    info = describe(model)
    assert info["base_bytes_per_param"] == pytest.approx(0.5625, abs=2e-3)
    before_bytes = _base_bytes(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ids = torch.randint(3, 400, (2, 10))
    loss = model(ids, labels=ids).loss
    loss.backward()
    first_a = model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight
    assert (
        first_a.grad is not None and first_a.grad.abs().sum() > 0
    )  # dx flowed back through the frozen bases
    opt.step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(before[n], p)}
    assert changed == set(trainable)
    assert _base_bytes(model) == before_bytes


def test_merge_requantizes_and_unmerge_restores_the_exact_bytes(nvfp4_model):
    model = _lora(nvfp4_model, mode="w4a16")
    ids = torch.randint(3, 400, (2, 7), generator=torch.Generator().manual_seed(1))
    before_bytes = _base_bytes(model)
    with torch.no_grad():
        y = model(ids).logits
        model.merge_adapter()
        merged = model(ids).logits
        model.unmerge_adapter()
        again = model(ids).logits
    assert _base_bytes(model) == before_bytes and torch.equal(again, y)
    # the merged layer is Q(Ŵ + ΔW): close to the unmerged output, not equal (a new rounding)
    rel = float((merged - y).abs().max() / y.abs().max())
    assert 0 < rel < 0.25, rel


@pytest.mark.parametrize("layout", ["modelopt", "compressed-tensors"])
def test_unmerged_save_load_round_trip_is_bit_exact(nvfp4_model, tokenizer, tmp_path, layout):
    from triage.trainers.tiny import build_model

    model = _lora(nvfp4_model)
    noise = AdaptiveQuantizationNoise(AQNConfig(num_stages=2)).attach(model)
    noise.apply(1, 2)  # the export must write the clean norm weights, not the noisy ones
    ids = torch.randint(3, 400, (2, 9))
    save_nvfp4_lora(model, tmp_path, layout=layout, tokenizer=tokenizer)
    assert (tmp_path / "adapter_config.json").is_file() and (tmp_path / "adapter_model.safetensors").is_file()
    stored = load_nvfp4_checkpoint(tmp_path / BASE_SUBDIR)
    frozen = model.base_model.model.model.layers[1].mlp.up_proj.base_layer
    t = stored["model.layers.1.mlp.up_proj.weight"]
    assert torch.equal(t.data, frozen.qweight) and torch.equal(
        t.global_scale.reshape(()), frozen.weight_scale_2.reshape(())
    )
    noise.remove()
    with torch.no_grad():
        y = model(ids).logits
    loaded = load_nvfp4_lora(build_model(tokenizer, seed=3), tmp_path, NVFP4FrozenConfig(**FAST))
    assert _base_bytes(loaded) == _base_bytes(model)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, y)


def test_merged_exports_plain_and_requantized(nvfp4_model, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = _lora(nvfp4_model, mode="w4a16")
    ids = torch.randint(3, 400, (1, 8))
    state = merged_state_dict(model)
    q = model.base_model.model.model.layers[0].self_attn.o_proj
    expect = q.base_layer.dequantized_weight(torch.float32) + q.get_delta_weight("default")
    assert torch.equal(state["model.layers.0.self_attn.o_proj.weight"], expect)
    save_nvfp4_lora(model, tmp_path / "plain", merged=True, layout=None)
    with safe_open(str(tmp_path / "plain" / "model.safetensors"), "pt") as f:  # what engines read a tied
        assert "model.embed_tokens.weight" in f.keys()  # embedding from (transformers drops lm_head)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "plain")
    with torch.no_grad():  # fp32 activations: the weight-only forward of Ŵ + ΔW, up to fp32 rounding
        torch.testing.assert_close(plain(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)
    save_nvfp4_lora(model, tmp_path / "nvfp4", merged=True, layout="modelopt")
    assert "model.layers.0.self_attn.o_proj.weight" in load_nvfp4_checkpoint(tmp_path / "nvfp4")


def test_saved_checkpoints_name_the_architecture_and_replace_an_earlier_export(
    nvfp4_model, tokenizer, tmp_path
):
    """vLLM needs config.json's architectures; a base written over an earlier (sharded) export is read back
    as written, not through the earlier index."""
    import json

    from triage.kernels.nvfp4 import export_nvfp4_checkpoint
    from triage.trainers.tiny import build_model

    model = _lora(nvfp4_model, mode="w4a16")
    assert model.base_model.model.config.architectures is None  # built, never saved
    export_nvfp4_checkpoint(build_model(tokenizer, seed=8), tmp_path / BASE_SUBDIR, max_shard_bytes=20_000)
    save_nvfp4_lora(model, tmp_path)
    assert not (tmp_path / BASE_SUBDIR / "model.safetensors.index.json").exists()
    assert _base_bytes(
        load_nvfp4_lora(build_model(tokenizer, seed=3), tmp_path, NVFP4FrozenConfig(**FAST))
    ) == (_base_bytes(model))
    save_nvfp4_lora(model, tmp_path / "nvfp4", merged=True, layout="compressed-tensors")
    save_nvfp4_lora(model, tmp_path / "plain", merged=True, layout=None)
    for folder in (tmp_path / BASE_SUBDIR, tmp_path / "nvfp4", tmp_path / "plain"):
        assert json.loads((folder / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"], (
            folder
        )


def test_bad_configurations_are_refused(nvfp4_model, tokenizer):
    from triage.trainers.tiny import build_model

    with pytest.raises(ValueError, match="DoRA"):
        nvfp4_lora(nvfp4_model, LoraConfig(use_dora=True, target_modules="all-linear"))
    with pytest.raises(ValueError, match="pissa"):
        nvfp4_lora(nvfp4_model, LoraConfig(init_lora_weights="pissa", target_modules="all-linear"))
    with pytest.raises(ValueError, match="no NVFP4 layer"):
        nvfp4_lora(build_model(tokenizer), LoraConfig(target_modules="all-linear"))
    with pytest.raises(TypeError, match="merged=False\\) needs a PeftModel"):
        save_nvfp4_lora(nvfp4_model, "/nonexistent")


def test_without_a_config_the_nvfp4_layers_freeze_as_they_compute(nvfp4_model):
    from triage.kernels import NVFP4Config, NVFP4Linear, NVFP4LinearConfig

    ids = torch.randint(3, 400, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = nvfp4_model(ids).logits
    mixed = copy.deepcopy(nvfp4_model)
    model, _ = nvfp4_lora(nvfp4_model, LoraConfig(target_modules="all-linear"))
    frozen = [m for m in model.modules() if isinstance(m, FrozenNVFP4Linear)]
    assert len(frozen) == 14 and all(m.config == NVFP4FrozenConfig(**FAST) for m in frozen)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    q = mixed.model.layers[1].self_attn.q_proj
    mixed.model.layers[1].self_attn.q_proj = NVFP4Linear.from_linear(q, NVFP4LinearConfig())
    with pytest.raises(
        ValueError, match=r"'model.layers.0.self_attn.q_proj' and 'model.layers.1.self_attn.q_proj'"
    ):
        nvfp4_lora(mixed, LoraConfig(target_modules="all-linear"))
    with pytest.raises(ValueError, match="config.frozen is None"):
        nvfp4_lora(mixed, LoraConfig(target_modules="all-linear"), NVFP4Config())


def test_aqn_schedule_is_qerl_eq8_with_a_noise_free_first_stage():
    cfg = AQNConfig(sigma_start=1e-2, sigma_end=1e-4, num_stages=5)
    sigmas = [aqn_sigma(s, 100, cfg) for s in range(0, 100, 20)]
    # stage 0: quantization noise only; stages 1..4: 1e-2 · (1e-2)^((k-1)/3)
    expect = [0.0] + [1e-2 * (1e-2) ** (j / 3) for j in range(4)]
    assert sigmas == pytest.approx(expect, rel=1e-12)
    assert aqn_sigma(99, 100, cfg) == pytest.approx(1e-4) and aqn_sigma(500, 100, cfg) == pytest.approx(1e-4)
    plain = AQNConfig(num_stages=3, quant_noise_first_stage=False)
    assert [aqn_sigma(s, 3, plain) for s in range(3)] == pytest.approx([1e-2, 1e-3, 1e-4])
    with pytest.raises(ValueError, match="sigma_end"):
        AQNConfig(sigma_end=0.0)
    with pytest.raises(ValueError, match="num_stages >= 2"):
        AQNConfig(num_stages=1)


def test_aqn_folds_channel_noise_into_the_norms_and_restores_them_exactly(nvfp4_model):
    model = _lora(nvfp4_model)
    norms = {n: m.weight.detach().clone() for n, m in model.named_modules() if n.endswith("layernorm")}
    assert len(norms) == 4
    noise = AdaptiveQuantizationNoise(AQNConfig(sigma_start=0.5, sigma_end=0.5, num_stages=2)).attach(model)
    assert noise.apply(0, 10) == 0.0 and all(
        torch.equal(model.get_submodule(n).weight, w) for n, w in norms.items()
    )
    assert noise.apply(7, 10) == 0.5
    deltas = torch.stack([model.get_submodule(n).weight - w for n, w in norms.items()])
    assert deltas.std().item() == pytest.approx(0.5, rel=0.3) and (deltas != 0).all()
    first = deltas.clone()
    noise.apply(7, 10)  # same step, same draw (every process draws the same noise)
    assert torch.equal(torch.stack([model.get_submodule(n).weight - w for n, w in norms.items()]), first)
    assert [n for n, _ in noise.norms] == sorted(norms)
    noise.remove()
    assert all(torch.equal(model.get_submodule(n).weight, w) for n, w in norms.items())
    model.get_submodule(sorted(norms)[0]).weight.requires_grad_(True)
    with pytest.raises(ValueError, match="trainable"):
        AdaptiveQuantizationNoise().attach(model)


def test_nvfp4_lora_model_loads_converts_and_freezes_a_saved_model(tmp_path):
    from triage.kernels import NVFP4Config, NVFP4LinearConfig
    from triage.trainers.peft_nvfp4 import nvfp4_lora_model
    from triage.trainers.tiny import save_tiny_model

    path = save_tiny_model(tmp_path / "tiny")
    model, cfg = nvfp4_lora_model(
        str(path),
        LoraConfig(r=2, target_modules=["q_proj", "v_proj"]),
        NVFP4Config(
            linear=NVFP4LinearConfig(**FAST), moe=None, frozen=NVFP4FrozenConfig(compute="w4a16", **FAST)
        ),
    )
    peft_model = get_peft_model(model, cfg)
    wrapped = [n for n, m in peft_model.named_modules() if isinstance(m, NVFP4LoraLinear)]
    assert len(wrapped) == 4 and all(n.endswith(("q_proj", "v_proj")) for n in wrapped)
    frozen = [m for m in peft_model.modules() if isinstance(m, FrozenNVFP4Linear)]
    assert len(frozen) == 14 and all(m.config.compute == "w4a16" for m in frozen)
    with pytest.raises(ValueError, match="model_init_kwargs"):
        nvfp4_lora_model(model, LoraConfig(), model_init_kwargs={"dtype": "bfloat16"})


def test_aqn_warns_once_when_the_noise_is_below_the_norm_dtype_resolution(nvfp4_model):
    model = _lora(nvfp4_model, mode="w4a16")
    small = AQNConfig(sigma_start=1e-4, sigma_end=1e-4, num_stages=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # fp32 norm weights hold σ = 1e-4
        AdaptiveQuantizationNoise(small).attach(model).apply(1, 2)
    model.to(torch.bfloat16)  # half an ulp of w = 1 is 2^-8: σ = 1e-4 rounds away
    noise = AdaptiveQuantizationNoise(small).attach(model)
    with pytest.warns(UserWarning, match="std 0 for the requested sigma 0.0001: the noise is below"):
        noise.apply(1, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        noise.apply(1, 2)  # once per σ
        noise.remove()
        AdaptiveQuantizationNoise(AQNConfig(num_stages=2)).attach(model).apply(1, 2)  # 1e-2 survives bf16


def test_aqn_callback_keeps_the_noise_of_the_generation_window_across_a_resume(nvfp4_model):
    """TRL generates every steps_per_generation × num_iterations micro-steps of the whole run, and a run resumed
    inside a generation window trains on the window's saved rollouts (TriageGRPOTrainer restores them): the
    resumed run must fold the noise of the window's first step, then resample at the run's own boundaries,
    exactly as the uninterrupted run does (else the noise enters δ for the rest of the run)."""
    nvfp4_model.requires_grad_(False)
    args = SimpleNamespace(steps_per_generation=1, num_iterations=2, gradient_accumulation_steps=1)
    norm = nvfp4_model.get_submodule("model.layers.0.input_layernorm")

    def run(start: int, end: int) -> tuple[list[int], dict[int, torch.Tensor]]:
        callback = AQNCallback(AQNConfig(num_stages=2, quant_noise_first_stage=False))
        state = SimpleNamespace(global_step=start, max_steps=end)
        callback.on_train_begin(args, state, None, model=nvfp4_model)
        weights = {}
        for step in range(start, end):
            state.global_step = step
            callback.on_step_begin(args, state, None)
            weights[step] = norm.weight.detach().clone()
        callback.on_train_end(args, state, None)
        return [s for s, _ in callback.history], weights

    steps, uninterrupted = run(0, 6)
    assert steps == [0, 2, 4]  # generations at micro-steps 0, 2, 4
    steps, resumed = run(3, 6)  # resumed from checkpoint-3, inside the window that started at step 2
    assert steps == [3, 4]
    assert all(torch.equal(resumed[s], uninterrupted[s]) for s in range(3, 6))
    steps, resumed = run(4, 6)  # resumed at a window boundary: TRL generates there
    assert steps == [4] and all(torch.equal(resumed[s], uninterrupted[s]) for s in range(4, 6))


def _nvfp4_tiny(tokenizer, skip=("lm_head", "*embed*"), **config):
    """A tiny Qwen3 (fp32; ``config`` overrides Qwen3Config fields) with its Linear layers in NVFP4."""
    from transformers import Qwen3ForCausalLM

    from triage.kernels import NVFP4Config, NVFP4LinearConfig, convert
    from triage.trainers.tiny import build_model

    cfg = build_model(tokenizer).config
    for k, v in config.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    return convert(Qwen3ForCausalLM(cfg), NVFP4Config(linear=NVFP4LinearConfig(**FAST), skip=skip))


def _merged_logits(model, ids) -> torch.Tensor:
    """Logits of a plain model of the same architecture loaded (strictly) from ``merged_state_dict``."""
    from transformers import Qwen3ForCausalLM

    plain = Qwen3ForCausalLM(model.config).eval()
    plain.load_state_dict(merged_state_dict(model), strict=True)
    with torch.no_grad():
        return plain(ids).logits


def test_merged_export_adds_the_lora_bias_to_the_base_bias(tokenizer):
    model = _lora(
        _nvfp4_tiny(tokenizer, attention_bias=True),
        mode="w4a16",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        lora_bias=True,
    )
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name and name.endswith(".bias"):
                p.normal_(0, 0.5)
    state = merged_state_dict(model)
    expect = q.base_layer.bias + q.lora_B["default"].bias * q.scaling["default"]
    assert torch.equal(state["model.layers.0.self_attn.q_proj.bias"], expect)
    ids = torch.randint(3, 400, (2, 7))
    with torch.no_grad():
        y = model(ids).logits
    torch.testing.assert_close(_merged_logits(model, ids), y, rtol=1e-4, atol=1e-4)
    with pytest.warns(UserWarning, match="no bias"):  # PEFT's own warning: lora_bias on a layer without bias
        no_bias = _lora(_nvfp4_tiny(tokenizer), mode="w4a16", target_modules=["q_proj"], lora_bias=True)
    with pytest.raises(ValueError, match="lora_bias=True but no base bias"):
        merged_state_dict(no_bias)


def test_merged_export_merges_adapters_on_high_precision_layers_too(tokenizer):
    """LoRA on layers left in high precision (skipped from conversion; lm_head) is merged like the rest."""
    model = _lora(
        _nvfp4_tiny(tokenizer, skip=("lm_head", "*embed*", "*layers.1.mlp.*"), tie_word_embeddings=False),
        mode="w4a16",
        target_modules=["q_proj", "gate_proj", "down_proj", "lm_head"],
    )
    gate = model.base_model.model.model.layers[1].mlp.gate_proj
    assert type(gate.base_layer) is torch.nn.Linear
    state = merged_state_dict(model)
    expect = gate.base_layer.weight + gate.get_delta_weight("default")
    assert torch.equal(state["model.layers.1.mlp.gate_proj.weight"], expect)
    ids = torch.randint(3, 400, (2, 7))
    with torch.no_grad():
        y = model(ids).logits
    torch.testing.assert_close(_merged_logits(model, ids), y, rtol=1e-4, atol=1e-4)
    tied = _lora(_nvfp4_tiny(tokenizer), mode="w4a16", target_modules=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="tied"):  # ΔW on lm_head only: a tied checkpoint cannot hold it
        merged_state_dict(tied)


def test_modules_to_save_export_the_trained_copy_merged_and_the_original_as_base(tokenizer, tmp_path):
    from triage.trainers.tiny import TinyModelSpec, build_model

    model = _lora(
        _nvfp4_tiny(tokenizer, tie_word_embeddings=False), mode="w4a16", modules_to_save=["lm_head"]
    )
    head = model.base_model.model.lm_head
    with torch.no_grad():
        head.modules_to_save["default"].weight.mul_(1.5)  # the trained copy differs from the original
    ids = torch.randint(3, 400, (2, 7))
    with torch.no_grad():
        y = model(ids).logits
    state = merged_state_dict(model)
    assert [k for k in state if "lm_head" in k] == ["lm_head.weight"]
    assert torch.equal(state["lm_head.weight"], head.modules_to_save["default"].weight)
    torch.testing.assert_close(_merged_logits(model, ids), y, rtol=1e-4, atol=1e-4)
    save_nvfp4_lora(model, tmp_path)
    skeleton = build_model(tokenizer, TinyModelSpec(tie_word_embeddings=False), seed=3)
    loaded = load_nvfp4_lora(skeleton, tmp_path, NVFP4FrozenConfig(compute="w4a16", **FAST))
    assert torch.equal(loaded.base_model.model.lm_head.original_module.weight, head.original_module.weight)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, y)


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_load_without_config_rebuilds_the_saved_numerics(nvfp4_model, tokenizer, tmp_path, mode):
    """The base's compute and activation recipe are saved beside it: a reload without ``config`` computes
    the same logits (a per-token activation scale here, not the default per-tensor one)."""
    from triage.kernels.nvfp4.recipe import QuantRecipe
    from triage.trainers.lora_io import BASE_CONFIG_FILE
    from triage.trainers.tiny import build_model

    cfg = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    model, cfg = nvfp4_lora(nvfp4_model, cfg, freeze(mode, activation=QuantRecipe(scale="row")))
    model = get_peft_model(model, cfg)
    save_nvfp4_lora(model, tmp_path, tokenizer=tokenizer)
    assert (tmp_path / BASE_SUBDIR / BASE_CONFIG_FILE).is_file()
    loaded = load_nvfp4_lora(build_model(tokenizer, seed=3), tmp_path)
    frozen = [m for m in loaded.modules() if type(m).__name__ == "FrozenNVFP4Linear"]
    assert frozen and all(m.config.compute == mode and m.config.activation.scale == "row" for m in frozen)
    ids = torch.randint(3, 400, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            _on_reference_kernels(loaded)(ids).logits, model(ids).logits, rtol=0, atol=1e-6
        )


def test_adapter_directories_with_the_alias_config_keys_load(nvfp4_model, tokenizer, tmp_path):
    """The base config is written as ``compute`` / ``activation``; files holding their aliases ``mode`` /
    ``input_recipe`` load to the same numerics."""
    import json

    from triage.kernels.nvfp4.recipe import QuantRecipe
    from triage.trainers.lora_io import BASE_CONFIG_FILE
    from triage.trainers.tiny import build_model

    cfg = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    model, cfg = nvfp4_lora(nvfp4_model, cfg, freeze("w4a4", activation=QuantRecipe(scale="row")))
    model = get_peft_model(model, cfg)
    save_nvfp4_lora(model, tmp_path)
    path = tmp_path / BASE_SUBDIR / BASE_CONFIG_FILE
    saved = json.loads(path.read_text())
    assert saved.keys() == {"compute", "activation", "cache_expanded"} and saved["compute"] == "w4a4"
    aliased = {"mode": saved["compute"], "input_recipe": saved["activation"], "cache_expanded": False}
    path.write_text(json.dumps(aliased))
    loaded = load_nvfp4_lora(build_model(tokenizer, seed=3), tmp_path)
    frozen = [m for m in loaded.modules() if isinstance(m, FrozenNVFP4Linear)]
    assert frozen and all(m.config.compute == "w4a4" and m.config.activation.scale == "row" for m in frozen)
    ids = torch.randint(3, 400, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            _on_reference_kernels(loaded)(ids).logits, model(ids).logits, rtol=0, atol=1e-6
        )
    path.write_text(json.dumps({"activation": saved["activation"]}))
    with pytest.raises(
        ValueError, match=f"{BASE_CONFIG_FILE}: not a valid NVFP4 frozen-base config .*'compute'"
    ):
        load_nvfp4_lora(build_model(tokenizer, seed=3), tmp_path)


def test_a_sampler_copy_with_other_numerics_keeps_the_frozen_base_bytes(nvfp4_model):
    """``HFSampler``'s copy with a ``dtype`` (or ``prepare_model``) is built from the learner's high-precision
    form (``unconvert(frozen=False)``), but a frozen base has none: it stays ``FrozenNVFP4Linear``, its codes
    shared with the learner (not dequantized, not re-quantized), and the copy computes as the learner does.
    ``unconvert`` itself (frozen=True) dequantizes it to an ``nn.Linear`` holding Ŵ."""
    from triage.kernels import unconvert
    from triage.trainers.sampling import HFSampler

    model = _lora(nvfp4_model, mode="w4a16")
    before = _base_bytes(model)
    source = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    ids = torch.randint(3, 400, (2, 9), generator=torch.Generator().manual_seed(0))
    for sampler in (HFSampler(sampler_model="copy", dtype=torch.float32), HFSampler(sampler_model="copy")):
        dup = sampler._build_copy(model)
        copied = dup.base_model.model.model.layers[0].self_attn.q_proj.base_layer
        assert isinstance(copied, FrozenNVFP4Linear) and copied.qweight.data_ptr() == source.qweight.data_ptr()
        with torch.no_grad():
            torch.testing.assert_close(dup(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert _base_bytes(model) == before
    dense = unconvert(copy.deepcopy(model)).base_model.model.model.layers[0].self_attn.q_proj.base_layer
    assert type(dense) is torch.nn.Linear and torch.equal(dense.weight, source.dequantized_weight())


def _imported_modules(path, package: str) -> set[str]:
    """Absolute names of the modules that the source file ``path`` (in ``package``) imports."""
    import ast
    from importlib.util import resolve_name

    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = resolve_name("." * node.level + (node.module or ""), package)
            names.add(module)
            names.update(f"{module}.{a.name}" for a in node.names)
    return names


def test_triage_trainers_lora_is_the_users_import_only():
    """`triage.trainers.lora` gathers public names for users (docs, error messages); the library imports the
    modules that define them, never this facade."""
    from pathlib import Path

    import triage
    import triage.experiments
    import triage.kernels
    import triage.trainers
    from triage.trainers import aqn, lora, lora_io, peft_nvfp4

    facade = Path(lora.__file__).resolve()
    importers = []
    for pkg in (triage, triage.kernels, triage.trainers, triage.experiments):
        root = Path(pkg.__file__).resolve().parent
        for path in root.rglob("*.py"):
            if path.resolve() == facade:
                continue
            parts = path.relative_to(root).with_suffix("").parts
            package = ".".join((pkg.__name__, *parts[:-1]))  # a module's package (for relative imports)
            if "triage.trainers.lora" in _imported_modules(path, package):
                importers.append(str(path.relative_to(root)))
    assert importers == []
    for name in lora.__all__:  # each name is the defining module's object
        owner = next(m for m in (aqn, lora_io, peft_nvfp4) if hasattr(m, name))
        assert getattr(lora, name) is getattr(owner, name), name
