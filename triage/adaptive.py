"""Adaptive tolerance τ (``TriageConfig.tau = "auto"``).

τ_k = max(τ_floor, m · s_k),  s_k = β · s_{k−1} + (1 − β) · median_t |δ_t|   (s_0 = τ_init / m)

The median of |δ| over the valid tokens of a step is a robust scale of the engine gap: the tails TRIAGE
acts on do not move it, so τ follows the bulk of the mismatch (which grows slowly with training, and jumps
when precision changes) while the tails stay tails. The tracker is plain state: save it with
``state_dict()`` in a checkpoint and restore it with ``load_state_dict()`` so a resumed run continues with
the same τ; both ``load_state_dict`` and ``update_from_median`` refuse NaN, ±inf and negative values
(a NaN scale would pin τ at the floor for the rest of the run, an infinite one would call every token
consistent). In a multi-process run, update it with the same gathered δ on every rank (or call
``update_from_median`` with an all-reduced median) so every rank uses the same τ.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from triage.config import TriageConfig
from triage.mismatch import as_mask, delta_checks, raise_first


class AdaptiveTau:
    """Tracks τ from the per-step median |δ| (see module docstring)."""

    def __init__(self, config: TriageConfig):
        self.config = config
        self.scale = config.tau_init / config.tau_multiplier
        self.steps = 0

    @property
    def value(self) -> float:
        """τ in force now. For a fixed-τ config this is simply ``config.tau``."""
        if not self.config.adaptive:
            return float(self.config.tau)
        return max(self.config.tau_floor, self.config.tau_multiplier * self.scale)

    def update_from_median(self, median_abs_delta: float) -> float:
        """Fold one step's median |δ| into the running scale; returns the new τ."""
        median_abs_delta = float(median_abs_delta)
        if not 0.0 <= median_abs_delta < math.inf:  # also catches NaN
            raise ValueError(f"median |δ| must be a finite number ≥ 0, got {median_abs_delta!r}")
        beta = self.config.tau_ema
        self.scale = beta * self.scale + (1.0 - beta) * median_abs_delta
        self.steps += 1
        return self.value

    def update(self, delta: torch.Tensor, mask: torch.Tensor) -> float:
        """Update from a step's δ (B, T) and mask; a step with no valid token leaves τ unchanged. δ is
        validated as in ``classify_tokens``."""
        valid = as_mask(mask, delta.shape)
        raise_first(delta_checks(delta, valid))
        values = delta.detach().float()[valid].abs()
        if values.numel() == 0:
            return self.value
        return self.update_from_median(values.median().item())

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s output; raises ``ValueError`` naming the key for a missing key, a scale
        that is not a finite number ≥ 0, or a step count that is not an integer ≥ 0."""
        missing = [key for key in ("scale", "steps") if key not in state]
        if missing:
            raise ValueError(f"AdaptiveTau state has no {missing} (keys: {sorted(state)})")
        scale, steps = state["scale"], state["steps"]
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0.0 <= scale < math.inf:
            raise ValueError(f"AdaptiveTau state 'scale'={scale!r}: expected a finite number ≥ 0")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"AdaptiveTau state 'steps'={steps!r}: expected an integer ≥ 0")
        self.scale = float(scale)
        self.steps = steps
