"""The gap table on the trained tiny model: the order of the gaps along each axis, and what the table writes."""

import json

import pytest
import torch

from triage.trainers.diagnostics.gap_table import default_rows, format_table, gap_table, write_gap_table


@pytest.fixture(scope="module")
def table(trained, batch):
    model, _ = trained
    return gap_table(model, batch, default_rows(torch.bfloat16), tau=0.01)


def _gap(table, axis, setting):
    (row,) = [r for r in table["rows"] if r["axis"] == axis and r["setting"] == setting]
    return row["mean_abs_delta"]


def test_precision_ordering(table):
    bf16, w4a16, w4a4 = (_gap(table, "precision", s) for s in ("bf16", "w4a16", "w4a4"))
    assert w4a4 > w4a16 > bf16, (w4a4, w4a16, bf16)
    assert w4a16 > 10 * bf16  # weight conversion alone dwarfs bf16 kernel noise


def test_kv_cache_ordering(table):
    assert _gap(table, "kv_cache", "fp8") > max(_gap(table, "kv_cache", "bf16"), 1e-4)


def test_one_axis_at_a_time_from_an_aligned_base(table):
    base = _gap(table, "act_scale", "token")  # same recipe: only the kernels' reduction order differs
    assert base == _gap(table, "alignment", "default") == _gap(table, "conversion", "online")
    for axis, setting in (("act_scale", "tensor"), ("conversion", "offline"), ("fused_scales", "shared")):
        assert _gap(table, axis, setting) > max(3 * base, 1e-3), (axis, setting)
    assert _gap(table, "alignment", "strict") <= 1e-6
    assert _gap(table, "alignment", "bf16 strict") <= min(1e-6, _gap(table, "alignment", "bf16 default"))


def test_rows_carry_quantiles_shares_and_layers(table, batch):
    n_layers = 4
    for r in table["rows"]:
        assert r["tokens"] == int(batch.completion_mask.sum())
        assert set(r["quantiles"]) == {"p0.1", "p1", "p50", "p99", "p99.9"}
        assert r["quantiles"]["p0.1"] <= r["quantiles"]["p50"] <= r["quantiles"]["p99.9"]
        assert sum(r["class_shares"].values()) == pytest.approx(1.0)
        assert len(r["layers"]["divergence"]) == n_layers
    w4a4 = next(r for r in table["rows"] if r["setting"] == "w4a4")
    assert w4a4["class_shares"]["amplify_down"] > 0 and w4a4["layers"]["first_layer"] == 0


def test_write_gap_table(table, tmp_path):
    written = write_gap_table(table, tmp_path)
    assert {p.name for p in written} == {"gap_table.json", "delta_hist.png", "layer_divergence.png"}
    data = json.loads((tmp_path / "gap_table.json").read_text())
    assert len(data["rows"]) == len(table["rows"]) and "_delta" not in data["rows"][0]
    assert data["strict_alignment"]["bf16"]["mean_abs_delta_strict"] == 0.0
    for png in ("delta_hist.png", "layer_divergence.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = format_table(table)
    assert "precision" in text and "w4a4" in text and "mean|δ|" in text


def test_sample_batch_with_a_tokenizer_without_pad_token(trained):
    """Llama/Mistral-style tokenizers have no pad token: the batch pads with EOS (pads are masked)."""
    import copy

    from triage.trainers.diagnostics.tiny_model import sample_batch

    model, tokenizer = trained
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.pad_token = None
    assert tokenizer.pad_token_id is None
    batch = sample_batch(model, tokenizer, 4, 6, seed=3)
    assert batch.input_ids.shape[0] == 4
