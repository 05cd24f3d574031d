"""Client for SGLang's native ``/generate`` endpoint (token ids in, token ids + log-probs out).

Request (one per batch of ``HTTPOptions.batch_size`` prompt entries; SGLang's radix cache shares the prompt
prefix of the ``num_generations`` repeats, and its docs recommend repeating prompts over ``n > 1``)::

    {"input_ids": [[...], ...], "return_logprob": true,
     "sampling_params": {"max_new_tokens", "temperature", "top_p", "top_k" (-1 = off), "min_p",
                         "repetition_penalty", "stop_token_ids"}}

All sampling parameters are sent explicitly: SGLang otherwise takes defaults from the model's
``generation_config.json``. With ``seed`` set, ``sampling_params`` is a per-entry list carrying
``sampling_seed`` (seed + 1000003 × process index + running entry counter); that field needs a recent SGLang.

Response: a list with one object per entry; ``meta_info.output_token_logprobs`` is a list of
``[logprob, token_id, text-or-null]`` per generated token (the EOS included when it stopped there), and
``meta_info.finish_reason`` is ``{"type": "stop" | "length" | "abort", ...}``. The completion ids are read from
those tuples (as slime does), so ids and log-probs cannot disagree in length.

Log-prob semantics (SGLang sampler): ``log_softmax(logits / temperature)`` of the sampled token, before the
top-k/top-p/min-p renormalisation: TRL's learner quantity. With ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` on the
server it is the pre-temperature ``log_softmax(logits)`` instead: only equivalent at temperature 1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .base import SamplingParams
from .http_json import EngineError, HTTPOptions, ServerClient


class SGLangClient(ServerClient):
    """TRL ``rollout_func`` backed by an SGLang server (``python -m sglang.launch_server``).

    Args:
        base_url: e.g. ``"http://127.0.0.1:30000"``.
        params: sampling parameters (``None``: from ``trainer.args`` at every call).
        seed: per-entry ``sampling_seed`` base (``None``: the server's RNG).
        http: timeouts, retries, batch size, concurrency.
        extra_sampling_params: merged into every ``sampling_params`` object (e.g. ``{"ignore_eos": False}``).
        weight_sync: see :class:`~triage.trainers.sampling.base.SamplerSource`; SGLang does not see the
            trainer's weights unless this hook pushes them (e.g. ``/update_weights_from_disk``).
    """

    name = "sglang"
    engine = "SGLang"
    endpoint = "/generate"
    max_tokens_field = "max_new_tokens"

    def __init__(
        self,
        base_url: str,
        *,
        params: SamplingParams | None = None,
        seed: int | None = None,
        http: HTTPOptions | None = None,
        extra_sampling_params: dict | None = None,
        weight_sync: Callable[[Any], None] | None = None,
        validate: bool = True,
    ):
        super().__init__(
            base_url, params=params, seed=seed, http=http, weight_sync=weight_sync, validate=validate
        )
        self.extra_sampling_params = dict(extra_sampling_params or {})

    def sampling_params(self, params: SamplingParams, eos_ids: Sequence[int]) -> dict:
        """SGLang's ``sampling_params`` object for ``params``."""
        return {**self.sampling_fields(params, eos_ids), **self.extra_sampling_params}

    def _request(self, batch: list[list[int]], sampling: dict, seeds: list[int] | None) -> list[dict]:
        payload: dict[str, Any] = {"input_ids": batch, "return_logprob": True, "sampling_params": sampling}
        if seeds is not None:
            payload["sampling_params"] = [{**sampling, "sampling_seed": s} for s in seeds]
        answer = self.post(payload)
        answer = [answer] if isinstance(answer, dict) else answer
        if not isinstance(answer, list) or len(answer) != len(batch):
            got = len(answer) if isinstance(answer, list) else type(answer).__name__
            raise self.error(f"answered {got} results for {len(batch)} prompts")
        return answer

    def parse(self, item: Any, index: int) -> tuple[list, list]:
        """(completion ids, log-probs) of one ``/generate`` result; ``index`` names the entry in errors."""
        meta = item.get("meta_info") if isinstance(item, dict) else None
        if not isinstance(meta, dict):
            raise EngineError(f"SGLang result for entry {index} has no meta_info: {str(item)[:200]}")
        finish = meta.get("finish_reason")
        if isinstance(finish, dict) and finish.get("type") == "abort":
            raise EngineError(f"SGLang aborted entry {index}: {finish.get('message', finish)}")
        rows = meta.get("output_token_logprobs")
        if not isinstance(rows, list):
            raise EngineError(
                f"SGLang result for entry {index} has no meta_info.output_token_logprobs (was return_logprob "
                "honoured?)"
            )
        ids, logprobs = [], []
        for t, row in enumerate(rows):
            if not isinstance(row, (list, tuple)) or len(row) < 2:
                raise EngineError(
                    f"SGLang entry {index}, token {t}: expected [logprob, token_id, text], got {row!r}"
                )
            logprobs.append(row[0])
            ids.append(row[1])
        return ids, logprobs

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, eos_ids: Sequence[int]) -> dict:
        sampling = self.sampling_params(params, eos_ids)
        seeds = self.take_seeds(len(prompt_ids))
        size = self.http.batch_size
        requests = [
            (prompt_ids[i : i + size], None if seeds is None else seeds[i : i + size])
            for i in range(0, len(prompt_ids), size)
        ]
        answers = self.fan_out(lambda r: self._request(r[0], sampling, r[1]), requests)
        return self.rollout([self.parse(item, i) for i, item in enumerate(answers)])
