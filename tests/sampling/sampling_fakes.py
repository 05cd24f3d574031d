"""Test helpers: a fake trainer, and a fake inference server on 127.0.0.1 answering SGLang's ``/generate`` and vLLM's ``/v1/completions``.

Responses follow each engine's documented schema with deterministic fake completions; ``mode`` switches on one
misbehaviour at a time for the error tests. Every request body is recorded in ``requests``.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

EOS = 2  # <|im_end|> in triage.trainers.tiny's tokenizer
VOCAB = 400  # below the tiny tokenizer's 450 ids


def fake_completion(prompt: list[int], sample: int, max_new: int) -> tuple[list[int], list[float], str]:
    """Deterministic completion of ``prompt`` for sample number ``sample``: (ids, log-probs, finish type).

    Even ``sum(prompt) + sample``: stops with EOS after 1..max_new-1 tokens; odd: runs to ``max_new`` tokens.
    """
    s = sum(prompt) + 7 * sample
    stops = s % 2 == 0
    n = 1 + s % max(max_new - 1, 1) if stops else max_new
    body = [3 + (s * 31 + 17 * t) % (VOCAB - 3) for t in range(n - 1 if stops else n)]
    ids = body + [EOS] if stops else body
    logprobs = [-0.25 - 0.01 * ((s + t) % 50) for t in range(len(ids))]
    return ids, logprobs, "stop" if stops else "length"


class FakeEngineServer:
    """Threaded HTTP server; ``mode`` is one of ``ok``, ``http_error``, ``slow``, ``unavailable_once``,
    ``abort``, ``wrong_count``, ``null_logprob``, ``nan_logprob``, ``neg_inf``, ``bad_token``, ``empty``,
    ``early_eos``, ``out_of_vocab``, ``token_ids_disagree``, ``not_json``."""

    def __init__(self):
        self.mode = "ok"
        self.requests: list[tuple[str, dict]] = []
        self.release = threading.Event()  # wakes a "slow" handler at teardown
        self._failed_once = False
        self.occurrences: dict[tuple, int] = {}
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_POST(self):
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                with outer._lock:
                    outer.requests.append((self.path, body))
                status, answer = outer.answer(self.path, body)
                raw = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(raw)))
                    self.end_headers()
                    self.wfile.write(raw)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout test)
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)

    def start(self):
        self._thread.start()

    def stop(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    # -- behaviour -------------------------------------------------------------------------------------------
    def answer(self, path: str, body: dict):
        mode = self.mode
        if mode == "slow":
            self.release.wait(timeout=5.0)
        if mode == "unavailable_once":
            with self._lock:
                first = not self._failed_once
                self._failed_once = True
            if first:
                return 503, {"error": {"message": "server warming up"}}
        if mode == "not_json":
            return 200, b"<html>proxy error</html>"
        if path == "/generate":
            return self.sglang(body)
        if path == "/v1/completions":
            return self.vllm(body)
        return 404, {"detail": "Not Found"}

    def _corrupt(self, ids: list[int], logprobs: list, first: bool):
        if not first:
            return ids, logprobs
        mode = self.mode
        if mode == "null_logprob":
            logprobs[0] = None
        elif mode == "nan_logprob":
            logprobs[-1] = float("nan")
        elif mode == "empty":
            ids, logprobs = [], []
        elif mode == "early_eos":
            ids, logprobs = [EOS, *ids[1:], 5], [*logprobs, -0.5]
        elif mode == "out_of_vocab":
            ids = [VOCAB + 100, *ids[1:]]
        return ids, logprobs

    def sglang(self, body: dict):
        if self.mode == "http_error":
            return 400, {"error": {"message": "max_new_tokens must be positive"}}
        prompts = body["input_ids"]
        params = body["sampling_params"]
        params = params if isinstance(params, list) else [params] * len(prompts)
        results = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            with self._lock:  # unseeded: the k-th request of a prompt (server-wide) gets sample k
                j = self.occurrences.get(tuple(prompt), 0)
                self.occurrences[tuple(prompt)] = j + 1
            sample = sp.get("sampling_seed", j)
            ids, lps, finish = fake_completion(prompt, sample, sp["max_new_tokens"])
            ids, lps = self._corrupt(ids, lps, i == 0)
            finish_reason = (
                {"type": "stop", "matched": EOS}
                if finish == "stop"
                else {"type": "length", "length": len(ids)}
            )
            if self.mode == "abort" and i == 0:
                finish_reason = {"type": "abort", "message": "request aborted: KV cache full"}
            results.append(
                {
                    "text": "fake",
                    "output_ids": ids,
                    "meta_info": {
                        "id": f"req-{i}",
                        "finish_reason": finish_reason,
                        "prompt_tokens": len(prompt),
                        "completion_tokens": len(ids),
                        "cached_tokens": 0,
                        "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)],
                    },
                }
            )
        if self.mode == "wrong_count":
            results = results[:-1]
        return 200, results

    def vllm(self, body: dict):
        if self.mode == "http_error":
            return 400, {
                "object": "error",
                "message": "model 'nope' does not exist",
                "type": "NotFoundError",
                "code": 404,
            }
        choices = []
        for prompt in body["prompt"]:
            for s in range(body.get("n", 1)):
                sample = s + body.get("seed", 0)
                ids, lps, finish = fake_completion(prompt, sample, body["max_tokens"])
                ids, lps = self._corrupt(ids, lps, not choices)
                if self.mode == "neg_inf" and not choices:
                    lps[0] = -9999.0  # vLLM's clamp of -inf
                tokens = [f"token_id:{t}" for t in ids]
                if self.mode == "bad_token" and not choices:
                    tokens[0] = "hello"
                choice = {
                    "index": len(choices),
                    "text": "fake",
                    "logprobs": {
                        "text_offset": list(range(len(ids))),
                        "token_logprobs": lps,
                        "tokens": tokens,
                        "top_logprobs": [{tok: lp} for tok, lp in zip(tokens, lps)],
                    },
                    "finish_reason": finish,
                    "stop_reason": None,
                }
                if self.mode == "token_ids_disagree":
                    choice["token_ids"] = [t + 1 for t in ids]
                choices.append(choice)
        if self.mode == "wrong_count":
            choices = choices[:-1]
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        return 200, {
            "id": "cmpl-fake",
            "object": "text_completion",
            "created": 0,
            "model": body["model"],
            "choices": choices,
            "usage": usage,
        }


class NoAccelerator:
    """What ``trl.models.unwrap_model_for_generation`` reads from an accelerate ``Accelerator`` (single CPU)."""

    class state:
        deepspeed_plugin = None
        fsdp_plugin = None

    @staticmethod
    def unwrap_model(model, keep_fp32_wrapper=True):
        return model


def make_fake_trainer(tokenizer, model, max_completion_length=6, temperature=1.0, **args):
    """The attributes of a TRL ``GRPOTrainer`` that the sources read, without TRL."""
    values = dict(
        max_completion_length=max_completion_length,
        temperature=temperature,
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        chat_template_kwargs=None,
    )
    values.update(args)
    return SimpleNamespace(
        processing_class=tokenizer,
        args=SimpleNamespace(**values),
        eos_token_ids=[tokenizer.eos_token_id],
        state=SimpleNamespace(global_step=0),
        model=model,
        accelerator=None,
    )
