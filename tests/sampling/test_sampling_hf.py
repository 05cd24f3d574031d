"""HFSampler: KV-cache log-probs equal a full re-forward, temperature, truncation, EOS, padding, seeds, copies."""

from __future__ import annotations

import copy

import pytest
import torch
from sampling_fakes import NoAccelerator, make_fake_trainer

from triage.trainers.sampling import HFSampler, SamplingParams, encode_prompts, sample_with_kv_cache

CHATS = [
    [{"role": "user", "content": "What is 12 + 35?"}],
    [{"role": "user", "content": "Let x be such that 3x + 4 = 19. Find x, then compute 7 * 8 - 3."}],
    [{"role": "system", "content": "Solve it."}, {"role": "user", "content": "the sum of the digits"}],
]


def reforward_logprobs(model, prompt, completion, temperature):
    """log_softmax(logits / T) of each completion token from one full, unpadded, cache-free forward."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion]), use_cache=False).logits[0]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logits = logits[len(prompt) - 1 : -1] / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    ids = encode_prompts(CHATS, tokenizer)
    assert len({len(p) for p in ids}) == 3  # different lengths: the batch is left-padded
    return ids


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_kv_cache_logprobs_equal_full_reforward(tiny_model, tokenizer, prompt_ids, temperature):
    params = SamplingParams(max_new_tokens=12, temperature=temperature)
    g = torch.Generator().manual_seed(1)
    out = sample_with_kv_cache(
        tiny_model, prompt_ids, params, [tokenizer.eos_token_id], generator=g, pad_id=0
    )
    assert sum(len(c) for c in out["completion_ids"]) >= 12
    for p, c, lp in zip(prompt_ids, out["completion_ids"], out["logprobs"]):
        ref = reforward_logprobs(tiny_model, p, c, temperature)
        torch.testing.assert_close(torch.tensor(lp), ref, atol=2e-5, rtol=0)
    # the temperature really enters: the same tokens scored at T=1 differ
    if temperature != 1.0:
        p, c, lp = prompt_ids[0], out["completion_ids"][0], out["logprobs"][0]
        assert (torch.tensor(lp) - reforward_logprobs(tiny_model, p, c, 1.0)).abs().max() > 1e-3


def test_top_k_one_is_greedy_and_processed_logprob_is_zero(tiny_model, tokenizer, prompt_ids):
    params = SamplingParams(max_new_tokens=6, temperature=0.8, top_k=1)
    eos = [tokenizer.eos_token_id]
    temp = sample_with_kv_cache(tiny_model, prompt_ids, params, eos, pad_id=0)
    proc = sample_with_kv_cache(tiny_model, prompt_ids, params, eos, pad_id=0, logprobs_mode="processed")
    assert temp["completion_ids"] == proc["completion_ids"]
    for p, c, lp, plp in zip(prompt_ids, temp["completion_ids"], temp["logprobs"], proc["logprobs"]):
        with torch.no_grad():
            logits = tiny_model(torch.tensor([p + c])).logits[0, len(p) - 1 : -1]
        assert c == logits.argmax(-1).tolist()  # greedy
        assert plp == [0.0] * len(c)  # renormalised over the single kept token
        torch.testing.assert_close(
            torch.tensor(lp), reforward_logprobs(tiny_model, p, c, 0.8), atol=2e-5, rtol=0
        )
        assert max(lp) < 0


def test_left_padded_batch_equals_one_by_one(tiny_model, tokenizer, prompt_ids):
    params = SamplingParams(max_new_tokens=8, top_k=1)
    eos = [tokenizer.eos_token_id]
    batched = sample_with_kv_cache(tiny_model, prompt_ids, params, eos, pad_id=0)
    for i, p in enumerate(prompt_ids):
        alone = sample_with_kv_cache(tiny_model, [p], params, eos, pad_id=0)
        assert alone["completion_ids"][0] == batched["completion_ids"][i]
        torch.testing.assert_close(
            torch.tensor(alone["logprobs"][0]), torch.tensor(batched["logprobs"][i]), atol=2e-5, rtol=0
        )


def test_repetition_penalty_ignores_left_padding(tiny_model, tokenizer):
    # pad id = EOS (as on Qwen3): a penalised pad would lower EOS in a row padded only because of its batch-mates
    model, eos = copy.deepcopy(tiny_model), tokenizer.eos_token_id
    short = tokenizer("What is 12?")["input_ids"]
    longer = tokenizer("Let x be such that 3x + 4 = 19. Find x, then compute 7 * 8 - 3.")["input_ids"]
    assert eos not in short + longer
    with torch.no_grad():  # raise the short prompt's EOS logit by 4 so that EOS is a likely first token
        h = model.model(torch.tensor([short])).last_hidden_state[0, -1]
        model.lm_head.weight[eos] += 4.0 * h / h.norm() ** 2
    params = SamplingParams(max_new_tokens=1, repetition_penalty=1.5)

    def first_token_logps(batch):  # processed log-prob of each first token the short prompt drew
        g = torch.Generator().manual_seed(0)
        out = sample_with_kv_cache(
            model, batch * 32, params, [eos], generator=g, logprobs_mode="processed", pad_id=eos
        )
        rows = zip(out["completion_ids"][:: len(batch)], out["logprobs"][:: len(batch)])
        return {c[0]: lp[0] for c, lp in rows}

    alone, batched = first_token_logps([short]), first_token_logps([short, longer])
    common = sorted(alone.keys() & batched.keys())
    assert eos in common
    torch.testing.assert_close(
        torch.tensor([batched[t] for t in common]),
        torch.tensor([alone[t] for t in common]),
        atol=2e-5,
        rtol=0,
    )


def test_repetition_penalty_sees_the_completion_so_far(tiny_model, prompt_ids):
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    prompt = prompt_ids[0]
    params = SamplingParams(max_new_tokens=12, repetition_penalty=1.5)
    g = torch.Generator().manual_seed(0)
    out = sample_with_kv_cache(tiny_model, [prompt], params, [], generator=g, logprobs_mode="processed", pad_id=0)
    completion, logps = out["completion_ids"][0], out["logprobs"][0]
    penalty = RepetitionPenaltyLogitsProcessor(penalty=1.5)
    with torch.no_grad():
        logits = tiny_model(torch.tensor([prompt + completion])).logits[0].float()
    for t, token in enumerate(completion):  # step t penalises the prompt and the t tokens drawn before it
        scores = penalty(torch.tensor([prompt + completion[:t]]), logits[len(prompt) - 1 + t][None].clone())
        assert abs(torch.log_softmax(scores, -1)[0, token].item() - logps[t]) < 1e-4, t


def test_eos_stops_the_row_and_is_included(tiny_model, prompt_ids):
    params = SamplingParams(max_new_tokens=8, top_k=1)
    free = sample_with_kv_cache(tiny_model, prompt_ids, params, eos_ids=[], pad_id=0)
    assert all(len(c) == 8 for c in free["completion_ids"])  # no EOS: every row runs to max_new_tokens
    # make the 3rd greedy token of row 0 an EOS id: row 0 stops there (EOS included), the others go on
    stop = free["completion_ids"][0][2]
    out = sample_with_kv_cache(tiny_model, prompt_ids, params, eos_ids=[stop], pad_id=0)
    first = free["completion_ids"][0].index(stop)
    assert out["completion_ids"][0] == free["completion_ids"][0][: first + 1]
    assert len(out["logprobs"][0]) == first + 1
    for c in out["completion_ids"]:
        assert stop not in c[:-1]


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_finished_rows_are_checked_every_few_steps_without_changing_the_completions(
    tiny_model, prompt_ids, decode, monkeypatch
):
    from triage.trainers.sampling import hf

    params = SamplingParams(max_new_tokens=24, temperature=1.0)

    def gen():
        return torch.Generator().manual_seed(3)

    free = sample_with_kv_cache(tiny_model, prompt_ids, params, eos_ids=[], generator=gen(), pad_id=0, decode=decode)
    # EOS ids that end the rows early at different steps: for row r, its first token from step k on that no row
    # drew before step k (so no row stops sooner on it)
    stops = [
        next(t for t in free["completion_ids"][r][k:] if all(t not in c[:k] for c in free["completion_ids"]))
        for r, k in ((0, 1), (1, 3), (2, 5))
    ]
    ends = [min(c.index(t) for t in stops if t in c) + 1 for c in free["completion_ids"]]
    assert len(set(ends)) == 3 and max(ends) < 8 < params.max_new_tokens
    calls, outs = [], {}
    hook = tiny_model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        for every in (1, 3, hf.DONE_CHECK_EVERY):
            monkeypatch.setattr(hf, "DONE_CHECK_EVERY", every)
            calls.clear()
            outs[every] = sample_with_kv_cache(
                tiny_model, prompt_ids, params, eos_ids=stops, generator=gen(), pad_id=0, decode=decode
            )
            # the prefill, then one forward per step after the first; the loop ends at the first check after
            # the last row finished
            assert len(calls) == min(-(-max(ends) // every) * every, params.max_new_tokens)
    finally:
        hook.remove()
    for out in outs.values():
        assert out == outs[1]
        assert [len(c) for c in out["completion_ids"]] == ends
        assert out["completion_ids"] == [c[:n] for c, n in zip(free["completion_ids"], ends)]


@pytest.mark.parametrize("vocab", [5, 1000, 151936])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_draw_is_torch_multinomials_without_its_host_read(vocab, dtype):
    """``hf._draw`` (no validity check, so no host read per step) gives ``torch.multinomial(probs, 1)``'s
    tokens and leaves the generator in its state, with zero-probability tokens (top-k's -inf) among them."""
    from triage.trainers.sampling.hf import _draw

    for batch in (1, 16):
        g = torch.Generator().manual_seed(vocab + batch)
        logits = torch.randn(batch, vocab, generator=g, dtype=dtype) * 3
        logits[:, ::3] = -float("inf")
        probs = torch.softmax(logits, -1)
        ours, theirs = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
        for _ in range(3):
            assert torch.equal(_draw(probs, ours), torch.multinomial(probs, 1, generator=theirs).squeeze(1))
        assert torch.equal(ours.get_state(), theirs.get_state())


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_a_nan_distribution_is_an_error_naming_the_prompt(tiny_model, prompt_ids, decode):
    """A prompt whose logits turn NaN at a decode step fails the call with its index (found at the next done
    check), as ``torch.multinomial`` would have failed it, only without reading the GPU at every step."""
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    steps = []

    def poison(module, args, out):
        steps.append(1)
        if len(steps) == 3:  # the second decode step
            out[1] = float("nan")
        return out

    hook = tiny_model.lm_head.register_forward_hook(poison)
    try:
        with pytest.raises(ValueError, match=r"prompt\(s\) \[1\] is NaN at a sampling step ≤ 7"):
            sample_with_kv_cache(tiny_model, prompt_ids, params, [], torch.Generator().manual_seed(0), pad_id=0,
                                 decode=decode)  # fmt: skip
    finally:
        hook.remove()


def test_seed_makes_sampling_reproducible(tiny_model, tokenizer, prompt_ids):
    params = SamplingParams(max_new_tokens=10, temperature=1.5)
    runs = [HFSampler(tiny_model, params=params, seed=s).generate(prompt_ids) for s in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0]["completion_ids"] != runs[2]["completion_ids"]
    batched = HFSampler(tiny_model, params=params, seed=7, batch_size=2).generate(prompt_ids)
    assert [len(c) for c in batched["completion_ids"]] == [len(lp) for lp in batched["logprobs"]]


def test_bad_arguments_are_refused(tiny_model):
    with pytest.raises(ValueError, match="temperature must be > 0"):
        SamplingParams(temperature=0.0)
    with pytest.raises(ValueError, match="sampler_model='copy'"):
        HFSampler(tiny_model, dtype=torch.float64)
    with pytest.raises(ValueError, match="needs a model"):
        HFSampler(params=SamplingParams()).generate([[1, 2]])
    with pytest.raises(ValueError, match="prompt entry 1 has no token"):
        HFSampler(tiny_model, params=SamplingParams()).generate([[1, 2], []])
    with pytest.raises(ValueError, match="logprobs_mode"):
        HFSampler(tiny_model, logprobs_mode="raw")


def test_rollout_func_contract_with_fake_trainer(tiny_model, tokenizer):
    trainer = make_fake_trainer(tokenizer, tiny_model, max_completion_length=5, temperature=0.9)
    trainer.model_wrapped = tiny_model
    trainer.accelerator = NoAccelerator()
    prompts = [CHATS[0], CHATS[0], CHATS[1], CHATS[1]]  # num_generations = 2, contiguous
    out = HFSampler(seed=0)(prompts, trainer)
    assert set(out) == {"prompt_ids", "completion_ids", "logprobs"}
    assert out["prompt_ids"] == encode_prompts(prompts, tokenizer)
    assert len(out["completion_ids"]) == 4 and all(1 <= len(c) <= 5 for c in out["completion_ids"])
    text = HFSampler(seed=0)(["What is 1 + 1?"] * 2, trainer)
    assert text["prompt_ids"][0] == tokenizer("What is 1 + 1?")["input_ids"]


def test_copy_mode_casts_prepares_and_resyncs_on_step_change(tiny_model, tokenizer):
    model = copy.deepcopy(tiny_model)
    trainer = make_fake_trainer(tokenizer, model, max_completion_length=4)
    trainer.model_wrapped = model
    trainer.accelerator = NoAccelerator()
    prepared = []

    def prepare(m):
        prepared.append(m)
        return m

    sampler = HFSampler(sampler_model="copy", dtype=torch.float64, prepare_model=prepare, seed=0)
    out = sampler([CHATS[0]] * 2, trainer)
    assert sampler.copy is not model and next(sampler.copy.parameters()).dtype == torch.float64
    assert len(prepared) == 1 and not any(p.requires_grad for p in sampler.copy.parameters())
    for p, c, lp in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"]):
        torch.testing.assert_close(
            torch.tensor(lp, dtype=torch.float64), reforward_logprobs(sampler.copy, p, c, 1.0)
        )
    sampler([CHATS[0]] * 2, trainer)
    assert len(prepared) == 1  # same step: no resync
    built = sampler.copy
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    trainer.state.global_step = 1
    sampler([CHATS[0]] * 2, trainer)
    assert len(prepared) == 1 and sampler.copy is built  # refreshed in place with the new weights
    torch.testing.assert_close(sampler.copy.model.norm.weight, model.model.norm.weight.double())

    inplace = HFSampler(sampler_model="copy", seed=0)
    inplace([CHATS[0]] * 2, trainer)
    first_copy = inplace.copy
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    trainer.state.global_step = 2
    inplace([CHATS[0]] * 2, trainer)
    assert inplace.copy is first_copy  # refreshed in place
    torch.testing.assert_close(inplace.copy.model.norm.weight, model.model.norm.weight)


def test_copy_keeps_rope_inv_freq_at_the_source_precision(tiny_model):
    # like from_pretrained(dtype=bf16) and the engines: RoPE frequencies stay fp32 under a bf16 copy
    dup = HFSampler(sampler_model="copy", dtype=torch.bfloat16)._build_copy(tiny_model)
    assert next(dup.parameters()).dtype == torch.bfloat16
    source = dict(tiny_model.named_buffers())
    inv_freq = {n: b for n, b in dup.named_buffers() if n.endswith("inv_freq")}
    assert inv_freq
    for name, buf in inv_freq.items():
        assert buf.dtype == torch.float32 and torch.equal(buf, source[name]), name
        assert buf.data_ptr() != source[name].data_ptr()  # the copy's own tensor


# -- static KV cache (the CUDA-graph path's cache) -------------------------------------------------------------


@pytest.mark.parametrize("kv_cache_dtype", [None, "fp8_e4m3"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_static_cache_decode_matches_dynamic(tiny_model, tokenizer, prompt_ids, kv_cache_dtype, attn):
    """The static cache (pre-allocated, 4-D mask updated in place) samples the same tokens as the dynamic one
    and reports the same log-probs up to rounding; with a native cache both equal a full re-forward."""
    model = copy.deepcopy(tiny_model)
    model.config._attn_implementation = attn
    params = SamplingParams(max_new_tokens=10, temperature=0.9)
    eos = [tokenizer.eos_token_id]
    runs = {
        d: sample_with_kv_cache(
            model, prompt_ids, params, eos, torch.Generator().manual_seed(3), pad_id=0,
            kv_cache_dtype=kv_cache_dtype, decode=d,
        )
        for d in ("dynamic", "static")
    }
    assert runs["static"]["completion_ids"] == runs["dynamic"]["completion_ids"]
    assert sum(len(c) for c in runs["static"]["completion_ids"]) >= 10
    for a, b in zip(runs["static"]["logprobs"], runs["dynamic"]["logprobs"]):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=2e-5, rtol=0)
    if kv_cache_dtype is None:
        for p, c, lp in zip(prompt_ids, runs["static"]["completion_ids"], runs["static"]["logprobs"]):
            torch.testing.assert_close(torch.tensor(lp), reforward_logprobs(model, p, c, 0.9), atol=2e-5, rtol=0)


def test_static_cache_fp8_rounds_like_dynamic(tiny_model, tokenizer, prompt_ids):
    """An fp8 cache changes the log-probs (it is a real numerics option) identically on both paths."""
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    eos = [tokenizer.eos_token_id]

    def run(decode, kv):
        return sample_with_kv_cache(
            tiny_model, prompt_ids, params, eos, torch.Generator().manual_seed(5), pad_id=0,
            kv_cache_dtype=kv, decode=decode,
        )

    native, fp8 = run("static", None), run("static", "fp8_e4m3")
    gaps = [
        (torch.tensor(a) - reforward_logprobs(tiny_model, p, c, 1.0)).abs().max()
        for p, c, a in zip(prompt_ids, fp8["completion_ids"], fp8["logprobs"])
    ]
    assert max(gaps) > 1e-4  # the fp8 cache is not a no-op
    assert native["completion_ids"] != [] and fp8["completion_ids"] != []


def _autocast_forward(model):
    """``model`` with its forward under bf16 autocast, as accelerate's mixed precision wraps a trainer's model
    (what a ``sampler_model="shared"`` sampler sees with ``bf16: true``)."""
    forward = model.forward

    def wrapped(*args, **kwargs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return forward(*args, **kwargs)

    model.forward = wrapped
    return model


def _lora(model):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, task_type="CAUSAL_LM"
    )
    return get_peft_model(model, config).eval()


@pytest.mark.parametrize("wrap, atol", [(_autocast_forward, 5e-3), (_lora, 2e-5)], ids=["autocast", "peft"])
def test_static_cache_decode_matches_dynamic_under_autocast_and_peft(
    tiny_model, tokenizer, prompt_ids, wrap, atol
):
    """The static path sees the model as the dynamic one does under a bf16-autocast forward (keys and values
    in the dtypes autocast gives them, the cache buffers allocated in those) and through a PEFT wrapper."""
    model = wrap(copy.deepcopy(tiny_model))
    params = SamplingParams(max_new_tokens=10, temperature=0.9)
    runs = {
        d: sample_with_kv_cache(
            model,
            prompt_ids,
            params,
            [tokenizer.eos_token_id],
            torch.Generator().manual_seed(3),
            pad_id=0,
            kv_cache_dtype="fp8_e4m3",
            decode=d,
        )
        for d in ("dynamic", "static")
    }
    assert runs["static"]["completion_ids"] == runs["dynamic"]["completion_ids"]
    assert sum(len(c) for c in runs["static"]["completion_ids"]) >= 10
    for a, b in zip(runs["static"]["logprobs"], runs["dynamic"]["logprobs"]):
        # autocast: bf16 GEMMs, whose rounding the two caches' attention shapes change
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=atol, rtol=0)


def test_decode_choice_is_validated(tiny_model, tokenizer, prompt_ids):
    params = SamplingParams(max_new_tokens=2)
    with pytest.raises(ValueError, match="decode must be one of"):
        sample_with_kv_cache(tiny_model, prompt_ids, params, [0], decode="graph")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        sample_with_kv_cache(tiny_model, prompt_ids, params, [0], decode="cuda_graph")
    with pytest.raises(ValueError, match="decode must be one of"):
        HFSampler(decode="fast")
    other = copy.deepcopy(tiny_model)
    other.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="needs a static KV cache"):
        sample_with_kv_cache(other, prompt_ids, params, [0], decode="static")


