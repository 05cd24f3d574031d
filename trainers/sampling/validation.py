"""Validate a rollout before it reaches the learner.

A rollout is the dict a TRL 1.16 ``rollout_func`` returns: ``prompt_ids``, ``completion_ids`` and ``logprobs``,
one entry per received prompt entry. Every sampler source in this package calls :func:`validate_rollout` on its
output, so an engine bug surfaces as an error that names the sample instead of as a silent NaN in the loss.

Rules (each violation is reported with the sample index, the head of its prompt and the token position):

* the three lists exist and have one entry per prompt entry (and as many as the prompts received, if given);
* token ids (prompt and completion) are integers in ``[0, vocab_size)``;
* ``len(logprobs[i]) == len(completion_ids[i])``: one log-prob per completion token;
* every log-prob is a finite float ``<= logprob_tol`` (a log-probability is ``<= 0``; the tolerance absorbs
  rounding). ``None`` (missing), NaN, ``+inf`` and ``-inf`` are errors. Engines write a sentinel for ``-inf``
  (vLLM's OpenAI server clamps to ``-9999.0``, others write ``finfo.min``), so values at or below
  :data:`triage.mismatch.SAMPLER_LOGPROB_MIN` (−1000 nats, the same rule as ``token_gap``) are reported as
  ``-inf`` too: a sampled token cannot have probability 0
  under the distribution it was sampled from, so the engine reported the wrong distribution (usually a
  top-k/top-p/min-p mask applied to the reported log-prob but not to the sampling, or the reverse);
* **empty completions are errors.** TRL 1.16 reads ``completion_ids[i][-1]`` to detect truncation, and a
  completion with no token carries no training signal; an engine asked for ``max_new_tokens >= 1`` always
  returns at least one token (the EOS when it stops at once), so an empty completion means the engine dropped
  output (an aborted request, a parser bug). No source drops or pads such a sample silently;
* an EOS id (``eos_ids``) may only be the last completion token: a completion that continues after EOS means the
  engine did not stop there (``ignore_eos``, a wrong stop list) and the learner would train on text the policy
  never meant to produce;
* prompts are not empty (the learner needs at least one context token to score the first completion token);
* multi-turn rollouts (TRL's ``env_mask``: 1 = model token, 0 = environment/tool token): log-probs are
  checked at model tokens only, and an EOS id may end a turn (stand right before an environment token) or sit
  inside environment text; ``env_mask`` itself must hold one 0/1 per completion token.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from triage.mismatch import SAMPLER_LOGPROB_MIN

REQUIRED_KEYS = ("prompt_ids", "completion_ids", "logprobs")
# A sampled token's log-prob at or below this is an engine's -inf sentinel (vLLM writes -9999.0); one rule with
# token_gap's (triage.mismatch.SAMPLER_LOGPROB_MIN).
VLLM_NEG_INF = SAMPLER_LOGPROB_MIN


class RolloutValidationError(ValueError):
    """A rollout broke one of the rules of :mod:`triage.trainers.sampling.validation`."""


def prompt_head(prompt: Any, width: int = 60) -> str:
    """A short human-readable head of a prompt: a string, or the last message's content of a chat prompt."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], Mapping):
        prompt = prompt[-1].get("content", prompt[-1])
    text = prompt if isinstance(prompt, str) else repr(prompt)
    text = text.replace("\n", "\\n")
    return text if len(text) <= width else text[: width - 3] + "..."


def _where(i: int, prompts: Sequence[Any] | None) -> str:
    if prompts is not None and i < len(prompts):
        return f"sample {i} (prompt {prompt_head(prompts[i])!r})"
    return f"sample {i}"


