"""FP8 KV-cache emulation, the NVFP4 checkpoint round trip, and clear errors on bad input."""

import pytest
import torch

from triage.kernels.nvfp4 import QuantRecipe, quantize
from triage.trainers.diagnostics.checkpoint import load_nvfp4_checkpoint, roundtrip, save_nvfp4_checkpoint
from triage.trainers.diagnostics.kvcache import QuantizedKVLayer, kv_cache
from triage.trainers.diagnostics.paths import ExecutionPath, TokenBatch
from triage.trainers.diagnostics.precision import Precision, convert_linears, decoder_linears


def _states(seed, t, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, t, 8, generator=g) * scale


@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_fp8_layer_rounds_every_stored_state(granularity):
    layer = QuantizedKVLayer("fp8", granularity)
    k0, v0 = _states(0, 5), _states(1, 5)
    keys, values = layer.update(k0, v0)
    ks, vs = layer.scales
    assert ks.numel() == (1 if granularity == "tensor" else 3)
    for stored, ref, s in ((keys, k0, ks), (values, v0, vs)):
        assert torch.equal(layer.round(stored, s), stored)  # already on the scaled e4m3 grid
        assert 0 < (stored - ref).abs().max() <= ref.abs().max() / 16  # 3 mantissa bits
    k1 = _states(2, 1, scale=1e3)  # a decode step far above the prefill amax: saturates, never NaN
    keys, _ = layer.update(k1, _states(3, 1))
    assert layer.scales[0] is ks  # frozen after the prefill
    assert keys.shape[2] == 6 and torch.isfinite(keys).all()
    assert keys[:, :, -1].abs().max() <= 448 * ks.max() * (1 + 1e-6)


def test_bf16_layer_and_cache_factory():
    layer = QuantizedKVLayer("bf16")
    k = _states(0, 4)
    keys, _ = layer.update(k, k)
    assert torch.equal(keys, k.to(torch.bfloat16).float())

    class Cfg:
        num_hidden_layers = 3

        def get_text_config(self, decoder=True):
            return self

    with pytest.raises(ValueError, match="kv cache format"):
        kv_cache(Cfg(), "int4")
    with pytest.raises(ValueError, match="granularity"):
        QuantizedKVLayer("fp8", "channel")
    nan = _states(0, 2)
    nan[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN/Inf"):
        QuantizedKVLayer("fp8").update(nan, nan)


@pytest.mark.parametrize("profile", ["modelopt", "compressed-tensors", "te"])
def test_checkpoint_roundtrip_keeps_the_codes(profile, tmp_path):
    g = torch.Generator().manual_seed(0)
    weights = {
        f"model.layers.0.mlp.{n}": quantize(
            torch.randn(32, 48, generator=g), QuantRecipe(profile=profile), backend="torch"
        )
        for n in ("up_proj", "down_proj")
    }
    back = roundtrip(weights, profile)
    for name, t in weights.items():
        assert torch.equal(back[name].data, t.data)
        assert torch.equal(back[name].scale.view(torch.uint8), t.scale.view(torch.uint8))
        if profile == "compressed-tensors":  # stored as an encode scale, inverted by the loader
            assert back[name].global_scale.item() == (1.0 / t.global_encode_scale).item()
        else:
            assert back[name].global_scale.item() == t.global_scale.item()
    path = save_nvfp4_checkpoint(weights, tmp_path / "m.safetensors", profile)
    with pytest.raises(ValueError, match="no tensor"):
        load_nvfp4_checkpoint(
            path, {"model.layers.9.mlp.up_proj": weights["model.layers.0.mlp.up_proj"]}, profile
        )


def test_offline_conversion_quantizes_the_bf16_checkpoint(trained):
    model, _ = trained
    import copy

    online = convert_linears(copy.deepcopy(model), Precision("w4a16"))
    offline = convert_linears(
        copy.deepcopy(model), Precision("w4a16", weights_from="checkpoint", checkpoint_profile="te")
    )
    differ = 0
    for (name, _, _), (_, _, _) in zip(decoder_linears(model), decoder_linears(model)):
        a = online.get_submodule(name).weight_q
        b = offline.get_submodule(name).weight_q
        differ += int((a.data != b.data).sum())
        w = model.get_submodule(name).weight.to(torch.bfloat16)
        assert torch.equal(b.data, quantize(w, QuantRecipe(profile="te"), backend="torch").data)
    assert differ > 0  # bf16 rounding of the master moves some weights across an E2M1 boundary


def test_shared_fused_scales_use_the_group_amax(trained):
    model, _ = trained
    import copy

    shared = convert_linears(copy.deepcopy(model), Precision("w4a16", fused_scales="shared"))
    attn = "model.layers.1.self_attn"
    amax = max(
        float(model.get_submodule(f"{attn}.{p}").weight.abs().amax()) for p in ("q_proj", "k_proj", "v_proj")
    )
    scales = {
        p: shared.get_submodule(f"{attn}.{p}").weight_q.global_scale.item()
        for p in ("q_proj", "k_proj", "v_proj")
    }
    assert len(set(scales.values())) == 1
    assert scales["q_proj"] == pytest.approx(amax / 2688, rel=1e-6)
    assert shared.get_submodule(f"{attn}.o_proj").weight_q.global_scale.item() == pytest.approx(
        float(model.get_submodule(f"{attn}.o_proj").weight.abs().amax()) / 2688, rel=1e-6
    )


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
    import copy

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
