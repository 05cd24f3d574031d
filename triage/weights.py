"""Per-token loss weights for every correction mode.

The weight w_t multiplies the per-token clipped surrogate (of any TRL loss type). Weights are detached:
they scale the gradient, never carry one. Padding gets 0. Tokens whose weight is reduced (or masked) stay
in the loss normaliser — the correction lowers their contribution, it does not change what "one token"
counts for (see docs/triage.md, "Normaliser").

r_t = exp δ_t. Modes:

* ``none``    w = 1
* ``tis``     w = min(r, C)                                              (token truncated IS)
* ``icepop``  w = r · 1[α ≤ r ≤ β]                                       (token two-sided mask)
* ``seq-mis`` w = ρ · 1[lo ≤ ρ ≤ hi], ρ = Π r (product) or exp(mean δ)    (sequence, broadcast)
* ``opsm``    w = 0 for a response with A < 0 and mean δ < −threshold, else 1 (DeepSeek-V3.2 OPSM on δ)
* ``veto``    w = 0 for a response with any r < veto_floor, else 1
* ``triage``  per-class policy (``TriageConfig``), amplify-down hard floor, sequence guard

In probability space (``TriageConfig.tau_space = "prob"``) only the TRIAGE band changes: a token is outside
it when |Δp| > τ, Δp = p_s · (e^δ − 1) (``triage.classes``), and ``soft`` measures the excess of |δ| over the
token's own band edge |δ_τ|, δ_τ = log(1 + sign(δ) · τ / p_s) — the gap at which |Δp| = τ, so the weight is
still 1 at the band's edge and ≤ 1 beyond it. ``keep``, ``is``, ``mask``, the floor and the guard are
unchanged functions of δ.
"""

from __future__ import annotations

import math

import torch

from triage.classes import POLICY_CLASSES, TokenClass, band_gap, checked_inputs, classes_of, resolve_tau
from triage.config import TriageConfig


def soft_excess(
    delta: torch.Tensor,
    tau: float,
    config: TriageConfig,
    gap: torch.Tensor | None = None,
    sampler_logps: torch.Tensor | None = None,
) -> torch.Tensor:
    """How far |δ| lies beyond the band's edge, in nats (≥ 0; 0 inside the band): the ``soft`` policy's
    exp(−λ · excess). Log space: |δ| − τ. Probability space (``gap`` = Δp from ``band_gap``, and the sampler's
    log-probs): |δ| − |δ_τ| for |Δp| > τ, δ_τ = log(1 + sign(δ) · τ / p_s), else 0. Out of the band, p_s > 0
    and, below it, p_s > τ, so δ_τ is finite there."""
    if config.tau_space == "log" or gap is None or sampler_logps is None:
        return (delta.abs() - tau).clamp(min=0.0)
    ratio = tau / torch.exp(sampler_logps.detach().to(delta.dtype))
    edge = torch.log1p(torch.where(delta > 0, ratio, -ratio)).abs()  # NaN/inf only where in band (unused)
    outside = gap.abs() > tau
    return torch.where(outside, delta.abs() - edge, torch.zeros_like(delta)).clamp(min=0.0)


def _policy_weight(
    policy: str, delta: torch.Tensor, excess: torch.Tensor, config: TriageConfig
) -> torch.Tensor:
    if policy == "keep":
        return torch.ones_like(delta)
    if policy == "is":
        return torch.exp(delta).clamp(max=config.is_cap)
    if policy == "soft":
        return torch.exp(-config.soft_rate * excess)
    if policy == "mask":
        return torch.zeros_like(delta)
    raise ValueError(f"unknown policy {policy!r}")  # unreachable: TriageConfig validates


