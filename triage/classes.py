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
"""

from __future__ import annotations

import math
from enum import IntEnum

import torch

from triage.config import TriageConfig
from triage.mismatch import Check, advantages_checks, as_mask, broadcast_advantages, delta_checks, raise_first


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
    """The τ in force: the explicit argument, else the config's fixed τ (``tau_init`` when adaptive)."""
    value = config.fixed_tau() if tau is None else float(tau)
    if not 0.0 <= value < math.inf:  # also catches NaN
        raise ValueError(f"tau must be a finite number ≥ 0, got {tau!r}")
    return value


def checked_inputs(
    delta: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *extra: Check
) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid mask, fp32 (B, T) advantages, 0 at padding) after validating δ like ``token_gap``'s output
    (finite, below ``DELTA_MAX``) and the advantages (finite) at valid positions, plus any ``extra`` checks:
    one host sync."""
    valid = as_mask(mask, delta.shape)
    adv = broadcast_advantages(advantages, delta.shape)
    raise_first([*delta_checks(delta, valid), *advantages_checks(adv, valid), *extra])
    return valid, torch.where(valid, adv, torch.zeros((), device=adv.device))


def classes_of(delta: torch.Tensor, adv: torch.Tensor, valid: torch.Tensor, tau: float) -> torch.Tensor:
    """``classify_tokens`` on inputs already validated (``checked_inputs``) and τ resolved."""
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
) -> torch.Tensor:
    """(B, T) int8 ``TokenClass`` codes for δ (B, T), advantages (B,) or (B, T) and the valid-token mask.

    Raises ``ValueError`` naming row and position for a δ that ``token_gap`` cannot return (NaN, ±inf, or
    ≥ ``DELTA_MAX``) at a valid position, and for NaN/inf advantages."""
    config = config or TriageConfig()
    t = resolve_tau(config, tau)
    valid, adv = checked_inputs(delta, advantages, mask)
    return classes_of(delta, adv, valid, t)
