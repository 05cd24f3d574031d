"""``TriageConfig``: which mismatch correction to apply and how TRIAGE weighs each token class.

Every field is validated in ``__post_init__`` with an error that names the field and the accepted values,
so a typo in a YAML recipe fails at start-up, not after an hour of training. The config is frozen: a
validated config cannot be edited into an invalid one (``dataclasses.replace(config, field=value)`` builds a
new, validated config).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

CORRECTIONS = ("none", "tis", "icepop", "seq-mis", "opsm", "veto", "triage")
POLICIES = ("keep", "is", "soft", "mask")
SEQ_MIS_LEVELS = ("product", "geometric")
# Where the tolerance band is measured: "log" |δ| ≤ τ (nats), "prob" |p_learner − p_sampler| ≤ τ.
TAU_SPACES = ("log", "prob")

# The per-class policy fields, in TokenClass order (consistent first, then the four tails).
CLASS_POLICY_FIELDS = ("consistent", "amplify_down", "correct_up", "amplify_up", "correct_down")
# Largest tolerance a config may set (fixed ``tau``, ``tau_init``, ``tau_floor``), in nats: a band |δ| ≤ 1
# already calls a probability ratio of e ≈ 2.7 either way "consistent", wider than the default IS cap (2).
# A wider band switches the correction off for the gaps it exists for (use ``correction="none"`` for that).
TAU_MAX = 1.0
# In probability space (``tau_space="prob"``) the same bound is a probability difference: |Δp| ≤ 1 for every
# token, so τ = 1 already calls every token consistent.

#: Named TRIAGE configurations (:meth:`TriageConfig.profile`), as field overrides of the defaults.
#: ``"symmetric-is"`` is the default: every class weighted by its truncated ratio min(e^δ, C), whatever the
#: advantage's sign — token-level TIS, with TRIAGE's classes kept for the per-class statistics. In the mismatch
#: testbed at sampling temperature 1.3 vanilla GRPO collapsed in 4 of 5 seeds from mismatch alone, and so did
#: the profile ``"keep-down"`` (2 of 3 collapsed, the third falling), while TIS and IcePop — which scale
#: the δ < 0 tokens of both advantage signs — stayed stable in 3 of 3 (docs/results.md §3.6, docs/triage.md
#: "Defaults"). ``"keep-down"`` keeps the δ < −τ tokens at full weight (correct-up and amplify-down ``keep``)
#: and soft-weights the amplify-up tail. ``"suppress-down"`` down-weights (``soft``), floors (``tail_floor``)
#: and guards (``guard_kappa``) the amplify-down tail — δ < −τ with A < 0 — while keeping the correct-up tokens
#: (δ < −τ, A > 0) at full weight: removing the negative updates of tokens the learner under-weights, but not
#: the positive ones, biases every step toward raising them; it and its variants collapsed GRPO in 10 of 10 runs (§3.3,
#: §3.4), and the same one-sided rule as a probability-space mask degraded 2 of 3 at temperature 1.3 (§3.6). Both are
#: kept for comparison, not as recommendations.
_KEEP_DOWN: dict[str, Any] = {"amplify_down": "keep", "correct_up": "keep", "amplify_up": "soft"}
PROFILES: dict[str, dict[str, Any]] = {
    "symmetric-is": {},
    "keep-down": _KEEP_DOWN,
    # keep-down with the amplify-down tail cut: soft-weighted, floored and guarded
    "suppress-down": {**_KEEP_DOWN, "amplify_down": "soft", "tail_floor": 3.0, "guard_kappa": 0.1},
}


@dataclass(frozen=True)
class TriageConfig:
    """Mismatch-correction settings (DESIGN §2; docs/triage.md has the full table).

    δ_t = log π_learner(y_t) − log π_sampler(y_t) with the learner at the sampler's weights; A_t the
    advantage. With ``correction="triage"`` each valid token falls in one class — consistent (|δ| ≤ τ),
    amplify-down (δ < −τ, A < 0), correct-up (δ < −τ, A > 0), amplify-up (δ > τ, A > 0), correct-down
    (δ > τ, A < 0), inert (A = 0) — and gets the weight of its class policy:

    * ``keep``: w = 1
    * ``is``:   w = min(exp δ, is_cap)
    * ``soft``: w = exp(−soft_rate · (|δ| − τ)) for |δ| > τ (1 at the band's edge, ≤ 1 beyond it)
    * ``mask``: w = 0

    ``tau_space`` says where the band is measured. ``"log"`` (the default): |δ| ≤ τ, τ in nats, as above.
    ``"prob"``: |p_l − p_s| ≤ τ with p_s = exp(log π_sampler(y_t)), p_l = exp(log π_learner(y_t)), so
    Δp = p_l − p_s = p_s · (e^δ − 1) and τ ∈ [0, 1] is a probability difference; the class still follows
    sign(δ) (= sign(Δp)), so amplify-down is Δp < −τ with A < 0, and so on. A token whose sampler probability
    is at most τ can never fall below the band (Δp > −p_s ≥ −τ), however large its |δ|. The weight policies
    stay functions of δ; ``soft`` measures the excess from the token's own band edge δ_τ, the gap at which
    |Δp| = τ: w = exp(−soft_rate · (|δ| − |δ_τ|)), δ_τ = log(1 + sign(δ) · τ / p_s) (= ±τ in log space).
    The functions that classify then need the sampler's log-probs (``sampler_logps=``). ``tau="auto"`` is
    refused in probability space: the adaptive τ tracks a scale of |δ| in nats, which says nothing about
    probability differences.

    With ``tail_floor`` set, amplify-down tokens additionally get w = 0 when δ < −``tail_floor`` (a hard
    floor of the negative tail). With ``guard_kappa`` set, the sequence guard scales a whole response with
    A < 0 by κ / m when its negative-tail mass m = Σ_{amplify-down} |δ_t| / (valid tokens of the response)
    exceeds κ.

    Defaults (the ``"symmetric-is"`` profile): every class ``is``, so w = min(e^δ, is_cap) on every token
    whatever the advantage's sign — the weights of token-level TIS — with no floor and no guard. The rule
    behind it: scale the δ < 0 tokens (the majority under sampling from the sampler) the same way for both
    advantage signs; keeping them at full weight did not stop a mismatch-driven collapse, and down-weighting
    only the A < 0 side caused one. :data:`PROFILES` describes ``"keep-down"`` and ``"suppress-down"`` and
    the evidence.
    """

    correction: str = "triage"
    # Tolerance band |δ| ≤ τ in nats, or "auto" (τ = max(tau_floor, tau_multiplier · EMA(median |δ|))).
    tau: float | str = 0.05
    # Where the band is measured: "log" (|δ| ≤ τ, nats) or "prob" (|p_learner − p_sampler| ≤ τ).
    tau_space: str = "log"
    # TRIAGE per-class policies (the "symmetric-is" profile; see the class docstring and PROFILES).
    consistent: str = "is"
    amplify_down: str = "is"
    correct_up: str = "is"
    amplify_up: str = "is"
    correct_down: str = "is"
    is_cap: float = 2.0
    soft_rate: float = 1.0
    tail_floor: float | None = None
    guard_kappa: float | None = None
    # Adaptive tolerance (tau="auto").
    tau_init: float = 0.05
    tau_multiplier: float = 2.0
    tau_floor: float = 1e-3
    tau_ema: float = 0.9
    # Baselines.
    veto_floor: float = 1e-4
    icepop_low: float = 0.5
    icepop_high: float = 5.0
    seq_mis_low: float = 0.5
    seq_mis_high: float = 2.0
    seq_mis_level: str = "product"
    opsm_threshold: float = 0.5

    def __post_init__(self) -> None:
        if self.correction not in CORRECTIONS:
            raise ValueError(f"TriageConfig.correction={self.correction!r}: expected one of {CORRECTIONS}")
        if isinstance(self.tau, str) and self.tau != "auto":
            try:
                object.__setattr__(self, "tau", float(self.tau))  # frozen: the one normalisation
            except ValueError:
                raise ValueError(
                    f"TriageConfig.tau={self.tau!r}: expected a float in [0, {TAU_MAX}] (nats) or 'auto'"
                ) from None
        if self.tau_space not in TAU_SPACES:
            raise ValueError(f"TriageConfig.tau_space={self.tau_space!r}: expected one of {TAU_SPACES}")
        if self.tau_space == "prob" and self.adaptive:
            raise ValueError(
                "TriageConfig.tau='auto' with tau_space='prob': the adaptive τ tracks a scale of |δ| in nats, "
                "not a probability difference; set a fixed tau in [0, 1] (e.g. 0.2, prime-rl's default)"
            )
        if not isinstance(self.tau, str):
            unit = "nats; see TAU_MAX" if self.tau_space == "log" else "a probability difference"
            _check_number("tau", self.tau, minimum=0.0, maximum=TAU_MAX, unit=unit)
        for name in CLASS_POLICY_FIELDS:
            value = getattr(self, name)
            if value not in POLICIES:
                raise ValueError(f"TriageConfig.{name}={value!r}: expected one of {POLICIES}")
        # C < 1 would cut the weight of on-policy tokens (r = 1) below 1: a cap, not a down-weighting rule.
        _check_number("is_cap", self.is_cap, minimum=1.0)
        _check_number("soft_rate", self.soft_rate, minimum=0.0)
        if self.tail_floor is not None:
            _check_number("tail_floor", self.tail_floor, minimum=0.0)
        if self.guard_kappa is not None:
            _check_number("guard_kappa", self.guard_kappa, minimum=0.0, strict=True)
        _check_number("tau_init", self.tau_init, minimum=0.0, maximum=TAU_MAX)
        _check_number("tau_multiplier", self.tau_multiplier, minimum=0.0, strict=True)
        _check_number("tau_floor", self.tau_floor, minimum=0.0, maximum=TAU_MAX)
        _check_number("tau_ema", self.tau_ema, minimum=0.0)
        if self.tau_ema >= 1.0:
            raise ValueError(f"TriageConfig.tau_ema={self.tau_ema}: expected 0 ≤ tau_ema < 1")
        # veto_floor is a ratio e^δ: at ≥ 1 every response with one token below the sampler would be dropped.
        _check_number("veto_floor", self.veto_floor, minimum=0.0, strict=True)
        if self.veto_floor >= 1.0:
            raise ValueError(f"TriageConfig.veto_floor={self.veto_floor!r}: expected 0 < veto_floor < 1")
        # The kept ratio band must contain r = 1 (no mismatch), or on-policy tokens would be masked.
        for low, high in (("icepop_low", "icepop_high"), ("seq_mis_low", "seq_mis_high")):
            lo, hi = getattr(self, low), getattr(self, high)
            _check_number(low, lo, minimum=0.0)
            _check_number(high, hi, minimum=0.0, strict=True)
            if lo >= hi:
                raise ValueError(f"TriageConfig.{low}={lo} must be < {high}={hi}")
            if not lo <= 1.0 <= hi:
                raise ValueError(
                    f"TriageConfig.{low}={lo}, {high}={hi}: the kept band must contain the ratio 1 "
                    f"({low} ≤ 1 ≤ {high})"
                )
        if self.seq_mis_level not in SEQ_MIS_LEVELS:
            raise ValueError(
                f"TriageConfig.seq_mis_level={self.seq_mis_level!r}: expected one of {SEQ_MIS_LEVELS}"
            )
        _check_number("opsm_threshold", self.opsm_threshold, minimum=0.0)

    @property
    def adaptive(self) -> bool:
        """True when τ is tracked from the data (``tau="auto"``)."""
        return self.tau == "auto"

    def fixed_tau(self) -> float:
        """τ for a fixed-tolerance config; when adaptive and no tracker value is given, the tracker's start
        ``max(tau_floor, tau_init)`` (what ``AdaptiveTau`` begins with)."""
        return float(max(self.tau_floor, self.tau_init) if self.adaptive else self.tau)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def profile(cls, name: str, **overrides: Any) -> TriageConfig:
        """The named configuration ``name`` (a key of :data:`PROFILES`), with ``overrides`` on top:
        ``TriageConfig.profile("suppress-down")`` is the alternative :data:`PROFILES` describes."""
        if name not in PROFILES:
            raise ValueError(
                f"TriageConfig.profile: unknown profile {name!r}; expected one of {tuple(PROFILES)}"
            )
        return cls(**{**PROFILES[name], **overrides})

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """Names of every field, in declaration order (trainer configs mirror them)."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TriageConfig:
        """Build from a mapping, ignoring keys that are not TriageConfig fields (e.g. a trainer config)."""
        names = set(cls.field_names())
        return cls(**{k: v for k, v in values.items() if k in names})


def _check_number(
    name: str,
    value: Any,
    *,
    minimum: float,
    strict: bool = False,
    maximum: float | None = None,
    unit: str = "nats; see TAU_MAX",
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"TriageConfig.{name}={value!r}: expected a finite number")
    if value < minimum or (strict and value == minimum):
        relation = ">" if strict else "≥"
        raise ValueError(f"TriageConfig.{name}={value!r}: expected {relation} {minimum}")
    if maximum is not None and value > maximum:
        raise ValueError(f"TriageConfig.{name}={value!r}: expected ≤ {maximum} ({unit})")
