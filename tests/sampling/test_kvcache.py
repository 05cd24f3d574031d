"""The KV-cache emulation of :mod:`triage.trainers.sampling.kvcache`: every stored state rounded, scales
frozen after the prefill, layers it cannot emulate refused by name."""

import pytest
import torch

from triage.trainers.sampling.kvcache import QuantizedKVLayer, kv_cache


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


def test_kv_cache_refuses_layers_it_cannot_emulate():
    from transformers import Qwen3Config

    shape = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16,
    )  # fmt: skip
    sliding = Qwen3Config(**shape, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert len(kv_cache(sliding, "native").layers) == 3
    with pytest.raises(ValueError, match="layer 1 .* DynamicSlidingWindowLayer"):
        kv_cache(sliding, "fp8")
    full = kv_cache(Qwen3Config(**shape), "fp8", "head")
    assert [type(layer) for layer in full.layers] == [QuantizedKVLayer] * 3
    assert full.layers[0].granularity == "head"