def _sequence_mean(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    counts = valid.sum(-1)
    return torch.where(
        counts > 0,
        (values * valid).sum(-1) / counts.clamp(min=1),
        torch.zeros_like(counts, dtype=values.dtype),
    )


def sequence_guard_scale(
    delta: torch.Tensor, adv: torch.Tensor, classes: torch.Tensor, valid: torch.Tensor, kappa: float | None
) -> torch.Tensor:
    """(B,) factor ≤ 1: κ / m for responses with A < 0 whose negative-tail mass m exceeds κ, else 1.

    m_i = Σ_t |δ_it| · 1[class = AMPLIFY_DOWN] / (valid tokens of response i).
    """
    batch = delta.shape[0]
    if kappa is None:
        return torch.ones(batch, dtype=torch.float32, device=delta.device)
    tail = (classes == int(TokenClass.AMPLIFY_DOWN)).float()
    mass = _sequence_mean(delta.abs() * tail, valid)
    negative = _sequence_mean(adv, valid) < 0
    guarded = negative & (mass > kappa)
    return torch.where(guarded, kappa / mass.clamp(min=1e-30), torch.ones_like(mass))


def token_weights(
    delta: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: TriageConfig | None = None,
    tau: float | None = None,
    *,
    sampler_logps: torch.Tensor | None = None,
) -> torch.Tensor:
    """(B, T) fp32 detached weights for the configured correction; 0 where ``mask`` is 0.

    ``tau`` overrides the config's τ (pass ``AdaptiveTau.value`` when ``config.tau == "auto"``).
    ``sampler_logps`` (B, T), the sampler's log-probs δ was computed from, is required when
    ``config.tau_space == "prob"`` (module docstring) and otherwise only validated.
    Sequence-level modes broadcast one weight over the response's tokens. δ, the advantages and
    ``sampler_logps`` are validated as in ``classify_tokens`` (one host sync).
    """
    config = config or TriageConfig()
    t = resolve_tau(config, tau)
    valid, adv = checked_inputs(delta, advantages, mask, config=config, sampler_logps=sampler_logps)
    # padding never leaks in
    delta = torch.where(valid, delta.detach().float(), torch.zeros((), device=delta.device))
    mode = config.correction

    if mode == "none":
        weights = torch.ones_like(delta)
    elif mode == "tis":
        weights = torch.exp(delta).clamp(max=config.is_cap)
    elif mode == "icepop":
        ratio = torch.exp(delta)
        keep = (ratio >= config.icepop_low) & (ratio <= config.icepop_high)
        weights = torch.where(keep, ratio, torch.zeros_like(ratio))
    elif mode == "seq-mis":
        if config.seq_mis_level == "product":
            log_rho = (delta * valid).sum(-1)
        else:
            log_rho = _sequence_mean(delta, valid)
        rho = torch.exp(log_rho)
        keep = (rho >= config.seq_mis_low) & (rho <= config.seq_mis_high)
        weights = torch.where(keep, rho, torch.zeros_like(rho))[:, None].expand_as(delta)
    elif mode == "opsm":
        drop = (_sequence_mean(adv, valid) < 0) & (_sequence_mean(delta, valid) < -config.opsm_threshold)
        weights = (~drop).float()[:, None].expand_as(delta)
    elif mode == "veto":
        catastrophic = (delta < math.log(config.veto_floor)) & valid
        weights = (~catastrophic.any(-1)).float()[:, None].expand_as(delta)
    elif mode == "triage":
        gap = band_gap(delta, valid, config, sampler_logps)
        classes = classes_of(gap, adv, valid, t)
        excess = soft_excess(delta, t, config, gap, sampler_logps)
        weights = torch.ones_like(delta)  # INERT tokens: no gradient anyway; weight 1 keeps them neutral
        for cls in POLICY_CLASSES:
            policy = getattr(config, cls.label)
            in_class = classes == int(cls)
            weights = torch.where(in_class, _policy_weight(policy, delta, excess, config), weights)
        if config.tail_floor is not None:
            floored = (classes == int(TokenClass.AMPLIFY_DOWN)) & (delta < -config.tail_floor)
            weights = torch.where(floored, torch.zeros_like(weights), weights)
        weights = weights * sequence_guard_scale(delta, adv, classes, valid, config.guard_kappa)[:, None]
    else:  # unreachable: TriageConfig validates
        raise ValueError(f"unknown correction {mode!r}")

    return torch.where(valid, weights, torch.zeros((), device=delta.device)).contiguous()


def guarded_sequences(
    delta: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: TriageConfig,
    tau: float | None = None,
    *,
    sampler_logps: torch.Tensor | None = None,
) -> torch.Tensor:
    """(B,) bool: responses the TRIAGE sequence guard scaled down (always False for other modes). δ, the
    advantages and ``sampler_logps`` (required when ``config.tau_space == "prob"``) are validated as in
    ``classify_tokens``."""
    t = resolve_tau(config, tau)
    valid, adv = checked_inputs(delta, advantages, mask, config=config, sampler_logps=sampler_logps)
    return guarded_of(delta, adv, valid, config, t, sampler_logps)


def guarded_of(
    delta: torch.Tensor,
    adv: torch.Tensor,
    valid: torch.Tensor,
    config: TriageConfig,
    tau: float,
    sampler_logps: torch.Tensor | None = None,
) -> torch.Tensor:
    """``guarded_sequences`` on inputs already validated (``checked_inputs``) and τ resolved."""
    if config.correction != "triage" or config.guard_kappa is None:
        return torch.zeros(delta.shape[0], dtype=torch.bool, device=delta.device)
    delta = torch.where(valid, delta.detach().float(), torch.zeros((), device=delta.device))
    classes = classes_of(band_gap(delta, valid, config, sampler_logps), adv, valid, tau)
    return sequence_guard_scale(delta, adv, classes, valid, config.guard_kappa) < 1.0