def test_auto_decode_keeps_the_dynamic_cache_for_a_sliding_window_model(tiny_model, tokenizer, prompt_ids):
    """``"auto"`` picks the CUDA-graph path only where a static cache can be built: a model with a
    sliding-window layer (no plain ``StaticLayer``) decodes on the dynamic cache, also on CUDA; asking for the
    static path explicitly is an error naming the layer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from triage.trainers.sampling.hf import _resolve_decode

    cuda = torch.device("cuda")  # a device object only: nothing runs on it
    assert _resolve_decode("auto", tiny_model, cuda) == "cuda_graph"
    sliding = dict(use_sliding_window=True, sliding_window=8, max_window_layers=1, layer_types=None)
    config = Qwen3Config(**{**tiny_model.config.to_dict(), **sliding})
    model = Qwen3ForCausalLM._from_config(config, attn_implementation="sdpa").eval()
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    assert _resolve_decode("auto", model, cuda) == "dynamic"
    with pytest.raises(ValueError, match="needs a static KV cache: layer 1 .* StaticSlidingWindowLayer"):
        sample_with_kv_cache(model, prompt_ids, SamplingParams(max_new_tokens=2), [0], decode="static")
    out = sample_with_kv_cache(model, prompt_ids, SamplingParams(max_new_tokens=2), [0], decode="auto")
    assert [len(c) for c in out["completion_ids"]] == [2, 2, 2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_decode_is_bit_identical_to_static(tiny_model, tokenizer, prompt_ids):
    model = copy.deepcopy(tiny_model).cuda()
    params = SamplingParams(max_new_tokens=16, temperature=1.0)
    runs = [
        sample_with_kv_cache(
            model, prompt_ids, params, [tokenizer.eos_token_id],
            torch.Generator("cuda").manual_seed(7), pad_id=0, decode=d,
        )
        for d in ("static", "cuda_graph")
    ]
    assert runs[0] == runs[1]
