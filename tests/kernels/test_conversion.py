"""``convert`` / ``unconvert`` (kernels/conversion.py): dense, fused-MoE and frozen layers of tiny models,
against building each layer by hand with its own ``from_linear`` / constructor, per-layer configs
(``layers=``), and ``NVFP4Config``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from trainer_testkit import tiny_moe_model

from triage.kernels import (
    FrozenNVFP4Linear,
    NVFP4Config,
    NVFP4FrozenConfig,
    NVFP4Linear,
    NVFP4LinearConfig,
    NVFP4MoEConfig,
    NVFP4MoeExperts,
    convert,
    unconvert,
)
from triage.kernels.moe.experts import is_fused_experts
from triage.kernels.nvfp4 import QuantRecipe
from triage.kernels.skip import DEFAULT_SKIP, skipped

FAST = dict(gemm_backend="reference", quant_backend="torch")
ROW = QuantRecipe(scale="row")
LINEAR = NVFP4LinearConfig(activation=ROW, weight=ROW, **FAST)
MOE = NVFP4MoEConfig(
    activation=ROW, weight=dataclasses.replace(ROW, scale="expert"), gemm_backend="reference"
)


@pytest.fixture(scope="module")
def tokenizer():
    from triage.trainers.tiny import build_tokenizer

    return build_tokenizer()


def _dense(tokenizer, **spec):
    from triage.trainers.tiny import TinyModelSpec, build_model

    return build_model(tokenizer, TinyModelSpec(**spec), seed=0)


def _by_hand(model, make):
    """Each non-skipped module replaced by ``make(module)`` (None: kept), one ``set_submodule`` per layer."""
    new = [(n, make(m)) for n, m in model.named_modules() if n and not skipped(n, DEFAULT_SKIP)]
    for name, module in new:
        if module is not None:
            model.set_submodule(name, module)
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


IDS = torch.randint(3, 400, (2, 9), generator=torch.Generator().manual_seed(0))


def test_dense_round_trip_shares_parameters_and_matches_the_layers_built_by_hand(tokenizer):
    model = _dense(tokenizer)
    ref = _logits(model, IDS)
    params = dict(model.named_parameters())
    assert convert(model, NVFP4Config(linear=LINEAR)) is model
    assert sum(isinstance(m, NVFP4Linear) for m in model.modules()) == 14  # q k v o gate up down × 2
    assert all(p is params[n] for n, p in model.named_parameters())  # shared, not copied
    by_hand = _by_hand(
        _dense(tokenizer), lambda m: NVFP4Linear.from_linear(m, LINEAR) if type(m) is nn.Linear else None
    )
    assert torch.equal(_logits(model, IDS), _logits(by_hand, IDS))
    assert unconvert(model) is model
    assert not any(isinstance(m, NVFP4Linear) for m in model.modules())
    assert all(p is params[n] for n, p in model.named_parameters())
    assert torch.equal(_logits(model, IDS), ref)


def test_tied_weights_stay_tied_through_both_directions(tokenizer):
    model = _dense(tokenizer, tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    convert(model, NVFP4Config(linear=LINEAR, skip=()))  # lm_head converted too
    assert isinstance(model.lm_head, NVFP4Linear) and model.lm_head.weight is model.model.embed_tokens.weight
    unconvert(model)
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.model.embed_tokens.weight


def test_fused_moe_round_trip_restores_the_original_experts(tokenizer):
    model = tiny_moe_model(tokenizer)
    ref = _logits(model, IDS)
    originals = {n: m for n, m in model.named_modules() if is_fused_experts(m)}
    params = dict(model.named_parameters())
    convert(model, NVFP4Config(linear=LINEAR, moe=MOE))
    experts = {n: m for n, m in model.named_modules() if isinstance(m, NVFP4MoeExperts)}
    assert experts.keys() == originals.keys() and len(experts) == 2
    assert all(p is params[n] for n, p in model.named_parameters())
    assert type(model.model.layers[0].mlp.gate) is type(tiny_moe_model(tokenizer).model.layers[0].mlp.gate)

    def make(m):
        if type(m) is nn.Linear:
            return NVFP4Linear.from_linear(m, LINEAR)
        return NVFP4MoeExperts(m, MOE) if is_fused_experts(m) else None

    assert torch.equal(_logits(model, IDS), _logits(_by_hand(tiny_moe_model(tokenizer), make), IDS))
    unconvert(model)
    assert all(model.get_submodule(n) is m for n, m in originals.items())
    assert not any(isinstance(m, (NVFP4Linear, NVFP4MoeExperts)) for m in model.modules())
    assert torch.equal(_logits(model, IDS), ref)


@pytest.mark.parametrize("compute", ["w4a4", "w4a16"])
def test_frozen_round_trip_quantizes_once_and_unconverts_to_the_dequantized_weight(tokenizer, compute):
    frozen_cfg = NVFP4FrozenConfig(compute=compute, activation=ROW, **FAST)
    model = convert(_dense(tokenizer), NVFP4Config(linear=LINEAR, frozen=frozen_cfg))
    layers = {n: m for n, m in model.named_modules() if isinstance(m, FrozenNVFP4Linear)}
    assert len(layers) == 14 and not any(isinstance(m, NVFP4Linear) for m in model.modules())
    assert not any("_proj." in n for n, _ in model.named_parameters())  # no master weights kept
    # the frozen-base path by hand: NVFP4Linear layers, then each frozen with the W_q it computed with
    by_hand = _by_hand(
        _dense(tokenizer), lambda m: NVFP4Linear.from_linear(m, LINEAR) if type(m) is nn.Linear else None
    )
    by_hand = _by_hand(
        by_hand,
        lambda m: FrozenNVFP4Linear.from_linear(m, frozen_cfg) if isinstance(m, NVFP4Linear) else None,
    )
    for name, layer in layers.items():
        assert torch.equal(layer.qweight, by_hand.get_submodule(name).qweight), name
    frozen_logits = _logits(model, IDS)
    assert torch.equal(frozen_logits, _logits(by_hand, IDS))
    unconvert(model)
    for name, layer in layers.items():
        lin = model.get_submodule(name)
        assert type(lin) is nn.Linear and not lin.weight.requires_grad
        assert torch.equal(lin.weight, layer.dequantized_weight())
    if compute == "w4a16":  # fp32 activations: the frozen forward is the fp32 matmul with Ŵ
        torch.testing.assert_close(_logits(model, IDS), frozen_logits, rtol=1e-5, atol=1e-5)


def test_freezing_an_nvfp4_model_keeps_its_bytes(tokenizer):
    model = convert(_dense(tokenizer), NVFP4Config(linear=LINEAR))
    wq = model.model.layers[1].mlp.up_proj.quantized_weight()
    ref = _logits(model, IDS)
    convert(model, NVFP4Config(linear=None, moe=None, frozen=NVFP4FrozenConfig.like(LINEAR)))
    frozen = model.model.layers[1].mlp.up_proj
    assert isinstance(frozen, FrozenNVFP4Linear) and torch.equal(frozen.qweight, wq.data)
    assert torch.equal(_logits(model, IDS), ref)


def test_skip_is_honoured_for_every_kind_of_layer(tokenizer):
    config = NVFP4Config(
        linear=LINEAR, moe=MOE, skip=(*DEFAULT_SKIP, "*.q_proj", "model.layers.1.mlp.experts")
    )
    model = convert(tiny_moe_model(tokenizer), config)
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear
    assert isinstance(model.model.layers[0].self_attn.k_proj, NVFP4Linear)
    assert isinstance(model.model.layers[0].mlp.experts, NVFP4MoeExperts)
    assert not isinstance(model.model.layers[1].mlp.experts, NVFP4MoeExperts)
    assert type(model.lm_head) is nn.Linear
    frozen = convert(_dense(tokenizer), dataclasses.replace(config, frozen=NVFP4FrozenConfig(**FAST)))
    assert type(frozen.model.layers[0].self_attn.q_proj) is nn.Linear
    assert isinstance(frozen.model.layers[0].self_attn.k_proj, FrozenNVFP4Linear)
    dense_only = convert(tiny_moe_model(tokenizer), NVFP4Config(linear=LINEAR, moe=None))
    assert not any(isinstance(m, NVFP4MoeExperts) for m in dense_only.modules())
    experts_only = convert(tiny_moe_model(tokenizer), NVFP4Config(linear=None, moe=MOE))
    assert not any(isinstance(m, NVFP4Linear) for m in experts_only.modules())


def test_a_layer_that_does_not_fit_is_named_and_nothing_is_replaced():
    model = nn.Module()
    model.good = nn.Linear(32, 16)
    model.odd = nn.Linear(24, 16)
    with pytest.raises(ValueError, match=r"convert: layer 'odd'.*in_features=24.*NVFP4Config.skip"):
        convert(model, NVFP4Config(linear=LINEAR))
    assert type(model.good) is nn.Linear  # the model is left as it was
    with torch.no_grad():
        model.good.weight[2, 3] = float("nan")
    frozen = NVFP4Config(linear=LINEAR, frozen=NVFP4FrozenConfig(**FAST), skip=("odd",))
    with pytest.raises(ValueError, match=r"convert: layer 'good'.*NaN/Inf.*\[2, 3\]"):
        convert(model, frozen)
    with pytest.raises(ValueError, match="the model itself is a Linear"):
        convert(nn.Linear(32, 16), NVFP4Config(linear=LINEAR))
    with pytest.raises(ValueError, match=r"the model itself is an NVFP4Linear; call its .to_linear\(\)"):
        unconvert(NVFP4Linear(32, 16, config=LINEAR))


def test_per_layer_configs_convert_the_named_modules_each_with_its_own_config(tokenizer):
    """``layers``: the named modules by their own config (table row and skip), the others by ``config``."""
    nothing = NVFP4Config(linear=None, moe=None, skip=())
    static = dataclasses.replace(
        LINEAR, activation=QuantRecipe(scale_source="static", static_amax=3.0), weight=QuantRecipe()
    )
    frozen = NVFP4Config(linear=LINEAR, frozen=NVFP4FrozenConfig(compute="w4a16", **FAST))
    layers = {
        "model.layers.0.self_attn.q_proj": NVFP4Config(linear=LINEAR),
        "model.layers.1.mlp.up_proj": NVFP4Config(linear=static),
        "model.layers.1.mlp.down_proj": frozen,
        "lm_head": NVFP4Config(linear=LINEAR, skip=()),  # the named module's skip, not config's
    }
    model = convert(_dense(tokenizer), nothing, layers=layers)
    converted = {n: m for n, m in model.named_modules() if isinstance(m, (NVFP4Linear, FrozenNVFP4Linear))}
    assert converted.keys() == layers.keys()
    assert model.model.layers[1].mlp.up_proj.config == static
    assert isinstance(converted["model.layers.1.mlp.down_proj"], FrozenNVFP4Linear)

    by_hand = _dense(tokenizer)
    for name, config in layers.items():
        m = by_hand.get_submodule(name)
        if config.frozen is not None:
            new = FrozenNVFP4Linear.from_linear(m, config.frozen, recipe=LINEAR.weight, quant_backend="torch")
        else:
            new = NVFP4Linear.from_linear(m, config.linear)
        by_hand.set_submodule(name, new)
    assert torch.equal(_logits(model, IDS), _logits(by_hand, IDS))
    assert convert(model, nothing, layers=layers) is model  # converting twice changes nothing
    assert {n: m for n, m in model.named_modules() if n in layers} == converted
    unconvert(model)
    assert not any(isinstance(m, (NVFP4Linear, FrozenNVFP4Linear)) for m in model.modules())
    # fused experts by name, the other experts left to config (moe=None)
    experts = "model.layers.1.mlp.experts"
    moe = convert(tiny_moe_model(tokenizer), nothing, layers={experts: NVFP4Config(moe=MOE)})
    assert [n for n, m in moe.named_modules() if isinstance(m, NVFP4MoeExperts)] == [experts]


def test_per_layer_configs_that_name_no_layer_are_errors_naming_them(tokenizer):
    model = _dense(tokenizer)
    one = NVFP4Config(linear=LINEAR)
    attn = "model.layers.0.self_attn"
    with pytest.raises(ValueError, match=rf"does not have: \['{attn}.qproj'\]"):
        convert(model, layers={f"{attn}.qproj": one, f"{attn}.k_proj": one})
    with pytest.raises(ValueError, match="nor fused MoE experts: 'model.layers.0.mlp'"):
        convert(model, layers={"model.layers.0.mlp": one})
    with pytest.raises(ValueError, match=r"own NVFP4Config.skip keeps as they are: \['lm_head'\].*skip=\(\)"):
        convert(model, layers={"lm_head": one})
    with pytest.raises(TypeError, match=r"layers\['lm_head'\] must be an NVFP4Config, got NVFP4LinearConfig"):
        convert(model, layers={"lm_head": LINEAR})
    with pytest.raises(TypeError, match="layers must be a mapping"):
        convert(model, layers=["lm_head"])
    q = f"{attn}.q_proj"
    with pytest.raises(ValueError, match=rf"would leave them as they are.*'{q}' \(Linear\)"):
        convert(model, layers={q: NVFP4Config(linear=None)})
    convert(model, NVFP4Config(linear=None, moe=None), layers={q: one})
    other = NVFP4Config(linear=dataclasses.replace(LINEAR, activation=QuantRecipe(scale="tensor")))
    with pytest.raises(ValueError, match=rf"unconvert it first.*'{q}' \(NVFP4Linear\)"):
        convert(model, layers={q: other})
    assert model.get_submodule(q).config == LINEAR
    freeze = {q: NVFP4Config(linear=None, frozen=NVFP4FrozenConfig(compute="w4a16", **FAST))}
    for _ in range(2):  # freezing the NVFP4Linear, then again: the frozen layer is what the entry asks
        convert(model, NVFP4Config(linear=None, moe=None), layers=freeze)
        assert isinstance(model.get_submodule(q), FrozenNVFP4Linear)
    other_weight = NVFP4Config(
        linear=dataclasses.replace(LINEAR, weight=QuantRecipe()), frozen=freeze[q].frozen
    )
    with pytest.raises(ValueError, match=rf"unconvert it first.*'{q}' \(FrozenNVFP4Linear\)"):
        convert(model, layers={q: other_weight})  # frozen with another weight recipe
    unconvert(model)
    holder = nn.Module()
    holder.good, holder.odd = nn.Linear(32, 16), nn.Linear(24, 16)
    with pytest.raises(ValueError, match=r"convert: layer 'odd'.*in_features=24"):  # named: its own skip
        convert(holder, NVFP4Config(linear=LINEAR, skip=("odd",)), layers={"odd": NVFP4Config(linear=LINEAR)})
    assert type(holder.good) is nn.Linear  # nothing replaced
    assert not any(isinstance(m, NVFP4Linear) for m in model.modules())


def test_from_recipe_is_one_recipe_for_activations_and_weights_of_every_layer():
    assert NVFP4Config.from_recipe(None) == NVFP4Config()
    config = NVFP4Config.from_recipe(ROW)
    assert config.linear == NVFP4LinearConfig(activation=ROW, weight=ROW)
    assert config.moe == NVFP4MoEConfig(activation=ROW, weight=dataclasses.replace(ROW, scale="expert"))
    assert config.frozen is None and config.skip == DEFAULT_SKIP
    lora = NVFP4Config.from_recipe(ROW, frozen="w4a16")
    assert lora.linear == config.linear and lora.moe is None
    assert lora.frozen == NVFP4FrozenConfig(compute="w4a16", activation=ROW)
    assert NVFP4Config.from_recipe(None, frozen="w4a4").frozen == NVFP4FrozenConfig()
    with pytest.raises(TypeError, match="recipe must be a QuantRecipe"):
        NVFP4Config.from_recipe({"scale": "row"})
    with pytest.raises(ValueError, match="compute must be one of"):
        NVFP4Config.from_recipe(ROW, frozen="w8a8")


def test_config_fields_are_checked_by_type():
    with pytest.raises(TypeError, match=r"NVFP4Config.linear must be an NVFP4LinearConfig.*from_recipe"):
        NVFP4Config(linear=ROW)
    with pytest.raises(
        TypeError, match="NVFP4Config.moe must be an NVFP4MoEConfig or None, got NVFP4LinearConfig"
    ):
        NVFP4Config(moe=LINEAR)
    with pytest.raises(TypeError, match="every pattern must be a str"):
        NVFP4Config(skip=("lm_head", None))
    with pytest.raises(TypeError, match="config must be an NVFP4Config"):
        convert(nn.Linear(16, 16), LINEAR)
    with pytest.raises(TypeError, match="NVFP4MoEConfig.weight must be a QuantRecipe"):
        NVFP4MoEConfig(weight="expert")


def test_convert_is_the_function_even_after_its_module_was_imported():
    """A submodule import sets the package attribute of its name: the module must not be called ``convert``."""
    import subprocess
    import sys

    code = (
        "import importlib, types, triage.kernels as k; importlib.import_module(k._LAZY['convert']); "
        "from triage.kernels import convert, unconvert; "
        "assert not isinstance(convert, types.ModuleType) and callable(unconvert), convert"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
