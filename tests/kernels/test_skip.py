"""One skip rule (triage.kernels.skip): conversion, freezing and export keep the same modules in high
precision, so the learner computes in NVFP4 exactly the layers the sampler's checkpoint quantizes."""

import pytest
import torch
from torch import nn

from triage.kernels import DEFAULT_SKIP, FrozenNVFP4Linear, NVFP4Linear, NVFP4LinearConfig, convert_to_nvfp4
from triage.kernels.frozen_linear import freeze_nvfp4_base
from triage.kernels.nvfp4 import QuantRecipe, export_nvfp4_checkpoint
from triage.kernels.skip import skipped

CFG = NVFP4LinearConfig(gemm_backend="reference", quant_backend="torch")


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

    converted = convert_to_nvfp4(_toy(), CFG)
    assert {n for n, m in converted.named_modules() if isinstance(m, NVFP4Linear)} == in_checkpoint
    frozen = freeze_nvfp4_base(_toy(), quantize_linear=True, recipe=QuantRecipe())
    assert {n for n, m in frozen.named_modules() if isinstance(m, FrozenNVFP4Linear)} == in_checkpoint


def test_a_single_pattern_string_is_one_pattern():
    """``skip="lm_head"`` means the pattern, not its characters."""
    model = convert_to_nvfp4(_toy(), CFG, skip="lm_head")
    assert type(model.lm_head) is nn.Linear and type(model.score) is NVFP4Linear
    frozen = freeze_nvfp4_base(_toy(), quantize_linear=True, skip="lm_head")
    assert type(frozen.lm_head) is nn.Linear and type(frozen.score) is FrozenNVFP4Linear


def test_bad_patterns_are_named(tmp_path):
    with pytest.raises(TypeError, match="every pattern must be a str.*3"):
        convert_to_nvfp4(_toy(), CFG, skip=("lm_head", 3))
    with pytest.raises(TypeError, match="every pattern must be a str"):
        export_nvfp4_checkpoint(_toy(), tmp_path, skip=[None])
    assert skipped("model.layers.3.mlp.gate", DEFAULT_SKIP) and not skipped(
        "model.layers.3.mlp.gate_proj", DEFAULT_SKIP
    )
