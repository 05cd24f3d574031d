"""SGLang and vLLM clients end to end against a fake server on 127.0.0.1: schema, batching, errors, timeouts."""

from __future__ import annotations

import time

import pytest
from sampling_fakes import EOS, fake_completion

from triage.trainers.sampling import (
    EngineError,
    HTTPOptions,
    RolloutValidationError,
    SamplingParams,
    SGLangClient,
    VLLMServerClient,
    encode_prompts,
    make_sampler,
)
from triage.trainers.sampling.vllm_server import runs_of_identical

CHATS = [
    [{"role": "user", "content": "What is 12 + 35?"}],
    [{"role": "user", "content": "Compute 7 * 8 - 3."}],
]
PROMPTS = [CHATS[0]] * 3 + [CHATS[1]] * 3  # num_generations = 3, contiguous as TRL sends them
FAST = HTTPOptions(timeout_s=5.0, max_retries=1, backoff_s=0.01, batch_size=4, max_concurrency=2)


def clients(url, **kw):
    return [SGLangClient(url, http=FAST, **kw), VLLMServerClient(url, "tiny", http=FAST, **kw)]


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_rollout_contract_and_parsing(fake_server, fake_trainer, tokenizer, kind):
    one_request = HTTPOptions(timeout_s=5.0, batch_size=8)  # a deterministic sample order in the fake
    client = (
        SGLangClient(fake_server.url, http=one_request) if kind == "sglang" else clients(fake_server.url)[1]
    )
    out = client(PROMPTS, fake_trainer)
    prompt_ids = encode_prompts(PROMPTS, tokenizer)
    assert out["prompt_ids"] == prompt_ids
    assert len(out["completion_ids"]) == len(out["logprobs"]) == 6
    max_new = fake_trainer.args.max_completion_length
    for i, (p, c, lp) in enumerate(zip(prompt_ids, out["completion_ids"], out["logprobs"])):
        ids, lps, _ = fake_completion(p, i % 3, max_new)  # sample index within its group
        assert (c, lp) == (ids, lps)
    assert len({tuple(c) for c in out["completion_ids"][:3]}) == 3  # repeats got different samples


def test_sglang_request_follows_the_native_schema(fake_server, fake_trainer):
    client = SGLangClient(fake_server.url + "/", http=FAST)  # trailing slash tolerated
    client(PROMPTS, fake_trainer)
    assert [path for path, _ in fake_server.requests] == ["/generate", "/generate"]  # 6 entries, batches of 4
    body = max(
        (b for _, b in fake_server.requests), key=lambda b: len(b["input_ids"])
    )  # arrival order varies
    assert body["return_logprob"] is True and len(body["input_ids"]) == 4
    assert body["sampling_params"] == {
        "max_new_tokens": 6,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "stop_token_ids": [EOS],
    }


def test_vllm_request_uses_n_token_ids_and_logprobs(fake_server, fake_trainer):
    client = VLLMServerClient(
        fake_server.url + "/v1", "tiny", http=FAST, extra_body={"skip_special_tokens": False}
    )
    client(PROMPTS, fake_trainer)
    assert [path for path, _ in fake_server.requests] == ["/v1/completions"] * 2  # 2 x 3 entries > batch 4
    body = fake_server.requests[0][1]
    assert body["n"] == 3 and len(body["prompt"]) == 1 and body["model"] == "tiny"
    assert body["logprobs"] == 0 and body["return_tokens_as_token_ids"] is True
    assert body["top_k"] == -1 and body["stop_token_ids"] == [EOS] and body["skip_special_tokens"] is False
    assert runs_of_identical([[1], [1], [2], [1]]) == [([1], 2), ([2], 1), ([1], 1)]


