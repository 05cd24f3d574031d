"""The sampler path under either cache-argument name, the offline conversion through an NVFP4 checkpoint, and clear
errors on bad input."""

import copy

import pytest
import torch

from triage.kernels.frozen_linear import FrozenNVFP4Linear
from triage.kernels.linear import NVFP4Linear
from triage.kernels.nvfp4 import QuantRecipe, quantize
from triage.kernels.nvfp4.export import compressed_tensors_quantize
from triage.kernels.nvfp4.reference import outer_scale_from_recipe
from triage.trainers.diagnostics.paths import ExecutionPath, TokenBatch, prepare_model, run_path
from triage.trainers.diagnostics.precision import (
    Precision,
    calibrate_activation_amax,
    convert_linears,
    decoder_linears,
)
from triage.trainers.sampling.kvcache import cache_argument


class _PastKeyValuesModel(torch.nn.Module):
    """A causal LM whose forward takes the cache as ``past_key_values`` only (transformers 5.17's name)."""

    def __init__(self, lm):
        super().__init__()
        self.lm, self.model, self.config = lm, lm.model, lm.config

    def forward(
        self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=None
    ):
        kw = {cache_argument(self.lm): past_key_values}
        return self.lm(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            **kw,
        )


def test_cache_argument_follows_the_forward_signature(trained):
    model, _ = trained

    class Peft(torch.nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base = base

        def get_base_model(self):
            return self.base

        def forward(self, *args, **kwargs):
            return self.base(*args, **kwargs)

    wrapped = _PastKeyValuesModel(model)
    assert cache_argument(wrapped) == "past_key_values"
    assert cache_argument(Peft(wrapped)) == "past_key_values"
    assert cache_argument(model) == cache_argument(Peft(model)) in ("cache", "past_key_values")


@pytest.mark.parametrize("kv", ["native", "fp8"])
def test_sampler_path_under_either_cache_argument_name(trained, batch, kv):
    """The sampler path scores the same through a ``past_key_values``-only forward (5.17's convention) as
    through the installed transformers' own forward, with the FP8 cache layers filled in both cases."""
    model, _ = trained
    path = ExecutionPath("sampler", Precision(), torch.float32, kv_cache=kv)
    engine = prepare_model(model, path)
    small = TokenBatch(batch.input_ids[:4], batch.attention_mask[:4], batch.prompt_width)
    direct = run_path(engine, path, small)
    legacy = run_path(_PastKeyValuesModel(engine), path, small)
    assert torch.equal(direct.logps, legacy.logps)
    assert all(torch.equal(a, b) for a, b in zip(direct.layers, legacy.layers))


@pytest.mark.parametrize("profile", ["modelopt", "compressed-tensors", "te"])
def test_offline_conversion_loads_the_exported_checkpoint(trained, profile):
    """weights_from="checkpoint": the engine layer holds the codes the kernels' exporter wrote for the bf16
    weights (compressed-tensors: the package's own bf16 arithmetic), and the decode scale its loader reads
    (RN(1/encode) for the compressed-tensors layout)."""
    model, _ = trained
    precision = Precision("w4a16", weights_from="checkpoint", checkpoint_profile=profile)
    offline = convert_linears(copy.deepcopy(model), precision)
    online = convert_linears(copy.deepcopy(model), Precision("w4a16"))
    differ = 0
    for name, _, _ in decoder_linears(model):
        layer = offline.get_submodule(name)
        assert isinstance(layer, FrozenNVFP4Linear) and layer.config.compute == "w4a16"
        got = layer.quantized_weight()
        w = model.get_submodule(name).weight.to(torch.bfloat16)
        if profile == "compressed-tensors":
            ref = compressed_tensors_quantize(w)
        else:
            ref = quantize(w, QuantRecipe(profile=profile), backend="torch")
        assert torch.equal(got.data, ref.data)
        assert torch.equal(got.scale.view(torch.uint8), ref.scale.view(torch.uint8))
        if profile == "compressed-tensors":  # stored as an encode scale, inverted by the loader
            assert got.global_scale.item() == (1.0 / ref.global_encode_scale).item()
        else:
            assert got.global_scale.item() == ref.global_scale.item()
        differ += int((online.get_submodule(name).quantized_weight().data != got.data).sum())
    assert differ > 0  # bf16 rounding of the master moves some weights across an E2M1 boundary


def test_static_activation_scales_come_from_the_checkpoint(trained, batch):
    """W4A4 + static + checkpoint: the engine quantizes activations with the stored input_scale (A_x/2688,
    ModelOpt's decode convention), read back by ``load_activation_recipes``."""
    model, _ = trained
    amax = calibrate_activation_amax(model, batch.input_ids, batch.attention_mask, batch.position_ids)
    precision = Precision("w4a4", "static", weights_from="checkpoint", checkpoint_profile="modelopt")
    engine = convert_linears(copy.deepcopy(model), precision, calibration=amax)
    for name, _, _ in decoder_linears(model):
        recipe = engine.get_submodule(name).config.activation
        assert recipe.scale_source == "checkpoint" and recipe.profile == "modelopt"
        static = QuantRecipe(profile="modelopt", scale_source="static", static_amax=amax[name])
        assert recipe.checkpoint_scale == float(outer_scale_from_recipe(static, "cpu").decode)
    learner = convert_linears(copy.deepcopy(model), Precision("w4a4", "token"), learner=True)
    assert all(isinstance(learner.get_submodule(n), NVFP4Linear) for n, _, _ in decoder_linears(model))


@pytest.mark.parametrize("weights_from", ["online", "checkpoint"])
def test_shared_fused_scales_use_the_group_amax(trained, weights_from):
    model, _ = trained
    precision = Precision("w4a16", fused_scales="shared", weights_from=weights_from)
    shared = convert_linears(copy.deepcopy(model), precision)
    attn = "model.layers.1.self_attn"
    dtype = torch.bfloat16 if weights_from == "checkpoint" else torch.float32

    def amax(leaf):
        return float(model.get_submodule(f"{attn}.{leaf}").weight.to(dtype).abs().amax())

    scales = {
        p: shared.get_submodule(f"{attn}.{p}").quantized_weight().global_scale.item()
        for p in ("q_proj", "k_proj", "v_proj")
    }
    assert len(set(scales.values())) == 1
    assert scales["q_proj"] == pytest.approx(max(map(amax, ("q_proj", "k_proj", "v_proj"))) / 2688, rel=1e-6)
    o_proj = shared.get_submodule(f"{attn}.o_proj").quantized_weight()
    assert o_proj.global_scale.item() == pytest.approx(amax("o_proj") / 2688, rel=1e-6)


def test_learner_layers_share_the_master_with_a_config_per_layer(trained, batch):
    """The online W4A4 learner of a bf16 path: the chosen layers' ``NVFP4Linear`` share the fp32 master's
    parameters, each with its calibrated activation amax and its fused group's weight amax; the others
    stay the copy's ``nn.Linear``."""
    model, _ = trained
    amax = calibrate_activation_amax(model, batch.input_ids, batch.attention_mask, batch.position_ids)
    precision = Precision("w4a4", "static", fused_scales="shared", layers=(1,))
    learner = prepare_model(model, ExecutionPath("learner", precision, torch.bfloat16), amax)
    attn = "model.layers.1.self_attn"
    qkv = [model.get_submodule(f"{attn}.{p}").weight for p in ("q_proj", "k_proj", "v_proj")]
    group = max(float(w.abs().amax()) for w in qkv)
    for name, index, _ in decoder_linears(model):
        layer = learner.get_submodule(name)
        if index != 1:
            assert type(layer) is torch.nn.Linear and layer.weight.dtype == torch.bfloat16
            continue
        assert isinstance(layer, NVFP4Linear) and layer.weight is model.get_submodule(name).weight
        assert layer.config.activation.static_amax == amax[name]
        if name.startswith(attn) and not name.endswith("o_proj"):
            assert layer.config.weight.static_amax == group


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="Precision.mode"):
        Precision("w4a8")
    with pytest.raises(ValueError, match="Precision.act_scale"):
        Precision("w4a4", "channel")
    with pytest.raises(ValueError, match="profile"):
        Precision("w4a4", profile="vllm")
    with pytest.raises(ValueError, match="learner path has no KV cache"):
        ExecutionPath("learner", kv_cache="fp8")
    with pytest.raises(ValueError, match="ExecutionPath.kind"):
        ExecutionPath("trainer")
    with pytest.raises(ValueError, match="completion 1 is empty"):
        TokenBatch.from_lists([[1, 2], [3]], [[4], []], pad_id=0)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        TokenBatch.from_lists([[]], [[4]], pad_id=0)


