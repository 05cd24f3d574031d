"""Token classes: the sign of the gap δ against the update direction sign(A).

| class        | condition          | update                                   | risk   |
|--------------|--------------------|------------------------------------------|--------|
| CONSISTENT   | |δ| ≤ τ            | ordinary on-policy step                  | none   |
| AMPLIFY_DOWN | δ < −τ, A < 0      | pushes down an already under-weighted y  | high   |
| CORRECT_UP   | δ < −τ, A > 0      | raises an under-weighted y (toward π_s)  | low    |
| AMPLIFY_UP   | δ > τ,  A > 0      | raises an already over-weighted y        | medium |
| CORRECT_DOWN | δ > τ,  A < 0      | lowers an over-weighted y                | low    |
| INERT        | A = 0              | no policy gradient                       | none   |
| PAD          | mask = 0           | not a completion token                   | —      |

A = 0 wins over the δ test (an inert token has no update direction, whatever its gap).

With ``TriageConfig.tau_space = "prob"`` the band is measured in probability: "|δ| ≤ τ" reads
|Δp| ≤ τ and "δ < −τ" / "δ > τ" read Δp < −τ / Δp > τ, where

    Δp_t = p_learner(y_t) − p_sampler(y_t) = p_s · (e^δ − 1),   p_s = exp(log π_sampler(y_t)).

sign(Δp) = sign(δ), so the class still follows the sign of δ; only the band test changes. Δp needs the
sampler's log-probs: pass them as ``sampler_logps``.
"""

from __future__ import annotations

import math
from enum import IntEnum

import torch

from triage.config import TriageConfig
from triage.mismatch import (
    Check,
    advantages_checks,
    as_mask,
    broadcast_advantages,
    delta_checks,
    logps_checks,
    raise_first,
)


class TokenClass(IntEnum):
    PAD = 0
    INERT = 1
    CONSISTENT = 2
    AMPLIFY_DOWN = 3
    CORRECT_UP = 4
    AMPLIFY_UP = 5
    CORRECT_DOWN = 6

    @property
    def label(self) -> str:
        """Metric-friendly name: ``amplify_down``, ``correct_up``, ..."""
        return self.name.lower()


# Classes that carry a policy gradient and a TriageConfig policy field of the same name.
POLICY_CLASSES = (
    TokenClass.CONSISTENT,
    TokenClass.AMPLIFY_DOWN,
    TokenClass.CORRECT_UP,
    TokenClass.AMPLIFY_UP,
    TokenClass.CORRECT_DOWN,
)


def resolve_tau(config: TriageConfig, tau: float | None) -> float:
    """The τ in force: the explicit argument, else the config's fixed τ (``tau_init`` when adaptive). In
    probability space (``config.tau_space == "prob"``) it must also be ≤ 1: |Δp| ≤ 1 for every token."""
    value = config.fixed_tau() if tau is None else float(tau)
    if not 0.0 <= value < math.inf:  # also catches NaN
        raise ValueError(f"tau must be a finite number ≥ 0, got {tau!r}")
    if config.tau_space == "prob" and value > 1.0:
        raise ValueError(f"tau={tau!r} with tau_space='prob': expected a probability difference in [0, 1]")
    return value


def sampler_logps_checks(
    sampler_logps: torch.Tensor | None, config: TriageConfig, valid: torch.Tensor
) -> list[Check]:
    """Checks of the ``sampler_logps`` argument: required (``ValueError`` naming it) when ``config.tau_space``
    is ``"prob"``; when given, the shape of δ and, at valid positions, what ``token_gap`` requires of the
    sampler's log-probs (finite, ≤ 0 up to 1e-4, above an engine's −inf sentinel). Raises the shape and
    missing-argument errors at once; returns the value checks for the caller's single host sync."""
    if sampler_logps is None:
        if config.tau_space == "prob":
            raise ValueError(
                "sampler_logps is required with tau_space='prob': the band |p_learner − p_sampler| ≤ τ needs the "
                "sampler's log-probs (B, T) of the sampled tokens (the tensor δ was computed from)"
            )
        return []
    if not isinstance(sampler_logps, torch.Tensor):
        raise ValueError(f"sampler_logps must be a tensor (B, T), got {type(sampler_logps).__name__}")
    if tuple(sampler_logps.shape) != tuple(valid.shape):
        raise ValueError(
            f"shape mismatch: sampler_logps has shape {tuple(sampler_logps.shape)}, delta has {tuple(valid.shape)}"
        )
    return logps_checks(sampler_logps, valid, "sampler_logps", is_sampler=True)


