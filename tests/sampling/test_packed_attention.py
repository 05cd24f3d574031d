"""Decode attention without ``repeat_kv`` (:mod:`triage.trainers.sampling.attention`): the packed grouped-query
SDPA against SDPA over repeated keys and values, its fall-through cases, and the static decode step's switch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from triage.trainers.sampling import SamplingParams, sample_with_kv_cache
from triage.trainers.sampling import attention as att
from triage.trainers.sampling import graphs as g


class _Attn(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups


def _reference(q, k, v, mask, scale):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (32, 8), (6, 3)])
@pytest.mark.parametrize("mask", ["bool", "additive", None])
def test_packed_gqa_is_sdpa_over_repeated_keys(dtype, heads, kv_heads, mask):
    g_ = torch.Generator().manual_seed(0)
    b, length, d = 3, 37, 16
    q = torch.randn(b, 1, heads, d, generator=g_).to(dtype).transpose(1, 2)  # as the HF layer hands it over
    k, v = (torch.randn(b, kv_heads, length, d, generator=g_).to(dtype) for _ in range(2))
    on = torch.rand(b, 1, 1, length, generator=g_) > 0.3
    on[..., 0] = True
    m = {"bool": on, "additive": torch.zeros(on.shape, dtype=dtype).masked_fill(~on, -1e4), None: None}[mask]
    out, weights = att.packed_sdpa_forward(_Attn(heads // kv_heads), q, k, v, m, scaling=0.25)
    ref = _reference(q, k, v, m, 0.25)
    assert weights is None and out.shape == ref.shape == (b, 1, heads, d)
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 8e-3, "rtol": 8e-3}
    torch.testing.assert_close(out, ref, **tol)


@pytest.mark.parametrize(
    "case", ["tokens", "no_groups", "dropout", "per_head_mask", "position_bias", "sliding_window", "unknown"]
)
def test_everything_else_goes_to_transformers_sdpa(case, monkeypatch):
    """More than one query token, no grouping, dropout, a mask per head, a position bias, a sliding window,
    any argument a plain decoder does not pass (e.g. a sparse model's block indices): transformers' own
    ``sdpa_attention_forward``, called with the same arguments."""
    from transformers.integrations import sdpa_attention

    seen = []
    monkeypatch.setattr(
        sdpa_attention, "sdpa_attention_forward", lambda *a, **k: seen.append((a, k)) or ("x", None)
    )
    b, heads, kv_heads, d, length = 2, 8, 2, 16, 9
    tokens = 3 if case == "tokens" else 1
    kv = kv_heads if case != "no_groups" else heads
    q = torch.randn(b, heads, tokens, d)
    k = v = torch.randn(b, kv, length, d)
    mask = torch.ones(b, heads if case == "per_head_mask" else 1, tokens, length, dtype=torch.bool)
    kwargs = {"dropout": 0.1} if case == "dropout" else {}
    if case == "position_bias":
        kwargs["position_bias"] = torch.zeros(1, heads, tokens, length)
    if case == "sliding_window":
        kwargs["sliding_window"] = 4
    if case == "unknown":
        kwargs["block_indices"] = torch.zeros(1)
    assert att.packed_sdpa_forward(_Attn(heads // kv), q, k, v, mask, **kwargs) == ("x", None)
    assert len(seen) == 1 and seen[0][0][1] is q and seen[0][0][4] is mask


def test_the_static_decode_step_runs_packed_attention_under_the_sdpa_name(tiny_model, monkeypatch):
    """The static path's decode steps (not the prompt pass) run the packed attention in every layer, while the
    model's config still reads ``sdpa`` (model code that branches on the name is unchanged); transformers'
    table of attention functions is as before after the call; the samples are those of the same loop over
    transformers' SDPA (bit for bit here, on CPU)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert tiny_model.config.num_key_value_heads < tiny_model.config.num_attention_heads
    before = dict(ALL_ATTENTION_FUNCTIONS._local_mapping)  # other code may have set a local "sdpa" entry
    seen, real = [], att.packed_sdpa_forward

    def spy(module, query, *args, **kwargs):
        seen.append((query.shape[2], module.config._attn_implementation))
        return real(module, query, *args, **kwargs)

    monkeypatch.setattr(att, "packed_sdpa_forward", spy)
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]

    def sample():
        return sample_with_kv_cache(tiny_model, prompts, params, [], torch.Generator().manual_seed(2), pad_id=0,
                                    decode="static")  # fmt: skip

    packed = sample()
    assert seen == [(1, "sdpa")] * 5 * tiny_model.config.num_hidden_layers  # 5 decode steps, one query token
    assert ALL_ATTENTION_FUNCTIONS._local_mapping == before
    monkeypatch.setattr(g, "uses_grouped_sdpa", lambda model: False)
    plain = sample()
    assert len(seen) == 5 * tiny_model.config.num_hidden_layers
    assert packed["completion_ids"] == plain["completion_ids"]
    for a, b in zip(packed["logprobs"], plain["logprobs"]):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-6, rtol=0)


def test_the_switch_restores_a_local_sdpa_entry_on_error():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def mine(*args, **kwargs):
        return None

    before = ALL_ATTENTION_FUNCTIONS._local_mapping.get("sdpa")
    ALL_ATTENTION_FUNCTIONS["sdpa"] = mine
    try:
        with pytest.raises(RuntimeError, match="boom"), att.packed_decode_attention():
            assert ALL_ATTENTION_FUNCTIONS["sdpa"] is att.packed_sdpa_forward
            raise RuntimeError("boom")
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is mine
    finally:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]
        if before is not None:
            ALL_ATTENTION_FUNCTIONS["sdpa"] = before
