"""HFSampler ``kv_cache_dtype``: an fp8 (e4m3) KV cache moves the log-probs slightly, a bf16 one on a bf16
model does not; the trainer's ``sampler_kwargs`` pass it through; bad values are errors."""

from __future__ import annotations

import copy

import pytest
import torch

from triage.trainers.grpo_trainer import resolve_sampler_kwargs
from triage.trainers.sampling import (
    HFSampler,
    SamplingParams,
    encode_prompts,
    make_sampler,
    sample_with_kv_cache,
)

CHATS = [
    [{"role": "user", "content": "What is 12 + 35?"}],
    [{"role": "user", "content": "Let x be such that 3x + 4 = 19. Find x, then compute 7 * 8 - 3."}],
    [{"role": "user", "content": "Compute 7 * 8 - 3."}],
]
PARAMS = SamplingParams(max_new_tokens=16, temperature=1.0)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return encode_prompts(CHATS, tokenizer)


def _sample(model, prompt_ids, tokenizer, kv_cache_dtype, params=PARAMS):
    g = torch.Generator().manual_seed(7)
    eos = [tokenizer.eos_token_id]
    return sample_with_kv_cache(model, prompt_ids, params, eos, generator=g, kv_cache_dtype=kv_cache_dtype)


def _reforward(model, prompt, completion):
    """log_softmax of each completion token from one full cache-free fp32 forward (the learner's view)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion]), use_cache=False).logits[0].float()
    logits = logits[len(prompt) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]


def _gap(model, prompt_ids, out):
    """Token-mean |sampler log-prob − re-forward log-prob| over the batch."""
    gaps = [
        (torch.tensor(lp) - _reforward(model, p, c)).abs()
        for p, c, lp in zip(prompt_ids, out["completion_ids"], out["logprobs"])
    ]
    return torch.cat(gaps)


def test_bf16_cache_on_bf16_model_changes_nothing(tiny_model, tokenizer, prompt_ids):
    model = copy.deepcopy(tiny_model).to(torch.bfloat16)
    native = _sample(model, prompt_ids, tokenizer, None)
    bf16 = _sample(model, prompt_ids, tokenizer, "bf16")
    assert bf16["completion_ids"] == native["completion_ids"]
    assert bf16["logprobs"] == native["logprobs"]  # bit for bit: rounding bf16 to bf16 is the identity
    assert _sample(model, prompt_ids, tokenizer, "auto") == native


def test_fp8_scales_ignore_left_padding(tiny_model, tokenizer):
    # the fp8 scales are calibrated on the prefill's valid positions: a row's log-probs do not depend on what
    # the pad id's embedding is (the long prompt is never padded; the short one is mostly padding)
    short = tokenizer("What is 12?")["input_ids"]
    longer = tokenizer("Let x be such that 3x + 4 = 19. Find x, then compute 7 * 8 - 3. " * 2)["input_ids"]
    pad = tokenizer.eos_token_id
    params = SamplingParams(max_new_tokens=4, top_k=1)
    loud = copy.deepcopy(tiny_model)
    # untie the LM head so that only the pad's input embedding changes
    loud.lm_head.weight = torch.nn.Parameter(loud.lm_head.weight.detach().clone())
    with torch.no_grad():
        emb = loud.get_input_embeddings().weight
        emb[pad] = 100 * torch.randn(emb.shape[1], generator=torch.Generator().manual_seed(0))
    quiet, noisy = (
        sample_with_kv_cache(m, [short, longer], params, [pad], pad_id=pad, kv_cache_dtype="fp8")
        for m in (tiny_model, loud)
    )
    assert noisy["completion_ids"] == quiet["completion_ids"] and len(quiet["logprobs"][1]) == 4
    assert noisy["logprobs"] == quiet["logprobs"]


def test_fp8_cache_moves_logprobs_slightly(tiny_model, tokenizer, prompt_ids):
    native = _sample(tiny_model, prompt_ids, tokenizer, None)
    fp8 = _sample(tiny_model, prompt_ids, tokenizer, "fp8_e4m3")
    # fp32 model, native cache: the sampler's log-probs are the re-forward's (the HF sampler's own contract)
    assert _gap(tiny_model, prompt_ids, native).max() < 2e-5
    gap = _gap(tiny_model, prompt_ids, fp8)
    assert gap.numel() >= 16
    # fp8 keys/values: a small but real gap on most tokens (e4m3 has a 3-bit mantissa: ~3 % relative error)
    assert gap.mean() > 1e-3, gap
    assert (gap > 1e-5).float().mean() > 0.5
    assert gap.mean() < 0.2 and torch.isfinite(gap).all(), gap
    # the alias and the sampler class give the same numbers
    assert _sample(tiny_model, prompt_ids, tokenizer, "fp8") == fp8
    sampler = HFSampler(tiny_model, params=PARAMS, seed=7, kv_cache_dtype="fp8_e4m3")
    assert sampler.generate(prompt_ids, eos_ids=[tokenizer.eos_token_id]) == fp8


def test_fp8_cache_is_the_diagnostics_emulation(tiny_model, tokenizer, prompt_ids, monkeypatch):
    """The sampler builds its cache with ``triage.trainers.sampling.kvcache.kv_cache`` (no copy of it)."""
    from triage.trainers.sampling import kvcache

    calls = []
    real = kvcache.kv_cache

    def spy(config, fmt="native", *args, **kwargs):
        calls.append(fmt)
        return real(config, fmt, *args, **kwargs)

    monkeypatch.setattr(kvcache, "kv_cache", spy)
    _sample(tiny_model, prompt_ids[:1], tokenizer, "fp8_e4m3", SamplingParams(max_new_tokens=2))
    _sample(tiny_model, prompt_ids[:1], tokenizer, None, SamplingParams(max_new_tokens=2))
    assert calls == ["fp8"]


def test_trainer_sampler_kwargs_pass_kv_cache_dtype_through():
    kw = resolve_sampler_kwargs("hf", {"precision": "bf16", "kv_cache_dtype": "fp8_e4m3", "seed": 1})
    assert kw["kv_cache_dtype"] == "fp8_e4m3" and kw["sampler_model"] == "copy"
    sampler = make_sampler("hf", **kw)
    assert sampler.kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match="fp8_e5m2"):
        resolve_sampler_kwargs("hf", {"precision": "bf16", "kv_cache_dtype": "fp8_e5m2"})


@pytest.mark.parametrize("bad", ["fp8_e5m2", "int8", 8, ["fp8"]])
def test_bad_kv_cache_dtype_is_a_clear_error(tiny_model, tokenizer, prompt_ids, bad):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        HFSampler(tiny_model, kv_cache_dtype=bad)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        sample_with_kv_cache(tiny_model, prompt_ids, PARAMS, [0], kv_cache_dtype=bad)
