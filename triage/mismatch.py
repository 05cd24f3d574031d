"""The learner–sampler gap δ and input validation shared by the core.

δ_t = log π_learner(y_t) − log π_sampler(y_t), computed in fp32, 0 at padding. The learner log-probs must
be taken at the weights the sampler used (the trainer's recomputed "old" log-probs, no grad), so δ is
engine mismatch only, not the drift of the current update.

Every function here validates what it is given and raises ``ValueError`` naming the offending tensor, row
and position: a NaN in a log-prob silently turns into a NaN loss several steps later, which is much harder
to trace back to the engine that produced it. The checks are vectorised and a public function fetches
all of its checks' verdicts in one host sync (``raise_first``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

# A sampler log-prob above this is not a log-probability (allows fp rounding of log 1 = 0).
LOGPROB_MAX = 1e-4
# A sampler log-prob at or below this is an engine's sentinel for −inf (vLLM's OpenAI server writes −9999,
# other engines finfo.min), not a measurement: the token was drawn from the distribution the engine reports,
# and a draw lands on a token of log-prob ≤ −1000 with probability ≤ V · e^−1000 (≈ 10^−427 for V = 10^7
# tokens), while log(1/V) ≥ −16 for any sane vocabulary. Such a value would make δ ≈ 10^3 … 10^38 and hand
# the token the IS cap.
SAMPLER_LOGPROB_MIN = -1e3
# The largest δ that ``token_gap`` can return: learner log-prob ≤ 0 minus a sampler log-prob above
# SAMPLER_LOGPROB_MIN. A larger δ handed to the core directly means such a sentinel got through.
DELTA_MAX = -SAMPLER_LOGPROB_MIN

# One input check: the bool tensor of offending positions and a function that words the error from it.
Check = tuple[torch.Tensor, Callable[[torch.Tensor], str]]


def raise_first(checks: Iterable[Check]) -> None:
    """Raise ``ValueError`` for the first check with an offending position, in order.

    All checks cost one host sync together (one ``any`` per check, fetched at once); the message is built
    only on failure. This keeps validation at one sync per call of the public functions.
    """
    checks = list(checks)
    if not checks:
        return
    flags = torch.stack([bad.any() for bad, _ in checks]).tolist()
    for (bad, describe), flag in zip(checks, flags):
        if flag:
            raise ValueError(describe(bad))


def as_mask(mask: torch.Tensor, shape: torch.Size, name: str = "mask") -> torch.Tensor:
    """Return ``mask`` as a bool tensor, checking it matches ``shape``."""
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(mask.shape)} but the log-probs have shape {tuple(shape)}")
    return mask.bool() if mask.dtype != torch.bool else mask


def check_same_shape(a: torch.Tensor, a_name: str, b: torch.Tensor, b_name: str) -> None:
    if tuple(a.shape) != tuple(b.shape):
        raise ValueError(
            f"shape mismatch: {a_name} has shape {tuple(a.shape)}, {b_name} has {tuple(b.shape)}"
        )
    if a.dim() != 2:
        raise ValueError(f"{a_name} must be (batch, tokens), got shape {tuple(a.shape)}")


def _first_bad(bad: torch.Tensor) -> tuple[int, int]:
    row, pos = bad.nonzero()[0].tolist()
    return row, pos


def _at(values: torch.Tensor, bad: torch.Tensor) -> tuple[int, int, float]:
    row, pos = _first_bad(bad)
    return row, pos, values[row, pos].item()


def logps_checks(
    logps: torch.Tensor, mask: torch.Tensor, name: str, *, is_sampler: bool = False
) -> list[Check]:
    """Checks of ``logps`` at valid (mask=1) positions: NaN/±inf; for the sampler also a value above
    ``LOGPROB_MAX`` (not a log-prob) or at/below ``SAMPLER_LOGPROB_MIN`` (an engine's −inf sentinel)."""
    values = logps.detach().float()

    def non_finite(bad: torch.Tensor) -> str:
        row, pos, value = _at(values, bad)
        hint = ""
        if value == float("-inf") and is_sampler:
            hint = " (the engine returned -inf for a sampled token: check its top-k/top-p/logprobs mode)"
        elif value != value:
            hint = " (NaN: a missing log-prob, or an overflow upstream)"
        return (
            f"{name} is {value} at row {row}, position {pos} (a valid completion token);"
            f" {int(bad.sum())} such value(s) in total{hint}"
        )

    checks: list[Check] = [(~torch.isfinite(values) & mask, non_finite)]
    if is_sampler:

        def positive(bad: torch.Tensor) -> str:
            row, pos, value = _at(values, bad)
            return (
                f"{name} is {value:.6g} > 0 at row {row}, position {pos}: not a log-probability"
                " (did the engine return a probability, a logit, or a sign-flipped value?)"
            )

        def sentinel(bad: torch.Tensor) -> str:
            row, pos, value = _at(values, bad)
            return (
                f"{name} is {value:.6g} at row {row}, position {pos}: an engine's sentinel for -inf, not a"
                f" log-prob (values <= {SAMPLER_LOGPROB_MIN:g} cannot be sampled; vLLM writes -9999, other"
                f" engines finfo.min); {int(bad.sum())} such value(s) in total. Check the engine's"
                " top-k/top-p/logprobs mode"
            )

        checks.append(((values > LOGPROB_MAX) & mask, positive))
        checks.append(((values <= SAMPLER_LOGPROB_MIN) & mask, sentinel))
    return checks


def delta_checks(delta: torch.Tensor, mask: torch.Tensor, name: str = "delta") -> list[Check]:
    """δ handed to the core directly must look like ``token_gap``'s output at valid positions: finite and
    below ``DELTA_MAX`` (a larger δ means a sampler log-prob at an engine's −inf sentinel)."""
    values = delta.detach().float()

    def describe(bad: torch.Tensor) -> str:
        row, pos, value = _at(values, bad)
        why = (
            f"δ ≥ {DELTA_MAX:g} means a sampler log-prob ≤ {SAMPLER_LOGPROB_MIN:g}, an engine's -inf sentinel"
            if value == value and value != float("-inf")
            else "a NaN/inf log-prob upstream"
        )
        return (
            f"{name} is {value} at row {row}, position {pos} (a valid completion token): {why};"
            f" {int(bad.sum())} such value(s) in total (token_gap validates the log-probs it is built from)"
        )

    return [(~(torch.isfinite(values) & (values < DELTA_MAX)) & mask, describe)]


def weights_checks(weights: torch.Tensor, mask: torch.Tensor, name: str = "weights") -> list[Check]:
    """Loss weights must be finite and ≥ 0 at valid positions (a negative weight flips the update)."""
    values = weights.detach().float()

    def describe(bad: torch.Tensor) -> str:
        row, pos, value = _at(values, bad)
        return (
            f"{name} is {value} at row {row}, position {pos} (a valid completion token): a loss weight must be"
            f" finite and >= 0; {int(bad.sum())} such value(s) in total"
        )

    return [(~(torch.isfinite(values) & (values >= 0)) & mask, describe)]


def broadcast_advantages(advantages: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Advantages (B,) or (B, T) → fp32 (B, T), raising on a shape that does not fit (no value check)."""
    adv = advantages.detach().float()
    if adv.dim() == 1:
        if adv.shape[0] != shape[0]:
            raise ValueError(f"advantages has shape {tuple(adv.shape)} but the batch has {shape[0]} rows")
        return adv[:, None].expand(shape)
    if tuple(adv.shape) != tuple(shape):
        raise ValueError(f"advantages has shape {tuple(adv.shape)}; expected ({shape[0]},) or {tuple(shape)}")
    return adv


def advantages_checks(adv: torch.Tensor, mask: torch.Tensor) -> list[Check]:
    """Broadcast advantages (B, T) must be finite at valid positions (padding may hold anything)."""

    def describe(bad: torch.Tensor) -> str:
        row, pos, value = _at(adv, bad)
        return f"advantages is {value} at row {row} (position {pos}): rewards or their std?"

    return [(~torch.isfinite(adv) & mask, describe)]


def token_gap(learner_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """δ = learner_logps − sampler_logps in fp32, (B, T), exactly 0 where ``mask`` is 0.

    Raises ``ValueError`` on a shape mismatch (naming both shapes), and, naming row and position, on NaN/±inf
    in either tensor at a valid position, on a sampler log-prob above 0 (beyond ``LOGPROB_MAX`` = 1e-4) and on
    a sampler log-prob ≤ ``SAMPLER_LOGPROB_MIN`` = −1000 (an engine's −inf sentinel). One host sync.
    Padding positions may hold anything (NaN included): they are ignored.
    """
    check_same_shape(learner_logps, "learner_logps", sampler_logps, "sampler_logps")
    valid = as_mask(mask, learner_logps.shape)
    raise_first(
        logps_checks(learner_logps, valid, "learner_logps")
        + logps_checks(sampler_logps, valid, "sampler_logps", is_sampler=True)
    )
    delta = learner_logps.detach().float() - sampler_logps.detach().float()
    return torch.where(valid, delta, torch.zeros((), dtype=delta.dtype, device=delta.device))
