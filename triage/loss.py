"""The clipped policy-gradient surrogate times the TRIAGE weights, with TRL 1.16's normalisations.

Per token (token-level importance sampling; sequence level uses the masked mean of log r per response):

    r_t   = exp(log π_θ(y_t) − log π_old(y_t))
    ℓ_t   = −min(r_t · A_t, clip(r_t, 1 − ε_low, 1 + ε_high) · A_t)       (grpo, bnpo, dr_grpo, dapo)
    ℓ_t   = −min(r_t, ε_high)^⊥ · A_t · log π_θ(y_t)                     (cispo; ⊥ = stop-gradient)
    ℓ_t  ←  w_t · ℓ_t                                                    (w from ``token_weights``)

and the loss aggregates the masked ℓ as TRL does (m the completion mask, B the rows):

* ``grpo``    mean over responses of Σ_t m·ℓ / max(Σ_t m, 1)
* ``bnpo``    Σ m·ℓ / max(Σ m, 1)
* ``dr_grpo`` Σ m·ℓ / (B · max_completion_length)
* ``dapo`` / ``cispo``  Σ m·ℓ / max(num_items_in_batch, 1)   (TRL passes the global token count,
  rescaled to one accumulation window; default: Σ m of this batch)

Normaliser rule: a token that TRIAGE down-weights or masks (w < 1 or w = 0) still counts in the
denominators above — the correction lowers the token's contribution, it does not renormalise the others
up. Gradient-accumulation scaling (TRL divides grpo/bnpo/dr_grpo by the accumulation steps) is the
trainer's job. With ``weights`` None (or all ones) the value equals TRL's bit for bit on the same inputs.
"""

from __future__ import annotations

import numbers

import torch

from triage.mismatch import (
    advantages_checks,
    as_mask,
    broadcast_advantages,
    check_same_shape,
    logps_checks,
    raise_first,
    weights_checks,
)

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")


def per_token_surrogate(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    delta: float | None = None,
    importance_sampling_level: str = "token",
) -> torch.Tensor:
    """ℓ_t before weighting and masking, (B, T) — the exact op sequence of TRL 1.16's ``_compute_loss``."""
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(
            f"importance_sampling_level={importance_sampling_level!r}: expected 'token' or 'sequence'"
        )
    advantages = advantages if advantages.dim() == 2 else advantages.unsqueeze(1)
    log_ratio = logps - old_logps
    if importance_sampling_level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        log_importance_weights = log_importance_weights.unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    if loss_type == "cispo":
        clamped_ratios = torch.clamp(coef_1, max=epsilon_high).detach()
        return -clamped_ratios * advantages * logps
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)
    return -torch.min(coef_1 * advantages, coef_2 * advantages)


def aggregate_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    num_items_in_batch: torch.Tensor | float | None = None,
    max_completion_length: int | None = None,
) -> torch.Tensor:
    """Reduce masked ℓ to a scalar with TRL's normalisation for ``loss_type`` (module docstring). An empty
    batch (no row) gives 0, like a batch without a valid token."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}: TRIAGE supports {LOSS_TYPES}")
    if max_completion_length is not None and (
        isinstance(max_completion_length, bool)
        or not isinstance(max_completion_length, numbers.Integral)
        or max_completion_length < 1
    ):
        raise ValueError(
            f"max_completion_length={max_completion_length!r}: expected an integer >= 1 (the dr_grpo normaliser)"
        )
    if per_token_loss.size(0) == 0:  # the per-row means below would be 0/0
        return (per_token_loss * mask).sum()
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length")
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
    if loss_type in ("dapo", "cispo"):
        if num_items_in_batch is None:
            num_items_in_batch = mask.sum()
        normalizer = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=per_token_loss.device)
        return (per_token_loss * mask).sum() / normalizer.clamp(min=1.0)
    raise ValueError(f"loss_type={loss_type!r}: TRIAGE supports {LOSS_TYPES}")


def policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    delta: float | None = None,
    importance_sampling_level: str = "token",
    num_items_in_batch: torch.Tensor | float | None = None,
    max_completion_length: int | None = None,
) -> torch.Tensor:
    """Weighted clipped surrogate → scalar loss (module docstring has the math).

    ``logps`` (B, T) carries the gradient; ``old_logps`` (B, T) is detached; ``advantages`` (B,) or (B, T);
    ``mask`` (B, T) of 0/1; ``weights`` (B, T) from ``token_weights`` or None. Half-precision log-probs are
    computed in fp32. Raises on shape mismatches, on NaN/inf log-probs or advantages and on NaN, inf or
    negative weights at valid positions (one host sync for all of them), and on ``max_completion_length`` < 1.
    Padding positions of every tensor may hold anything.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}: TRIAGE supports {LOSS_TYPES}")
    check_same_shape(logps, "logps", old_logps, "old_logps")
    valid = as_mask(mask, logps.shape)
    checks = [
        *logps_checks(logps, valid, "logps"),
        *logps_checks(old_logps, valid, "old_logps"),
        *advantages_checks(broadcast_advantages(advantages, logps.shape), valid),
    ]
    if weights is not None:
        if tuple(weights.shape) != tuple(logps.shape):
            raise ValueError(f"weights has shape {tuple(weights.shape)}, logps has {tuple(logps.shape)}")
        checks += weights_checks(weights, valid)
    raise_first(checks)
    logps = logps.float() if logps.dtype != torch.float32 else logps
    old_logps = old_logps.detach().float()
    # Padding may hold garbage (even NaN): zero it so 0 · NaN cannot leak into the sums.
    zero = torch.zeros((), device=logps.device)
    advantages = torch.where(valid, broadcast_advantages(advantages, logps.shape), zero)
    logps = torch.where(valid, logps, zero)
    old_logps = torch.where(valid, old_logps, zero)
    if mask.dtype == torch.bool:
        mask = mask.float()
    per_token_loss = per_token_surrogate(
        logps,
        old_logps,
        advantages,
        mask,
        loss_type=loss_type,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        delta=delta,
        importance_sampling_level=importance_sampling_level,
    )
    if weights is not None:
        weights = torch.where(
            valid, weights.detach().to(per_token_loss.dtype), torch.zeros((), device=logps.device)
        )
        per_token_loss = per_token_loss * weights
    return aggregate_loss(
        per_token_loss,
        mask,
        loss_type=loss_type,
        num_items_in_batch=num_items_in_batch,
        max_completion_length=max_completion_length,
    )