def _first_bad_id(ids: Sequence[Any], vocab_size: int | None) -> tuple[int, Any] | None:
    """Position and value of the first id that is not an integer in [0, vocab_size), or None."""
    arr = np.asarray(ids) if len(ids) else np.zeros(0, dtype=np.int64)
    if arr.ndim == 1 and arr.dtype.kind in "iu":
        bad = arr < 0
        if vocab_size is not None:
            bad |= arr >= vocab_size
        pos = np.flatnonzero(bad)
        return (int(pos[0]), int(arr[pos[0]])) if pos.size else None
    for t, v in enumerate(ids):  # slow path: something is not an integer
        is_int = isinstance(v, (int, np.integer)) and not isinstance(v, bool)
        if not is_int or v < 0 or (vocab_size is not None and v >= vocab_size):
            return t, v
    return None


def _describe_logprob(v: Any) -> str:
    if v is None:
        return "None (missing): the engine returned no log-prob for a sampled token"
    if not isinstance(v, (int, float)):
        return f"{v!r} of type {type(v).__name__}: a log-prob must be a number"
    if isinstance(v, float) and math.isnan(v):
        return "NaN: the engine returned NaN for a sampled token"
    if v == math.inf:
        return "+inf: the engine returned +inf for a sampled token"
    if v == -math.inf or v <= VLLM_NEG_INF:
        return (
            f"{v}: the engine returned -inf for a sampled token (probability 0 under the reported distribution; "
            f"values <= {SAMPLER_LOGPROB_MIN:g} are engine sentinels, vLLM clamps -inf to -9999.0)"
        )
    return f"{v}: a log-probability must be <= 0"


def _first_bad_logprob(lps: Sequence[Any], tol: float) -> tuple[int, Any] | None:
    """Position and value of the first log-prob that is missing, non-finite, clamped -inf or > tol."""
    arr = np.asarray(lps) if len(lps) else np.zeros(0)
    if arr.ndim == 1 and arr.dtype.kind in "fiu":
        bad = ~np.isfinite(arr) | (arr > tol) | (arr <= VLLM_NEG_INF)
        pos = np.flatnonzero(bad)
        if not pos.size:
            return None
        t = int(pos[0])
        v = lps[t]
        return t, (None if v is None else float(v))
    for t, v in enumerate(lps):  # slow path: something is not a number
        if v is None or not isinstance(v, (int, float, np.floating, np.integer)) or isinstance(v, bool):
            return t, v
        v = float(v)
        if not math.isfinite(v) or v > tol or v <= VLLM_NEG_INF:
            return t, v
    return None


