"""Mismatch statistics, namespaced ``triage/...``.

Two steps so a multi-process trainer can aggregate exactly:

1. ``mismatch_sums`` returns raw sums and counts (0-d float64 tensors). Summing the dicts of every process
   (``all_reduce(SUM)``) gives the global sums.
2. ``metrics_from_sums`` turns (global) sums into ratios. Quantiles cannot be summed: compute them with
   ``delta_quantiles`` on the gathered valid δ.

``mismatch_metrics`` does both for one process. Definitions (N = valid tokens; classes as in
``triage.classes``; w the token weight, A the advantage):

* ``triage/<class>/share``       = N_class / N
* ``triage/<class>/mean_delta``  = Σ_class δ / N_class
* ``triage/<class>/mean_weight`` = Σ_class w / N_class
* ``triage/<class>/mass_share``  = Σ_class |w·A| / Σ |w·A|   (the class's share of the loss mass)
* ``triage/mean_abs_delta``      = Σ |δ| / N;  ``triage/mean_delta`` = Σ δ / N
* ``triage/kl_k3``               = mean(e^δ − 1 − δ): k3 estimate of KL(π_sampler ‖ π_learner) from the
                                   sampler's own samples (verl's ``k3_kl``)
* ``triage/kl_learner_sampler``  = mean(e^δ·δ − e^δ + 1): the importance-weighted estimate of
                                   KL(π_learner ‖ π_sampler)
* ``triage/mean_abs_dprob``      = Σ |Δp| / N, Δp = p_learner − p_sampler = p_s · (e^δ − 1): only when the
                                   sampler's log-probs are given (``sampler_logps``), the scale on which to
                                   pick a probability-space τ (``tau_space="prob"``)
* ``triage/<class>/grad_share``  = Σ_class |w·A|·(1 − p_l) / Σ |w·A|·(1 − p_l), p_l = p_s · e^δ the learner's
                                   probability of the token: the class's share of the policy gradient's
                                   size at the logits (a softmax's ‖∇_z log p_y‖ lies between 1 − p_y and
                                   √2·(1 − p_y), so a token the learner finds unlikely pulls harder); only
                                   with ``sampler_logps``
* ``triage/suppressed_frac``     = share of valid tokens the correction cut by more than 1 % (w < 0.99)
* ``triage/guarded_frac``        = share of responses scaled down by the TRIAGE sequence guard
* ``triage/delta_p0.1`` … ``triage/delta_p99.9``: quantiles 0.1 %, 1 %, 50 %, 99 %, 99.9 % of δ
* ``triage/seq_mean_delta_p0.1`` … ``_p99.9``: the same quantiles of the per-response mean δ
                                   (Σ_t δ / valid tokens of the response; responses with none left out):
                                   the statistic OPSM thresholds, to calibrate ``opsm_threshold`` on

With ``tau_space="prob"`` the classes use the probability band |Δp| ≤ τ (``triage.classes``) and the
sampler's log-probs are required (``sampler_logps=``).

With no valid token every metric is 0.0 (never NaN).
"""

from __future__ import annotations

import torch

from triage.classes import TokenClass, band_gap, checked_inputs, classes_of, resolve_tau
from triage.config import TriageConfig
from triage.mismatch import as_mask, weights_checks
from triage.weights import guarded_of

QUANTILES = {"p0.1": 0.001, "p1": 0.01, "p50": 0.5, "p99": 0.99, "p99.9": 0.999}
STAT_CLASSES = tuple(c for c in TokenClass if c != TokenClass.PAD)
# A weight counts as suppressed when the correction cut it by more than 1 % (an IS weight of 0.9999 on a
# consistent token is not a suppression).
SUPPRESSED_BELOW = 0.99


