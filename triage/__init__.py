"""triage-rl: mismatch-aware low-precision RL for LLMs.

The core (this package's top level) depends on torch only::

    from triage import TriageConfig, token_gap, token_weights, policy_loss, mismatch_metrics

    delta = token_gap(learner_logps, sampler_logps, mask)         # δ = log π_l − log π_s
    weights = token_weights(delta, advantages, mask, config)      # detached (B, T)
    loss = policy_loss(logps, old_logps, advantages, mask, weights, loss_type="dapo")
    metrics = mismatch_metrics(delta, advantages, mask, weights, config)

NVFP4 kernels live in ``triage.kernels``, the TRL trainers in ``triage.trainers``.
"""

from triage._version import __version__
from triage.adaptive import AdaptiveTau
from triage.classes import TokenClass, classify_tokens
from triage.config import CORRECTIONS, POLICIES, TriageConfig
from triage.loss import LOSS_TYPES, aggregate_loss, per_token_surrogate, policy_loss
from triage.metrics import delta_quantiles, metrics_from_sums, mismatch_metrics, mismatch_sums
from triage.mismatch import token_gap
from triage.weights import token_weights

__all__ = [
    "__version__",
    "AdaptiveTau",
    "CORRECTIONS",
    "LOSS_TYPES",
    "POLICIES",
    "TokenClass",
    "TriageConfig",
    "aggregate_loss",
    "classify_tokens",
    "delta_quantiles",
    "metrics_from_sums",
    "mismatch_metrics",
    "mismatch_sums",
    "per_token_surrogate",
    "policy_loss",
    "token_gap",
    "token_weights",
]