def test_static_scales_need_a_calibration(trained):
    model, _ = trained
    with pytest.raises(ValueError, match="calibrated amax"):
        convert_linears(copy.deepcopy(model), Precision("w4a4", "static"))
    with pytest.raises(ValueError, match="no decoder nn.Linear matched"):
        convert_linears(copy.deepcopy(model), Precision("w4a4", "token", layers=(99,)))


def test_token_batch_layout():
    b = TokenBatch.from_lists([[5, 6, 7], [8]], [[1, 2], [3, 4, 9]], pad_id=0)
    assert b.prompt_width == 3
    assert b.input_ids.tolist() == [[5, 6, 7, 1, 2, 0], [0, 0, 8, 3, 4, 9]]
    assert b.position_ids[1].tolist() == [0, 0, 0, 1, 2, 3]
    assert b.completion_mask.tolist() == [[True, True, False], [True, True, True]]


def test_learner_of_an_nvfp4_master_follows_the_precision_and_leaves_the_master_alone(trained, batch):
    """A master that is already NVFP4 (the trainer's own learner): the learner's layers are new layers on the
    master's parameters with the Precision's recipe, not the master's modules with the master's config."""
    from triage.kernels.conversion import NVFP4Config, convert

    model, _ = trained
    master = convert(copy.deepcopy(model), NVFP4Config.from_recipe(QuantRecipe(scale="row")))
    names = [name for name, index, _ in decoder_linears(master) if index == 0]
    before = {name: master.get_submodule(name) for name in names}
    learner = prepare_model(master, ExecutionPath("learner", Precision("w4a4", "tensor", layers=(0,))))
    for name in names:
        layer = learner.get_submodule(name)
        assert isinstance(layer, NVFP4Linear) and layer is not before[name]
        assert layer.weight is before[name].weight and layer.config.activation.scale == "tensor"
        assert master.get_submodule(name) is before[name] and before[name].config.activation.scale == "row"
