"""write_nvfp4_checkpoint: the one NVFP4 checkpoint writer (export, LoRA bases) stores quantized bytes as
they are, W4A4 activation scales when given, and names what it refuses."""

import pytest
import torch

from triage.kernels.nvfp4 import QuantRecipe, load_activation_recipes, load_nvfp4_checkpoint, quantize
from triage.kernels.nvfp4.export import write_nvfp4_checkpoint


def _weights():
    gen = torch.Generator().manual_seed(0)
    recipe = QuantRecipe(profile="modelopt")
    return {
        f"l{i}.weight": quantize(torch.randn(16, 32, generator=gen), recipe, backend="torch") for i in (0, 1)
    }


@pytest.mark.parametrize("layout", ["modelopt", "compressed-tensors"])
def test_bytes_and_activation_scales_round_trip(tmp_path, layout):
    weights = _weights()
    if layout == "compressed-tensors":  # an encode-scale layout needs a profile that recovers decode exactly
        weights = {n: quantize(t.dequantize(), QuantRecipe(), backend="torch") for n, t in weights.items()}
    norm = {"norm.weight": torch.ones(32), "head.weight": torch.randn(8, 32)}
    scales = {"l0": 0.5, "l1": 0.25}
    write_nvfp4_checkpoint(tmp_path, weights, norm, layout=layout, input_scales=scales)
    back = load_nvfp4_checkpoint(tmp_path)
    assert set(back) == set(weights)
    for name, t in weights.items():
        assert torch.equal(back[name].data, t.data) and torch.equal(
            back[name].scale.view(torch.uint8), t.scale.view(torch.uint8)
        )
    recipes = load_activation_recipes(tmp_path)
    assert {m: r.checkpoint_scale for m, r in recipes.items()} == pytest.approx(scales)


def test_bad_entries_are_named(tmp_path):
    weights = _weights()
    with pytest.raises(ValueError, match="'l0' must be a '<module>.weight'"):
        write_nvfp4_checkpoint(tmp_path, {"l0": weights["l0.weight"]}, {})
    with pytest.raises(ValueError, match=r"input_scales\['l1'\] = nan"):
        write_nvfp4_checkpoint(tmp_path, weights, {}, input_scales={"l0": 1.0, "l1": float("nan")})
    with pytest.raises(ValueError, match=r"missing \['l1'\]"):
        write_nvfp4_checkpoint(tmp_path, weights, {}, input_scales={"l0": 1.0})
    with pytest.raises(ValueError, match="'l0.weight_scale' collides"):
        write_nvfp4_checkpoint(tmp_path, weights, {"l0.weight_scale": torch.ones(1)})
