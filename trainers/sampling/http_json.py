"""Bounded JSON-over-HTTP for the server clients (standard library only).

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
