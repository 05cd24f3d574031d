"""Client for vLLM's OpenAI-compatible ``/v1/completions`` endpoint (``vllm serve``), token ids in and out.

Prompt entries arrive as runs of ``num_generations`` identical prompts; each run becomes one prompt with
``n = run length`` (vLLM samples the ``n`` completions independently and shares the prefill). Runs of equal
length are batched into one request of up to ``HTTPOptions.batch_size`` prompt entries::

    {"model", "prompt": [[ids], ...], "n", "max_tokens", "temperature", "top_p", "top_k" (-1 = off), "min_p",
     "repetition_penalty", "stop_token_ids", "logprobs": 0, "return_tokens_as_token_ids": true}

``logprobs: 0`` asks for the sampled token's log-prob only; ``return_tokens_as_token_ids`` makes vLLM spell each
token as ``"token_id:<id>"`` so ids survive the text round trip. Response: ``choices[j]`` for prompt ``i`` and
sample ``s`` at index ``i * n + s``, with ``logprobs.tokens`` and ``logprobs.token_logprobs`` (one per generated
token, the EOS included); vLLM clamps ``-inf`` to ``-9999.0`` (validation reports it as ``-inf``). When the
server also returns ``token_ids`` (``return_token_ids``, recent vLLM), they must equal the parsed ids.

With ``seed`` set, every run is its own request with ``seed = seed + 1000003 × process index + running run counter`` (vLLM's seed is per
request; sharing one seed across identical prompts would duplicate samples).

Log-prob semantics: set by the server's ``--logprobs-mode``. The default ``raw_logprobs`` is the model's
``log_softmax(logits)`` **before** temperature: start the server with ``--logprobs-mode processed_logprobs`` (as
``trl vllm-serve`` does) for log-probs after temperature (and after the top-k/top-p mask when those are on).
This client does not talk to ``trl vllm-serve`` (a different API).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .base import SamplingParams
from .http_json import EngineError, HTTPOptions, ServerClient

TOKEN_PREFIX = "token_id:"


def runs_of_identical(prompt_ids: Sequence[Sequence[int]]) -> list[tuple[list[int], int]]:
    """Contiguous runs of equal prompts as ``(prompt, run length)``, in order."""
    runs: list[tuple[list[int], int]] = []
    for p in prompt_ids:
        p = list(p)
        if runs and runs[-1][0] == p:
            runs[-1] = (p, runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs


def parse_token(token: Any, where: str) -> int:
    """``"token_id:123"`` -> 123."""
    if isinstance(token, str) and token.startswith(TOKEN_PREFIX):
        try:
            return int(token[len(TOKEN_PREFIX) :])
        except ValueError:
            pass
    raise EngineError(
        f"{where}: token {token!r} is not 'token_id:<id>'; the server ignored return_tokens_as_token_ids "
        "(is it a vLLM OpenAI server?)"
    )


class VLLMServerClient(ServerClient):
    """TRL ``rollout_func`` backed by a ``vllm serve`` OpenAI-compatible server.

    Args:
        base_url: e.g. ``"http://127.0.0.1:8000"`` (a trailing ``/v1`` is accepted).
        model: the served model name (the request's ``model`` field).
        params: sampling parameters (``None``: from ``trainer.args`` at every call).
        seed: per-request seed base (``None``: the server's RNG).
        http: timeouts, retries, batch size, concurrency.
        extra_body: merged into every request (e.g. ``{"skip_special_tokens": False}``).
        weight_sync: see :class:`~triage.trainers.sampling.base.SamplerSource`.
    """

    name = "vllm-server"
    engine = "vLLM"
    endpoint = "/v1/completions"

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        params: SamplingParams | None = None,
        seed: int | None = None,
        http: HTTPOptions | None = None,
        extra_body: dict | None = None,
        weight_sync: Callable[[Any], None] | None = None,
        validate: bool = True,
    ):
        if not model:
            raise ValueError("VLLMServerClient needs the served model name (model=...)")
        super().__init__(
            base_url, params=params, seed=seed, http=http, weight_sync=weight_sync, validate=validate
        )
        self.model = model
        self.extra_body = dict(extra_body or {})

    def request_body(
        self, prompts: list[list[int]], n: int, params: SamplingParams, eos_ids: Sequence[int]
    ) -> dict:
        """The ``/v1/completions`` body for ``prompts``, each sampled ``n`` times."""
        return {
            "model": self.model,
            "prompt": prompts,
            "n": n,
            **self.sampling_fields(params, eos_ids),
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            **self.extra_body,
        }

    def _plan(self, runs: list[tuple[list[int], int]]) -> list[tuple[list[list[int]], int, int | None]]:
        """Requests as ``(prompts, n, seed)``: equal-length runs packed up to ``batch_size`` entries."""
        seeds = self.take_seeds(len(runs))
        if seeds is not None:
            return [([p], n, s) for (p, n), s in zip(runs, seeds)]
        plan: list[tuple[list[list[int]], int, int | None]] = []
        for p, n in runs:
            if plan and plan[-1][1] == n and (len(plan[-1][0]) + 1) * n <= self.http.batch_size:
                plan[-1][0].append(p)
            else:
                plan.append(([p], n, None))
        return plan

    def _request(self, prompts: list[list[int]], n: int, seed: int | None, params, eos_ids) -> list[tuple]:
        body = self.request_body(prompts, n, params, eos_ids)
        if seed is not None:
            body["seed"] = seed
        answer = self.post(body)
        choices = answer.get("choices") if isinstance(answer, dict) else None
        if not isinstance(choices, list) or len(choices) != len(prompts) * n:
            got = len(choices) if isinstance(choices, list) else "no"
            raise self.error(
                f"answered {got} choices for {len(prompts)} prompts x n={n}: {str(answer)[:200]}"
            )
        choices = sorted(choices, key=lambda c: c.get("index", 0) if isinstance(c, dict) else 0)
        return [self.parse(c, j) for j, c in enumerate(choices)]

    def parse(self, choice: Any, index: int) -> tuple[list, list]:
        """(completion ids, log-probs) of one choice; ``index`` names it in errors."""
        where = f"vLLM choice {index}"
        logprobs = choice.get("logprobs") if isinstance(choice, dict) else None
        if not isinstance(logprobs, dict) or not isinstance(logprobs.get("tokens"), list):
            raise EngineError(
                f"{where} has no logprobs.tokens (the request set logprobs=0): {str(choice)[:200]}"
            )
        tokens, values = logprobs["tokens"], logprobs.get("token_logprobs")
        if not isinstance(values, list) or len(values) != len(tokens):
            raise EngineError(f"{where}: logprobs.token_logprobs does not match logprobs.tokens in length")
        ids = [parse_token(tok, f"{where}, token {t}") for t, tok in enumerate(tokens)]
        token_ids = choice.get("token_ids")
        if token_ids is not None and list(token_ids) != ids:
            raise EngineError(
                f"{where}: token_ids {token_ids[:8]}... disagree with logprobs.tokens {ids[:8]}..."
            )
        return ids, values

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, eos_ids: Sequence[int]) -> dict:
        plan = self._plan(runs_of_identical(prompt_ids))
        return self.rollout(self.fan_out(lambda r: self._request(*r, params, eos_ids), plan))
