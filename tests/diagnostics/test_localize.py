"""The layer localiser finds a planted mismatch, and its statistics are right on known inputs."""

import math

import pytest
import torch

from triage.trainers.diagnostics.localize import growth_per_layer, layer_divergence, localize
from triage.trainers.diagnostics.pairs import compare_paths
from triage.trainers.diagnostics.paths import ExecutionPath
from triage.trainers.diagnostics.precision import Precision


@pytest.mark.parametrize("layer", [1, 2])
def test_finds_planted_mismatch(trained, batch, layer):
    model, _ = trained
    learner = ExecutionPath("learner", Precision(), torch.float32)
    # the sampler converts one decoder layer to W4A4; everything else is the same fp32 model
    sampler = ExecutionPath("sampler", Precision("w4a4", "token", layers=(layer,)), torch.float32)
    report = compare_paths(model, learner, sampler, batch, threshold=1e-3)
    div = report.layers.divergence
    assert report.layers.first_layer == layer, div
    assert max(div[:layer]) < 1e-5 < div[layer]
    assert report.mean_abs_delta > 1e-3


def test_statistics_on_known_values():
    mask = torch.ones(2, 3, dtype=torch.bool)
    ref = [torch.ones(2, 3, 4, dtype=torch.float64) for _ in range(3)]
    other = [r * (1 + e) for r, e in zip(ref, (0.0, 1e-3, 4e-3))]
    div = layer_divergence(other, ref, mask)
    assert div == pytest.approx([0.0, 1e-3, 4e-3])
    report = localize(other, ref, mask, threshold=2e-3)
    assert report.first_layer == 2
    assert report.growth_per_layer == pytest.approx(4.0)  # fitted on the positive layers only
    assert growth_per_layer([1e-3, 2e-3, 4e-3, 8e-3]) == pytest.approx(2.0)
    assert growth_per_layer([0.0, 1e-3]) is None
    assert localize(other, ref, mask, threshold=1.0).first_layer is None


def test_divergence_ignores_padding_and_rejects_bad_input():
    mask = torch.tensor([[True, False]])
    a = [torch.tensor([[[1.0], [math.nan]]])]
    b = [torch.tensor([[[1.0], [5.0]]])]
    assert layer_divergence(a, b, mask) == [0.0]
    with pytest.raises(ValueError, match="non-finite"):
        layer_divergence(a, b, torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="2 and 1 decoder layers"):
        layer_divergence(a + a, b, mask)
    with pytest.raises(ValueError, match="threshold"):
        localize(a, b, mask, threshold=-1)
