"""The learner–sampler gap δ and input validation shared by the core.

δ_t = log π_learner(y_t) − log π_sampler(y_t), computed in fp32, 0 at padding. The learner log-probs must
be taken at the weights the sampler used (the trainer's recomputed "old" log-probs, no grad), so δ is
engine mismatch only, not the drift of the current update.

Every function here validates what it is given and raises ``ValueError`` naming the offending tensor, row
and position: a NaN in a log-prob silently turns into a NaN loss several steps later, which is much harder
to trace back to the engine that produced it.
"""

from __future__ import annotations

import torch

# A sampler log-prob above this is not a log-probability (allows fp rounding of log 1 = 0).
LOGPROB_MAX = 1e-4


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


def check_logps(logps: torch.Tensor, mask: torch.Tensor, name: str, *, is_sampler: bool = False) -> None:
    """Raise if ``logps`` has NaN/±inf, or (sampler) a value above 0, at a valid (mask=1) position."""
    values = logps.float()
    bad = ~torch.isfinite(values) & mask
    if bad.any():
        row, pos = _first_bad(bad)
        value = values[row, pos].item()
        hint = ""
        if value == float("-inf") and is_sampler:
            hint = " (the engine returned -inf for a sampled token: check its top-k/top-p/logprobs mode)"
        elif value != value:
            hint = " (NaN: a missing log-prob, or an overflow upstream)"
        raise ValueError(
            f"{name} is {value} at row {row}, position {pos} (a valid completion token);"
            f" {int(bad.sum())} such value(s) in total{hint}"
        )
    if is_sampler:
        over = (values > LOGPROB_MAX) & mask
        if over.any():
            row, pos = _first_bad(over)
            raise ValueError(
                f"{name} is {values[row, pos].item():.6g} > 0 at row {row}, position {pos}: not a log-probability"
                " (did the engine return a probability, a logit, or a sign-flipped value?)"
            )


def expand_advantages(advantages: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Advantages (B,) or (B, T) → fp32 (B, T); raises on NaN/inf or a shape that does not fit."""
    adv = advantages.float()
    if adv.dim() == 1:
        if adv.shape[0] != shape[0]:
            raise ValueError(f"advantages has shape {tuple(adv.shape)} but the batch has {shape[0]} rows")
        adv = adv[:, None].expand(shape)
    elif tuple(adv.shape) != tuple(shape):
        raise ValueError(f"advantages has shape {tuple(adv.shape)}; expected ({shape[0]},) or {tuple(shape)}")
    bad = ~torch.isfinite(adv)
    if bad.any():
        row, pos = _first_bad(bad)
        raise ValueError(
            f"advantages is {adv[row, pos].item()} at row {row} (position {pos}): rewards or their std?"
        )
    return adv


def token_gap(learner_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """δ = learner_logps − sampler_logps in fp32, (B, T), exactly 0 where ``mask`` is 0.

    Raises ``ValueError`` on a shape mismatch (naming both shapes), on NaN/±inf in either tensor at a valid
    position (naming row and position), and on a sampler log-prob above 0 (beyond 1e-4).
    Padding positions may hold anything (NaN included): they are ignored.
    """
    check_same_shape(learner_logps, "learner_logps", sampler_logps, "sampler_logps")
    valid = as_mask(mask, learner_logps.shape)
    check_logps(learner_logps, valid, "learner_logps")
    check_logps(sampler_logps, valid, "sampler_logps", is_sampler=True)
    delta = learner_logps.detach().float() - sampler_logps.detach().float()
    return torch.where(valid, delta, torch.zeros((), dtype=delta.dtype, device=delta.device))
