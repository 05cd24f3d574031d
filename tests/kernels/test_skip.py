"""One skip rule (triage.kernels.skip): conversion, freezing and export keep the same modules in high
precision, so the learner computes in NVFP4 exactly the layers the sampler's checkpoint quantizes."""

import dataclasses

import pytest
import torch
from torch import nn

from triage.kernels import (
    DEFAULT_SKIP,
    FrozenNVFP4Linear,
    NVFP4Config,
    NVFP4FrozenConfig,
    NVFP4Linear,
    NVFP4LinearConfig,
    convert,
)
from triage.kernels.nvfp4 import QuantRecipe, export_nvfp4_checkpoint
from triage.kernels.skip import skipped

CFG = NVFP4LinearConfig(gemm_backend="reference", quant_backend="torch")
#: plain nn.Linear layers quantized once (1×16 weight blocks) into frozen layers
FROZEN = NVFP4Config(linear=NVFP4LinearConfig(weight=QuantRecipe()), frozen=NVFP4FrozenConfig())


class _Block(nn.Module):
    """An MoE-ish block: a router and a shared-expert gate next to ordinary projections."""

    def __init__(self):
        super().__init__()
        self.mlp = nn.Module()
        self.mlp.gate = nn.Linear(32, 4, bias=False)  # Qwen2/3-MoE router (nn.Linear before transformers 5)
        self.mlp.up_proj = nn.Linear(32, 32, bias=False)
        self.mlp.shared_expert_gate = nn.Linear(32, 1, bias=False)


def _toy():
    torch.manual_seed(0)
    model = nn.Module()
    model.layers = nn.ModuleList([_Block()])
    model.norm = nn.LayerNorm(32)
    model.score = nn.Linear(32, 2, bias=False)  # sequence-classification head
    model.classifier = nn.Linear(32, 2, bias=False)
    model.lm_head = nn.Linear(32, 64, bias=False)
    return model


def test_conversion_freezing_and_export_quantize_the_same_layers(tmp_path):
    exported = export_nvfp4_checkpoint(
        _toy(), tmp_path, recipe=QuantRecipe(profile="modelopt"), backend="torch"
    )
    in_checkpoint = {name.removesuffix(".weight") for name in exported.weights}
    assert in_checkpoint == {"layers.0.mlp.up_proj"}

    converted = convert(_toy(), NVFP4Config(linear=CFG))
    assert {n for n, m in converted.named_modules() if isinstance(m, NVFP4Linear)} == in_checkpoint
    frozen = convert(_toy(), FROZEN)
    assert {n for n, m in frozen.named_modules() if isinstance(m, FrozenNVFP4Linear)} == in_checkpoint


def test_a_single_pattern_string_is_one_pattern():
    """``skip="lm_head"`` means the pattern, not its characters."""
    config = NVFP4Config(linear=CFG, skip="lm_head")
    assert config.skip == ("lm_head",)
    model = convert(_toy(), config)
    assert type(model.lm_head) is nn.Linear and type(model.score) is NVFP4Linear
    frozen = convert(_toy(), dataclasses.replace(FROZEN, skip="lm_head"))
    assert type(frozen.lm_head) is nn.Linear and type(frozen.score) is FrozenNVFP4Linear


def test_bad_patterns_are_named(tmp_path):
    with pytest.raises(TypeError, match="every pattern must be a str.*3"):
        NVFP4Config(skip=("lm_head", 3))
    with pytest.raises(TypeError, match="every pattern must be a str"):
        export_nvfp4_checkpoint(_toy(), tmp_path, skip=[None])
    assert skipped("model.layers.3.mlp.gate", DEFAULT_SKIP) and not skipped(
        "model.layers.3.mlp.gate_proj", DEFAULT_SKIP
    )