def test_seeds_are_deterministic_and_distinct(fake_server, fake_trainer):
    params = SamplingParams(max_new_tokens=5, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05)
    for client in clients(fake_server.url, seed=100, params=params):
        fake_server.requests.clear()
        out = client(PROMPTS, fake_trainer)
        assert len({tuple(c) for c in out["completion_ids"][:3]}) >= 2
        bodies = [b for _, b in fake_server.requests]
        if isinstance(client, SGLangClient):
            seeds = sorted(sp["sampling_seed"] for b in bodies for sp in b["sampling_params"])
            assert bodies[0]["sampling_params"][0]["top_k"] == 20
        else:
            seeds = sorted(b["seed"] for b in bodies)
            assert all(b["n"] == 3 for b in bodies) and bodies[0]["min_p"] == 0.05
        assert seeds == list(range(100, 100 + len(seeds)))


def test_seed_counter_survives_a_checkpoint(fake_server, fake_trainer):
    """A client restored from ``state_dict`` continues the seed sequence (a resumed run redraws nothing)."""

    def seeds_of_one_call(client):
        fake_server.requests.clear()
        client(PROMPTS, fake_trainer)
        bodies = [b for _, b in fake_server.requests]
        if isinstance(client, SGLangClient):
            return sorted(sp["sampling_seed"] for b in bodies for sp in b["sampling_params"])
        return sorted(b["seed"] for b in bodies)

    for client, fresh in zip(clients(fake_server.url, seed=100), clients(fake_server.url, seed=100)):
        first = seeds_of_one_call(client)
        state = client.state_dict()
        assert state == {"counter": len(first)}
        fresh.load_state_dict(state)
        assert seeds_of_one_call(fresh) == seeds_of_one_call(client) == [s + len(first) for s in first]


def test_seeds_are_offset_per_process(fake_server, fake_trainer):
    from types import SimpleNamespace

    fake_trainer.accelerator = SimpleNamespace(process_index=1, num_processes=2)
    for client in clients(fake_server.url, seed=100):
        fake_server.requests.clear()
        client(PROMPTS[:3], fake_trainer)
        body = fake_server.requests[0][1]
        seed = (
            body["sampling_params"][0]["sampling_seed"] if isinstance(client, SGLangClient) else body["seed"]
        )
        assert seed == 100 + 1_000_003


def test_generation_kwargs_override_or_are_refused(fake_server, fake_trainer):
    fake_trainer.args.generation_kwargs = {"top_k": 7, "max_tokens": 3}
    SGLangClient(fake_server.url, http=FAST)(PROMPTS[:3], fake_trainer)
    sampling = fake_server.requests[0][1]["sampling_params"]
    assert sampling["top_k"] == 7 and sampling["max_new_tokens"] == 3
    fake_trainer.args.generation_kwargs = {"stop": ["\\n"]}
    with pytest.raises(ValueError, match="generation_kwargs \\['stop'\\] are not understood"):
        SGLangClient(fake_server.url, http=FAST)(PROMPTS[:3], fake_trainer)


def test_sampling_params_from_args_none_values():
    from types import SimpleNamespace

    from triage.trainers.sampling import SamplingParams

    args = SimpleNamespace(
        max_completion_length=8, temperature=0.7, generation_kwargs={"top_k": None, "top_p": None}
    )
    params = SamplingParams.from_args(args)
    assert (params.top_k, params.top_p, params.max_new_tokens) == (0, 1.0, 8)  # None: the filter is off
    with pytest.raises(ValueError, match="temperature.*None"):
        SamplingParams.from_args(
            SimpleNamespace(max_completion_length=8, temperature=0.7, generation_kwargs={"temperature": None})
        )
    with pytest.raises(ValueError, match="max_completion_length"):
        SamplingParams.from_args(SimpleNamespace(max_completion_length=None, temperature=1.0))


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_http_error_carries_the_server_message(fake_server, fake_trainer, kind):
    fake_server.mode = "http_error"
    message = "max_new_tokens must be positive" if kind == "sglang" else "model 'nope' does not exist"
    with pytest.raises(EngineError, match=f"HTTP 400.*{message}"):
        clients(fake_server.url)[kind == "vllm"](PROMPTS, fake_trainer)


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_timeout_is_bounded(fake_server, fake_trainer, kind):
    fake_server.mode = "slow"
    opts = HTTPOptions(timeout_s=0.3, max_retries=1, backoff_s=0.01, batch_size=8)
    client = (
        SGLangClient(fake_server.url, http=opts)
        if kind == "sglang"
        else VLLMServerClient(fake_server.url, "m", http=opts)
    )
    start = time.monotonic()
    with pytest.raises(EngineError, match="failed after 2 attempt"):
        client(PROMPTS, fake_trainer)
    assert time.monotonic() - start < 3.0