def checked_inputs(
    delta: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *extra: Check,
    config: TriageConfig | None = None,
    sampler_logps: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid mask, fp32 (B, T) advantages, 0 at padding) after validating δ like ``token_gap``'s output
    (finite, below ``DELTA_MAX``) and the advantages (finite) at valid positions, ``sampler_logps`` with
    :func:`sampler_logps_checks` when ``config`` is given, plus any ``extra`` checks: one host sync."""
    valid = as_mask(mask, delta.shape)
    adv = broadcast_advantages(advantages, delta.shape)
    sampler = [] if config is None else sampler_logps_checks(sampler_logps, config, valid)
    raise_first([*delta_checks(delta, valid), *advantages_checks(adv, valid), *sampler, *extra])
    return valid, torch.where(valid, adv, torch.zeros((), device=adv.device))


def band_gap(
    delta: torch.Tensor, valid: torch.Tensor, config: TriageConfig, sampler_logps: torch.Tensor | None
) -> torch.Tensor:
    """The quantity the band |·| ≤ τ is tested on, 0 at padding: δ itself in log space (the same tensor,
    untouched), Δp = p_s · (e^δ − 1) in probability space, in fp32 (``classes_of`` tests in fp32, so the
    metrics' float64 δ gives the classes the weights used)."""
    if config.tau_space == "log":
        return delta
    if sampler_logps is None:  # checked_inputs raised already; for direct callers
        raise ValueError("sampler_logps is required with tau_space='prob'")
    d = delta.detach().float()
    p_sampler = torch.exp(sampler_logps.detach().float())
    return torch.where(valid, p_sampler * torch.expm1(d), torch.zeros((), dtype=d.dtype, device=d.device))


def classes_of(delta: torch.Tensor, adv: torch.Tensor, valid: torch.Tensor, tau: float) -> torch.Tensor:
    """``classify_tokens`` on inputs already validated (``checked_inputs``) and τ resolved. ``delta`` is the
    band statistic (:func:`band_gap`): δ in log space, Δp (whose sign is δ's) in probability space."""
    d = delta.float()
    codes = torch.full(delta.shape, int(TokenClass.CONSISTENT), dtype=torch.int8, device=delta.device)
    low, high = d < -tau, d > tau
    up, down = adv > 0, adv < 0
    codes[low & down] = int(TokenClass.AMPLIFY_DOWN)
    codes[low & up] = int(TokenClass.CORRECT_UP)
    codes[high & up] = int(TokenClass.AMPLIFY_UP)
    codes[high & down] = int(TokenClass.CORRECT_DOWN)
    codes[adv == 0] = int(TokenClass.INERT)
    codes[~valid] = int(TokenClass.PAD)
    return codes


def classify_tokens(
    delta: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: TriageConfig | None = None,
    tau: float | None = None,
    *,
    sampler_logps: torch.Tensor | None = None,
) -> torch.Tensor:
    """(B, T) int8 ``TokenClass`` codes for δ (B, T), advantages (B,) or (B, T) and the valid-token mask.

    ``sampler_logps`` (B, T): the sampler's log-probs δ was computed from; required when
    ``config.tau_space == "prob"`` (the band is then |Δp| ≤ τ, module docstring), ignored in log space except
    for its validation. Raises ``ValueError`` naming row and position for a δ that ``token_gap`` cannot return
    (NaN, ±inf, or ≥ ``DELTA_MAX``) at a valid position, for NaN/inf advantages, and for ``sampler_logps``
    missing (probability space), of another shape, or not a valid sampler log-prob at a valid position."""
    config = config or TriageConfig()
    t = resolve_tau(config, tau)
    valid, adv = checked_inputs(delta, advantages, mask, config=config, sampler_logps=sampler_logps)
    return classes_of(band_gap(delta, valid, config, sampler_logps), adv, valid, t)