def mismatch_sums(
    delta: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    config: TriageConfig | None = None,
    tau: float | None = None,
    *,
    sampler_logps: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Raw sums and counts (0-d float64 tensors on δ's device) — all-reduce them with SUM.

    δ, the advantages and ``sampler_logps`` are validated as in ``classify_tokens``, the weights as loss
    weights (finite, ≥ 0 at valid positions); one host sync. ``sampler_logps`` is required when
    ``config.tau_space == "prob"``; when given (in either space) the sums include ``sum_abs_dprob``."""
    config = config or TriageConfig()
    if tuple(weights.shape) != tuple(delta.shape):
        raise ValueError(f"weights has shape {tuple(weights.shape)}, delta has {tuple(delta.shape)}")
    t = resolve_tau(config, tau)
    valid, adv = checked_inputs(
        delta,
        advantages,
        mask,
        *weights_checks(weights, as_mask(mask, delta.shape)),
        config=config,
        sampler_logps=sampler_logps,
    )
    adv = adv.double()
    d = torch.where(valid, delta.detach().double(), torch.zeros((), dtype=torch.float64, device=delta.device))
    w = torch.where(
        valid, weights.detach().double(), torch.zeros((), dtype=torch.float64, device=delta.device)
    )
    v = valid.double()
    classes = classes_of(band_gap(d, valid, config, sampler_logps), adv, valid, t)
    ratio = torch.exp(d.clamp(max=80.0))
    mass = (w * adv).abs()

    sums: dict[str, torch.Tensor] = {
        "tokens": v.sum(),
        "sequences": (valid.sum(-1) > 0).double().sum(),
        "sum_delta": d.sum(),
        "sum_abs_delta": d.abs().sum(),
        "sum_k3": ((ratio - 1.0 - d) * v).sum(),
        "sum_kl_learner_sampler": ((ratio * d - ratio + 1.0) * v).sum(),
        "suppressed": ((w < SUPPRESSED_BELOW) & valid).double().sum(),
        "guarded": guarded_of(d, adv, valid, config, t, sampler_logps).double().sum(),
        "mass": mass.sum(),
    }
    if sampler_logps is not None:
        p_sampler = torch.exp(sampler_logps.detach().double())
        dprob = torch.where(
            valid, p_sampler * torch.expm1(d), torch.zeros((), dtype=torch.float64, device=d.device)
        )
        sums["sum_abs_dprob"] = dprob.abs().sum()
        # 1 − p_l with p_l = p_s·e^δ (≤ 1 up to rounding: clamped); padding may hold anything: 0 there
        p_learner = (p_sampler * ratio).clamp(max=1.0)
        grad = torch.where(
            valid, mass * (1.0 - p_learner), torch.zeros((), dtype=torch.float64, device=d.device)
        )
        sums["grad_mass"] = grad.sum()
    for cls in STAT_CLASSES:
        in_class = (classes == int(cls)).double()
        sums[f"{cls.label}/tokens"] = in_class.sum()
        sums[f"{cls.label}/sum_delta"] = (d * in_class).sum()
        sums[f"{cls.label}/sum_weight"] = (w * in_class).sum()
        sums[f"{cls.label}/mass"] = (mass * in_class).sum()
        if sampler_logps is not None:
            sums[f"{cls.label}/grad_mass"] = (grad * in_class).sum()
    return sums


def _ratio(num: float, den: float) -> float:
    return float(num) / float(den) if den > 0 else 0.0


def metrics_from_sums(sums: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """Ratios from (possibly all-reduced) ``mismatch_sums``; keys ``triage/...``; never NaN."""
    s = {k: float(v) for k, v in sums.items()}
    n = s["tokens"]
    out = {
        "triage/tokens": n,
        "triage/mean_delta": _ratio(s["sum_delta"], n),
        "triage/mean_abs_delta": _ratio(s["sum_abs_delta"], n),
        "triage/kl_k3": _ratio(s["sum_k3"], n),
        "triage/kl_learner_sampler": _ratio(s["sum_kl_learner_sampler"], n),
        "triage/suppressed_frac": _ratio(s["suppressed"], n),
        "triage/guarded_seqs": s["guarded"],
        "triage/guarded_frac": _ratio(s["guarded"], s["sequences"]),
    }
    if "sum_abs_dprob" in s:
        out["triage/mean_abs_dprob"] = _ratio(s["sum_abs_dprob"], n)
    for cls in STAT_CLASSES:
        c = s[f"{cls.label}/tokens"]
        out[f"triage/{cls.label}/share"] = _ratio(c, n)
        out[f"triage/{cls.label}/mean_delta"] = _ratio(s[f"{cls.label}/sum_delta"], c)
        out[f"triage/{cls.label}/mean_weight"] = _ratio(s[f"{cls.label}/sum_weight"], c)
        out[f"triage/{cls.label}/mass_share"] = _ratio(s[f"{cls.label}/mass"], s["mass"])
        if "grad_mass" in s:
            out[f"triage/{cls.label}/grad_share"] = _ratio(s[f"{cls.label}/grad_mass"], s["grad_mass"])
    return out


def _quantiles(values: torch.Tensor, prefix: str) -> dict[str, float]:
    """``prefix + name`` → the :data:`QUANTILES` of 1-D ``values`` (0.0 each when empty), interpolated linearly
    between order statistics (numpy's default "linear" method)."""
    if values.numel() == 0:
        return {f"{prefix}{name}": 0.0 for name in QUANTILES}
    ordered = values.sort().values
    last = ordered.numel() - 1
    out = {}
    for name, q in QUANTILES.items():
        pos = q * last
        lo = int(pos)
        hi = min(lo + 1, last)
        frac = pos - lo
        out[f"{prefix}{name}"] = float(ordered[lo] * (1 - frac) + ordered[hi] * frac)
    return out


def delta_quantiles(delta: torch.Tensor, mask: torch.Tensor | None = None) -> dict[str, float]:
    """Quantiles of δ over the valid tokens (all of ``delta`` when ``mask`` is None; 0.0 when empty), and of
    the per-response mean δ (``triage/seq_mean_delta_*``, over responses with at least one valid token)."""
    values = delta.detach().float()
    valid = torch.ones_like(values, dtype=torch.bool) if mask is None else as_mask(mask, delta.shape)
    out = _quantiles(values[valid].flatten(), "triage/delta_")
    rows = values.reshape(-1, values.shape[-1]) if values.dim() else values.reshape(1, 1)
    row_valid = valid.reshape(rows.shape)
    counts = row_valid.sum(-1)
    sums = torch.where(row_valid, rows, torch.zeros((), device=rows.device)).sum(-1)  # padding may be garbage
    means = sums[counts > 0] / counts[counts > 0]
    out.update(_quantiles(means, "triage/seq_mean_delta_"))
    return out


def mismatch_metrics(
    delta: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    config: TriageConfig | None = None,
    tau: float | None = None,
    *,
    sampler_logps: torch.Tensor | None = None,
) -> dict[str, float]:
    """All ``triage/...`` metrics for one process: ratios of ``mismatch_sums`` plus δ quantiles and τ.
    ``sampler_logps``: as in ``mismatch_sums`` (required when ``config.tau_space == "prob"``)."""
    config = config or TriageConfig()
    out = metrics_from_sums(
        mismatch_sums(delta, advantages, mask, weights, config, tau=tau, sampler_logps=sampler_logps)
    )
    out.update(delta_quantiles(delta, mask))
    out["triage/tau"] = resolve_tau(config, tau)
    return out