def test_unreachable_server_and_retry_after_503(fake_server, fake_trainer):
    dead = SGLangClient("http://127.0.0.1:9", http=HTTPOptions(timeout_s=0.5, max_retries=1, backoff_s=0.01))
    with pytest.raises(EngineError, match="failed after 2 attempt"):
        dead(PROMPTS, fake_trainer)
    fake_server.mode = "unavailable_once"
    out = SGLangClient(fake_server.url, http=FAST)(PROMPTS[:2], fake_trainer)  # one request: 503, then OK
    assert len(out["completion_ids"]) == 2 and len(fake_server.requests) == 2


@pytest.mark.parametrize(
    "mode, kind, error, match",
    [
        ("abort", "sglang", EngineError, "aborted entry 0: request aborted: KV cache full"),
        ("wrong_count", "sglang", EngineError, "answered 3 results for 4 prompts"),
        ("wrong_count", "vllm", EngineError, "answered 2 choices for 1 prompts x n=3"),
        ("not_json", "sglang", EngineError, "non-JSON"),
        ("bad_token", "vllm", EngineError, "token 'hello' is not 'token_id:<id>'"),
        ("token_ids_disagree", "vllm", EngineError, "disagree with logprobs.tokens"),
        (
            "null_logprob",
            "sglang",
            RolloutValidationError,
            "sample 0 .*position 0: log-prob None \\(missing\\)",
        ),
        ("nan_logprob", "vllm", RolloutValidationError, "sample 0 .*returned NaN"),
        (
            "neg_inf",
            "vllm",
            RolloutValidationError,
            "sample 0 .*position 0: .*returned -inf for a sampled token",
        ),
        ("empty", "sglang", RolloutValidationError, "sample 0 .*completion is empty"),
        ("early_eos", "vllm", RolloutValidationError, "sample 0 .*EOS id 2 before the last token"),
        ("out_of_vocab", "sglang", RolloutValidationError, "sample 0 .*token id 500 is not in \\[0, "),
    ],
)
def test_engine_misbehaviour_is_named(fake_server, fake_trainer, mode, kind, error, match):
    fake_server.mode = mode
    with pytest.raises(error, match=match) as e:
        clients(fake_server.url)[kind == "vllm"](PROMPTS, fake_trainer)
    if error is RolloutValidationError:
        assert "What is 12 + 35?" in str(e.value)  # the prompt head


def test_weight_sync_hook_runs_on_step_change(fake_server, fake_trainer):
    steps = []
    client = make_sampler(
        "sglang", base_url=fake_server.url, http=FAST, weight_sync=lambda t: steps.append(t.state.global_step)
    )
    client(PROMPTS[:3], fake_trainer)
    client(PROMPTS[:3], fake_trainer)
    fake_trainer.state.global_step = 4
    client(PROMPTS[:3], fake_trainer)
    assert steps == [0, 4]


def test_factory_and_options_validation():
    assert isinstance(make_sampler("vllm-server", base_url="http://x", model="m"), VLLMServerClient)
    with pytest.raises(ValueError, match="unknown sampler kind 'tgi'"):
        make_sampler("tgi")
    with pytest.raises(ValueError, match="served model name"):
        VLLMServerClient("http://x", "")
    with pytest.raises(ValueError, match="batch_size"):
        HTTPOptions(batch_size=0)