def validate_rollout(
    output: Mapping[str, Any],
    vocab_size: int | None,
    eos_ids: Iterable[int] = (),
    prompts: Sequence[Any] | None = None,
    logprob_tol: float = 1e-4,
    max_reported: int = 5,
    env_mask: Sequence[Sequence[int]] | None = None,
) -> None:
    """Check a rollout dict against the rules in this module's docstring; raise on the first problems.

    Args:
        output: the rollout dict (``prompt_ids``, ``completion_ids``, ``logprobs``; other keys are ignored).
        vocab_size: ids must be ``< vocab_size`` (the learner's embedding rows); ``None`` skips the upper bound.
        eos_ids: ids that end a completion; they may only appear as its last token.
        prompts: the raw prompts the source received (one per entry); used for the count check and messages.
        logprob_tol: largest accepted log-prob (rounding above 0).
        max_reported: how many problems the error lists (the total count is always given).
        env_mask: TRL's multi-turn ``env_mask`` from a ``rollout_func`` (per completion token: 1 = sampled by
            the model, 0 = inserted by the environment/tool). Log-probs are checked only at model tokens, and
            an EOS id may also end a turn, i.e. stand before an environment token (or inside one).

    Raises:
        RolloutValidationError: naming the sample index, the prompt head and the token position.
    """
    if not isinstance(output, Mapping):
        raise RolloutValidationError(f"a rollout must be a dict, got {type(output).__name__}")
    missing = [k for k in REQUIRED_KEYS if k not in output]
    if missing:
        raise RolloutValidationError(f"the rollout has no {missing} (required: {list(REQUIRED_KEYS)})")
    for k in REQUIRED_KEYS:
        if not isinstance(output[k], (list, tuple)):
            raise RolloutValidationError(
                f"rollout[{k!r}] must be a list of lists, got {type(output[k]).__name__}"
            )
    prompt_ids, completion_ids, logprobs = (output[k] for k in REQUIRED_KEYS)
    counts = {k: len(output[k]) for k in REQUIRED_KEYS}
    if len(set(counts.values())) != 1:
        raise RolloutValidationError(f"the rollout's lists differ in length: {counts}")
    if prompts is not None and len(prompts) != len(completion_ids):
        raise RolloutValidationError(
            f"the source returned {len(completion_ids)} completions for {len(prompts)} prompt entries; each entry "
            "(a prompt already repeated num_generations times) needs exactly one completion"
        )
    eos = set(int(e) for e in eos_ids)
    problems: list[str] = []

    for i in range(len(completion_ids)):
        where = _where(i, prompts)
        p, c, lp = prompt_ids[i], completion_ids[i], logprobs[i]
        if (
            not isinstance(p, (list, tuple))
            or not isinstance(c, (list, tuple))
            or not isinstance(lp, (list, tuple))
        ):
            problems.append(
                f"{where}: prompt_ids, completion_ids and logprobs must each be a list, got "
                f"{type(p).__name__}, {type(c).__name__}, {type(lp).__name__}"
            )
            continue
        if len(p) == 0:
            problems.append(f"{where}: the prompt has no token")
        elif (bad := _first_bad_id(p, vocab_size)) is not None:
            problems.append(
                f"{where}: prompt position {bad[0]}: token id {bad[1]!r} is not in [0, {vocab_size})"
            )
        if len(c) == 0:
            problems.append(
                f"{where}: the completion is empty (zero tokens); the engine dropped its output "
                "(aborted request?). Empty completions are rejected, never silently dropped"
            )
            continue
        if (bad := _first_bad_id(c, vocab_size)) is not None:
            problems.append(
                f"{where}: completion position {bad[0]}: token id {bad[1]!r} is not in [0, {vocab_size})"
            )
        model = None  # positions sampled by the model (all, without env_mask)
        if env_mask is not None:
            m = env_mask[i] if i < len(env_mask) else None
            if not isinstance(m, (list, tuple)) or len(m) != len(c) or any(v not in (0, 1) for v in m):
                problems.append(
                    f"{where}: env_mask must hold one 0/1 per completion token ({len(c)}), got "
                    f"{m if not isinstance(m, (list, tuple)) else f'{len(m)} values'}"
                )
                continue
            model = np.asarray(m, dtype=bool)
        if len(lp) != len(c):
            problems.append(
                f"{where}: {len(c)} completion tokens but {len(lp)} log-probs (one per completion token needed)"
            )
        elif model is not None:  # environment tokens were not sampled: their log-probs are placeholders
            pos = np.flatnonzero(model)
            if (bad := _first_bad_logprob([lp[t] for t in pos], logprob_tol)) is not None:
                t = int(pos[bad[0]])
                problems.append(f"{where}: completion position {t}: log-prob {_describe_logprob(bad[1])}")
        elif (bad := _first_bad_logprob(lp, logprob_tol)) is not None:
            problems.append(f"{where}: completion position {bad[0]}: log-prob {_describe_logprob(bad[1])}")
        if eos and len(c) > 1 and _first_bad_id(c, None) is None:
            is_eos = np.isin(np.asarray(c[:-1]), list(eos))
            if model is not None:  # an EOS may end a turn (next token from the environment) or sit in one
                is_eos &= model[:-1] & model[1:]
            early = np.flatnonzero(is_eos)
            if early.size:
                t = int(early[0])
                problems.append(
                    f"{where}: completion position {t}: EOS id {int(c[t])} before the last token "
                    f"(length {len(c)}); the engine did not stop at EOS (ignore_eos or a wrong stop list?)"
                )
        if len(problems) > max_reported:
            break

    if problems:
        shown = problems[:max_reported]
        more = "" if len(problems) <= max_reported else f" (and more; showing the first {max_reported})"
        raise RolloutValidationError(
            f"invalid rollout: {len(shown)} problem(s){more}:\n" + "\n".join(f"  - {m}" for m in shown)
        )
