"""The inference-server clients' common layer: bounded JSON-over-HTTP (standard library only) and
:class:`ServerClient`, the base of :class:`SGLangClient` and :class:`VLLMServerClient`.

Every request has a timeout; connection failures, timeouts and HTTP 502/503/504 are retried at most
``max_retries`` times with exponential backoff, so a dead server fails a rollout within
``(max_retries + 1) * (timeout_s + backoff)`` seconds. Other HTTP errors fail at once with the server's message.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from .base import RANK_SEED_STRIDE, SamplerSource, SamplingParams

T = TypeVar("T")
R = TypeVar("R")
RETRY_STATUS = (502, 503, 504)


class EngineError(RuntimeError):
    """An inference server failed, timed out or answered something that does not follow its schema."""


@dataclass(frozen=True)
class HTTPOptions:
    """Transport knobs of a server client.

    ``timeout_s`` bounds one request (TRL's ``vllm_server_timeout`` default is 240 s); ``batch_size`` is the
    number of prompt entries per request; ``max_concurrency`` the number of requests in flight.
    """

    timeout_s: float = 240.0
    max_retries: int = 2
    backoff_s: float = 0.5
    batch_size: int = 64
    max_concurrency: int = 8

    def __post_init__(self):
        if self.timeout_s <= 0 or self.max_retries < 0 or self.backoff_s < 0:
            raise ValueError(f"timeout_s > 0, max_retries >= 0 and backoff_s >= 0 required, got {self}")
        if self.batch_size < 1 or self.max_concurrency < 1:
            raise ValueError(f"batch_size and max_concurrency must be >= 1, got {self}")


def _error_message(body: bytes) -> str:
    """The human part of an error body: ``{"error": {"message"}}``, ``{"message"}``, ``{"detail"}`` or text."""
    text = body.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        return text[:500]
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            return str(err.get("message") or err.get("detail") or err)[:500]
        return str(err)[:500]
    return text[:500]


def post_json(url: str, payload: Any, options: HTTPOptions, engine: str) -> Any:
    """POST ``payload`` as JSON to ``url`` and return the decoded JSON answer; raise :class:`EngineError`."""
    body = json.dumps(payload).encode("utf-8")
    last = ""
    for attempt in range(options.max_retries + 1):
        if attempt:
            time.sleep(options.backoff_s * 2 ** (attempt - 1))
        request = urllib.request.Request(
            url, data=body, headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=options.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as e:
            message = _error_message(e.read() or b"")
            if e.code in RETRY_STATUS:
                last = f"HTTP {e.code}: {message}"
                continue
            raise EngineError(f"{engine} server at {url} answered HTTP {e.code}: {message}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException) as e:
            reason = getattr(e, "reason", e)
            last = f"no answer within {options.timeout_s:g} s" if "timed out" in str(reason) else str(reason)
            continue
        try:
            return json.loads(raw)
        except ValueError:
            raise EngineError(f"{engine} server at {url} answered non-JSON: {raw[:200]!r}") from None
    raise EngineError(f"{engine} server at {url} failed after {options.max_retries + 1} attempt(s): {last}")


def map_concurrently(fn: Callable[[T], R], items: Sequence[T], max_concurrency: int) -> list[R]:
    """``[fn(x) for x in items]`` with up to ``max_concurrency`` calls in flight; results keep their order."""
    if len(items) <= 1 or max_concurrency == 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=min(max_concurrency, len(items))) as pool:
        return list(pool.map(fn, items))


def server_root(base_url: str) -> str:
    """``base_url`` without trailing slashes or a trailing ``/v1`` (both spellings are common in configs)."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


class ServerClient(SamplerSource):
    """What the server clients share: endpoint URL, HTTP options, seed stream, sampling fields, request fan-out.

    A subclass names its ``engine`` (in errors), ``endpoint`` (appended to :func:`server_root` of ``base_url``)
    and ``max_tokens_field``; its :meth:`~SamplerSource.generate` splits the prompt entries into requests and
    hands them to :meth:`fan_out` with a function that sends one and parses its completions.

    Seed stream: with ``seed`` set, the ``k``-th seed this process draws is
    ``seed + RANK_SEED_STRIDE × process index + k``; the running counter ``k`` is the checkpointed state.
    """

    engine = "server"
    endpoint = ""
    max_tokens_field = "max_tokens"

    def __init__(
        self,
        base_url: str,
        *,
        params: SamplingParams | None = None,
        seed: int | None = None,
        http: HTTPOptions | None = None,
        weight_sync: Callable[[Any], None] | None = None,
        validate: bool = True,
    ):
        super().__init__(params=params, weight_sync=weight_sync, validate=validate)
        self.url = server_root(base_url) + self.endpoint
        self.seed = seed
        self.http = http or HTTPOptions()
        self._counter = 0  # seeds drawn so far by this process; saved in checkpoints

    def state_dict(self) -> dict:
        """The running seed counter (with ``seed`` set, each request's seed is ``seed`` + offsets + counter)."""
        return {"counter": self._counter}

    def load_state_dict(self, state: dict) -> None:
        self._counter = int(state.get("counter", self._counter))

    def take_seeds(self, count: int) -> list[int] | None:
        """The next ``count`` seeds of this process's stream (``None`` without ``seed``: the server's RNG)."""
        if self.seed is None:
            return None
        first = self.seed + RANK_SEED_STRIDE * self.rank + self._counter
        self._counter += count
        return list(range(first, first + count))

    def sampling_fields(self, params: SamplingParams, eos_ids: Sequence[int]) -> dict:
        """Every sampling parameter, explicitly, in the names both engines share (``top_k`` off is ``-1``,
        ``min_p`` off is ``0``; ``stop_token_ids`` are the trainer's EOS ids)."""
        return {
            self.max_tokens_field: params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,
            "min_p": params.min_p or 0.0,
            "repetition_penalty": params.repetition_penalty,
            "stop_token_ids": [int(e) for e in eos_ids],
        }

    def post(self, payload: Any) -> Any:
        """:func:`post_json` to this client's endpoint."""
        return post_json(self.url, payload, self.http, self.engine)

    def error(self, what: str) -> EngineError:
        """``EngineError("<engine> server at <url> <what>")``."""
        return EngineError(f"{self.engine} server at {self.url} {what}")

    def fan_out(self, send: Callable[[T], list[R]], requests: Sequence[T]) -> list[R]:
        """``send`` each request, up to ``http.max_concurrency`` in flight; the answers concatenated in order."""
        return [
            item for answer in map_concurrently(send, requests, self.http.max_concurrency) for item in answer
        ]

    @staticmethod
    def rollout(parsed: Sequence[tuple[list, list]]) -> dict:
        """``{"completion_ids", "logprobs"}`` of one ``(completion ids, log-probs)`` pair per prompt entry."""
        return {"completion_ids": [p[0] for p in parsed], "logprobs": [p[1] for p in parsed]}
