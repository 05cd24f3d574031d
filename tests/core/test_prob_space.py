"""The probability-space tolerance (``TriageConfig.tau_space="prob"``): the band |p_learner − p_sampler| ≤ τ,
the ``sampler_logps`` argument it needs, and that the log-space default is untouched by it."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from triage import TokenClass, TriageConfig, classify_tokens, mismatch_metrics, mismatch_sums, token_weights
from triage.weights import guarded_sequences

C = TokenClass
# prime-rl's default loss mask (packages/prime-rl-configs .../trainer.py DefaultLossConfig: dppo_mask_low =
# dppo_mask_high = 0.2), as a TRIAGE config: the arm experiments/recipes/arms/prime-rl-mask.yaml
PRIME_RL = dict(
    correction="triage",
    tau_space="prob",
    tau=0.2,
    consistent="keep",
    amplify_down="mask",
    correct_up="keep",
    amplify_up="mask",
    correct_down="keep",
)


def _batch(seed: int, scale: float = 0.5, shape=(6, 40)):
    """Random δ, sampler log-probs spread over (0, 1] in probability, per-token advantages, a ragged mask;
    padding holds NaN (it may hold anything)."""
    g = torch.Generator().manual_seed(seed)
    sampler = torch.log(torch.rand(shape, generator=g).clamp(min=1e-6))
    learner = torch.log_softmax(torch.randn(shape, generator=g), -1).clamp(max=0.0)  # any log-probs
    learner = torch.where(
        torch.rand(shape, generator=g) < 0.5, sampler + scale * torch.randn(shape, generator=g), learner
    )
    learner = learner.clamp(max=0.0)
    delta = learner - sampler
    adv = torch.randn(shape, generator=g).round()  # zeros included: inert tokens
    mask = (torch.rand(shape, generator=g) > 0.15).float()
    delta = torch.where(mask.bool(), delta, torch.full_like(delta, float("nan")))
    return delta, adv, mask, sampler


def test_default_is_log_space():
    assert TriageConfig().tau_space == "log"
    assert TriageConfig() == TriageConfig(tau_space="log")
    assert TriageConfig.profile("suppress-down").tau_space == "log"


@pytest.mark.parametrize(
    "config",
    [
        TriageConfig(),
        TriageConfig.profile("suppress-down"),
        TriageConfig(amplify_down="mask", correct_up="soft", amplify_up="is", correct_down="mask", tau=0.3),
        TriageConfig(consistent="soft", tau=0.0, soft_rate=2.0),
        *(TriageConfig(correction=c) for c in ("none", "tis", "icepop", "seq-mis", "opsm", "veto")),
    ],
)
def test_log_space_ignores_sampler_logps_bit_for_bit(config):
    """In log space the sampler's log-probs only get validated: weights, classes, guard and every metric
    but the added mean |Δp| are the same tensors, bit for bit, as without them."""
    for seed in range(3):
        delta, adv, mask, sampler = _batch(seed)
        kw = {"sampler_logps": sampler}
        assert torch.equal(
            token_weights(delta, adv, mask, config), token_weights(delta, adv, mask, config, **kw)
        )
        assert torch.equal(
            classify_tokens(delta, adv, mask, config), classify_tokens(delta, adv, mask, config, **kw)
        )
        assert torch.equal(
            guarded_sequences(delta, adv, mask, config), guarded_sequences(delta, adv, mask, config, **kw)
        )
        w = token_weights(delta, adv, mask, config)
        plain, with_sampler = (
            mismatch_metrics(delta, adv, mask, w, config),
            mismatch_metrics(delta, adv, mask, w, config, **kw),
        )
        assert set(with_sampler) - set(plain) == {"triage/mean_abs_dprob"} | {
            f"triage/{c.label}/grad_share" for c in TokenClass if c != TokenClass.PAD
        }
        assert all(plain[k] == with_sampler[k] for k in plain)


@pytest.mark.parametrize(
    "policies", [("is", "keep", "keep", "soft", "is"), ("soft", "soft", "mask", "is", "keep")]
)
def test_log_space_triage_weights_equal_the_per_class_formulas(policies):
    """The default space's weights, recomputed from the documented per-class formulas with |δ| ≤ τ: exact."""
    tau, cap, rate = 0.05, 2.0, 1.5
    names = ("consistent", "amplify_down", "correct_up", "amplify_up", "correct_down")
    config = TriageConfig(tau=tau, is_cap=cap, soft_rate=rate, **dict(zip(names, policies)))
    delta, adv, mask, _ = _batch(7, scale=0.1)
    d = torch.where(mask.bool(), delta, torch.zeros(()))
    formula = {
        "keep": torch.ones_like(d),
        "is": torch.exp(d).clamp(max=cap),
        "soft": torch.exp(-rate * (d.abs() - tau).clamp(min=0.0)),
        "mask": torch.zeros_like(d),
    }
    klass = {
        "consistent": d.abs() <= tau,
        "amplify_down": (d < -tau) & (adv < 0),
        "correct_up": (d < -tau) & (adv > 0),
        "amplify_up": (d > tau) & (adv > 0),
        "correct_down": (d > tau) & (adv < 0),
    }
    want = torch.ones_like(d)
    for name, policy in zip(names, policies):
        want = torch.where(klass[name] & (adv != 0), formula[policy], want)
    want = torch.where(mask.bool(), want, torch.zeros(()))
    got = token_weights(delta, adv, mask, config)
    assert torch.equal(got, want)
    assert 0 < (got == 0).sum() < mask.sum()  # the batch exercises masked and kept tokens


def _one_class(delta: float, sampler_logp: float, adv: float, tau: float, space: str) -> int:
    config = TriageConfig(tau=tau, tau_space=space)
    return int(
        classify_tokens(
            torch.tensor([[delta]]),
            torch.tensor([adv]),
            torch.ones(1, 1),
            config,
            sampler_logps=torch.tensor([[sampler_logp]]),
        )[0, 0]
    )


def test_tiny_probability_with_a_large_gap_is_consistent_in_probability_space():
    """p_s = 1e-4 and δ = −5 (the learner gives it 150× less): |Δp| < 1e-4 ≤ τ = 0.2, so consistent; in log
    space the same token is deep in the amplify-down tail. Even δ = +5 (Δp ≈ 0.015) stays in the band."""
    s = math.log(1e-4)
    assert _one_class(-5.0, s, -1.0, 0.2, "prob") == C.CONSISTENT
    assert _one_class(-5.0, s, -1.0, 0.2, "log") == C.AMPLIFY_DOWN
    assert _one_class(5.0, s, 1.0, 0.2, "prob") == C.CONSISTENT
    assert _one_class(5.0, s, 1.0, 0.2, "log") == C.AMPLIFY_UP


@pytest.mark.parametrize(
    ("p_sampler", "delta", "adv", "want"),
    [
        # Δp = 0.9·(e^−0.5 − 1) ≈ −0.354 < −0.2: below the band, class by sign(A)
        (0.9, -0.5, -1.0, C.AMPLIFY_DOWN),
        (0.9, -0.5, 2.0, C.CORRECT_UP),
        # Δp = 0.3·(e^1 − 1) ≈ 0.515 > 0.2: above the band
        (0.3, 1.0, 1.0, C.AMPLIFY_UP),
        (0.3, 1.0, -0.5, C.CORRECT_DOWN),
        # inside the band on both sides: Δp ≈ −0.185 and +0.130 (yet |δ| = 0.23 and 0.36 nats > τ)
        (0.9, -0.23, -1.0, C.CONSISTENT),
        (0.3, 0.36, 1.0, C.CONSISTENT),
        # A = 0 still wins
        (0.9, -0.5, 0.0, C.INERT),
    ],
)
def test_large_probability_gap_is_classified_by_sign(p_sampler, delta, adv, want):
    assert _one_class(delta, math.log(p_sampler), adv, 0.2, "prob") == want


@given(
    p=st.floats(min_value=1e-6, max_value=1.0),
    d=st.floats(min_value=-8.0, max_value=8.0, width=32),
    a=st.floats(min_value=0.01, max_value=5.0) | st.floats(min_value=-5.0, max_value=-0.01),
    tau=st.floats(min_value=0.0, max_value=1.0, width=32),
)
def test_probability_classes_follow_the_band_and_the_sign_of_delta(p, d, a, tau):
    gap = p * math.expm1(d)  # Δp in float64
    if abs(abs(gap) - tau) < 1e-5 * max(1.0, tau):
        return  # at the edge fp32 rounding decides
    c = _one_class(d, math.log(p), a, tau, "prob")
    if abs(gap) <= tau:
        assert c == C.CONSISTENT
    elif d < 0:
        assert c == (C.AMPLIFY_DOWN if a < 0 else C.CORRECT_UP)
    else:
        assert c == (C.AMPLIFY_UP if a > 0 else C.CORRECT_DOWN)


def test_below_the_band_needs_a_sampler_probability_above_tau():
    """Δp = p_s(e^δ − 1) > −p_s: with p_s ≤ τ no δ, however negative, leaves the band downwards."""
    for p in (0.05, 0.2):
        assert _one_class(-200.0, math.log(p), -1.0, 0.2, "prob") == C.CONSISTENT
    assert _one_class(-200.0, math.log(0.21), -1.0, 0.2, "prob") == C.AMPLIFY_DOWN


def test_prime_rl_mask_reproduced():
    """The ``prime-rl-mask`` config gives prime-rl's default keep mask (src/prime_rl/trainer/rl/loss.py,
    ``default_loss_fn``), written here from its formula: with Δp = exp(l) − exp(s), a token is dropped when
    Δp > 0.2 and A > 0, or Δp < −0.2 and A < 0; every other token keeps weight 1."""
    config = TriageConfig(**PRIME_RL)
    for seed in range(4):
        delta, adv, mask, sampler = _batch(seed)
        valid = mask.bool()
        probs_diff = torch.exp(sampler.double() + delta.double()) - torch.exp(sampler.double())
        dropped = torch.where(adv > 0, probs_diff > 0.2, probs_diff < -0.2) & (adv != 0)
        near_edge = ((probs_diff.abs() - 0.2).abs() < 1e-5) & valid
        want = torch.where(valid, (~dropped).float(), torch.zeros(()))
        got = token_weights(delta, adv, mask, config, sampler_logps=sampler)
        keep = valid & ~near_edge
        assert torch.equal(got[keep], want[keep])
        assert 0 < int((got[keep] == 0).sum()) < int(keep.sum())  # the batch exercises the mask


def test_soft_in_probability_space_is_one_at_the_band_edge_and_decays_in_nats():
    """``soft`` measures |δ| beyond the token's own edge δ_τ = log(1 + sign(δ)·τ/p_s)."""
    tau, p, rate = 0.2, 0.5, 1.5
    config = TriageConfig(
        tau=tau, tau_space="prob", amplify_down="soft", amplify_up="soft", correct_up="keep", soft_rate=rate
    )
    s = torch.tensor([[math.log(p)]])

    def weight(delta: float, adv: float) -> float:
        d = torch.tensor([[delta]])
        return float(token_weights(d, torch.tensor([adv]), torch.ones(1, 1), config, sampler_logps=s)[0, 0])

    low_edge, high_edge = math.log(1 - tau / p), math.log(1 + tau / p)  # Δp = −τ, +τ
    assert weight(low_edge - 1e-4, -1.0) == pytest.approx(1.0, abs=1e-3)
    assert weight(high_edge + 1e-4, 1.0) == pytest.approx(1.0, abs=1e-3)
    assert weight(low_edge - 1.0, -1.0) == pytest.approx(math.exp(-rate * 1.0), rel=1e-5)
    assert weight(high_edge + 0.5, 1.0) == pytest.approx(math.exp(-rate * 0.5), rel=1e-5)
    # the correct-up token at the same gap keeps its full weight (policy keep)
    assert weight(low_edge - 1.0, 1.0) == 1.0


def test_soft_in_probability_space_is_finite_for_extreme_inputs():
    config = TriageConfig(
        tau_space="prob",
        tau=0.0,
        consistent="soft",
        amplify_down="soft",
        amplify_up="soft",
        correct_up="soft",
    )
    delta = torch.tensor([[-200.0, 200.0, 0.0, -1e-6, 999.0]])
    sampler = torch.tensor([[-1e-6, -900.0, -120.0, -0.5, -999.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0]])
    w = token_weights(delta, adv, torch.ones(1, 5), config, sampler_logps=sampler)
    assert torch.isfinite(w).all() and (w >= 0).all() and (w <= 1).all()


def test_metrics_use_probability_classes_and_report_mean_abs_dprob():
    config = TriageConfig(**PRIME_RL)
    delta, adv, mask, sampler = _batch(3)
    w = token_weights(delta, adv, mask, config, sampler_logps=sampler)
    m = mismatch_metrics(delta, adv, mask, w, config, sampler_logps=sampler)
    classes = classify_tokens(delta, adv, mask, config, sampler_logps=sampler)
    n = mask.sum().item()
    for cls in (C.CONSISTENT, C.AMPLIFY_DOWN, C.CORRECT_UP, C.AMPLIFY_UP, C.CORRECT_DOWN, C.INERT):
        assert m[f"triage/{cls.label}/share"] == pytest.approx((classes == int(cls)).sum().item() / n)
    assert m["triage/amplify_down/share"] > 0 and m["triage/amplify_down/mean_weight"] == 0.0
    valid = mask.bool()
    dprob = (torch.exp(sampler.double() + delta.double()) - torch.exp(sampler.double()))[valid]
    assert m["triage/mean_abs_dprob"] == pytest.approx(dprob.abs().mean().item(), rel=1e-6)
    assert m["triage/tau"] == 0.2


APIS = {
    "classify_tokens": lambda d, a, m, c, **kw: classify_tokens(d, a, m, c, **kw),
    "token_weights": lambda d, a, m, c, **kw: token_weights(d, a, m, c, **kw),
    "guarded_sequences": lambda d, a, m, c, **kw: guarded_sequences(d, a, m, c, **kw),
    "mismatch_sums": lambda d, a, m, c, **kw: mismatch_sums(d, a, m, torch.ones_like(d), c, **kw),
    "mismatch_metrics": lambda d, a, m, c, **kw: mismatch_metrics(d, a, m, torch.ones_like(d), c, **kw),
}


@pytest.mark.parametrize("api", sorted(APIS))
def test_probability_space_without_sampler_logps_names_the_argument(api):
    delta, adv, mask = torch.zeros(2, 3), torch.tensor([1.0, -1.0]), torch.ones(2, 3)
    with pytest.raises(ValueError, match="sampler_logps is required with tau_space='prob'"):
        APIS[api](delta, adv, mask, TriageConfig(**PRIME_RL))


@pytest.mark.parametrize("api", sorted(APIS))
@pytest.mark.parametrize(
    ("bad", "fragment"),
    [
        (float("nan"), "sampler_logps is nan at row 1, position 2"),
        (float("-inf"), "sampler_logps is -inf at row 1, position 2"),
        (0.5, "sampler_logps is 0.5 > 0 at row 1, position 2: not a log-probability"),
        (-9999.0, "sampler_logps is -9999 at row 1, position 2: an engine's sentinel"),
    ],
)
def test_invalid_sampler_logps_are_refused_naming_the_tensor(api, bad, fragment):
    delta, adv, mask = torch.zeros(2, 3), torch.tensor([1.0, -1.0]), torch.ones(2, 3)
    mask[0, 1] = 0
    sampler = torch.full((2, 3), -1.0)
    sampler[0, 1] = float("nan")  # padding may hold anything
    config = TriageConfig(**PRIME_RL)
    APIS[api](delta, adv, mask, config, sampler_logps=sampler)
    sampler[1, 2] = bad
    with pytest.raises(ValueError, match=fragment):
        APIS[api](delta, adv, mask, config, sampler_logps=sampler)
    with pytest.raises(ValueError, match=fragment):  # validated in log space too when given
        APIS[api](delta, adv, mask, TriageConfig(), sampler_logps=sampler)


@pytest.mark.parametrize("api", sorted(APIS))
def test_sampler_logps_of_another_shape_names_both_shapes(api):
    delta, adv, mask = torch.zeros(2, 3), torch.tensor([1.0, -1.0]), torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"sampler_logps has shape \(2, 4\), delta has \(2, 3\)"):
        APIS[api](delta, adv, mask, TriageConfig(**PRIME_RL), sampler_logps=torch.zeros(2, 4))


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"tau_space": "linear"}, r"tau_space='linear': expected one of \('log', 'prob'\)"),
        ({"tau_space": "prob", "tau": 1.5}, r"tau=1.5: expected ≤ 1.0 \(a probability difference\)"),
        ({"tau_space": "prob", "tau": -0.1}, "tau=-0.1"),
        ({"tau_space": "prob", "tau": "auto"}, "tau='auto' with tau_space='prob'"),
        ({"tau": 1.5}, r"tau=1.5: expected ≤ 1.0 \(nats"),
    ],
)
def test_bad_probability_space_config_names_the_field(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        TriageConfig(**kwargs)


def test_probability_space_accepts_its_whole_range_and_refuses_an_explicit_tau_above_one():
    for tau in (0.0, 0.2, 1.0):
        assert TriageConfig(tau_space="prob", tau=tau).tau == tau
    config = TriageConfig(**PRIME_RL)
    delta, adv, mask = torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2)
    sampler = torch.full((1, 2), -0.1)
    with pytest.raises(ValueError, match="tau=1.5 with tau_space='prob'"):
        token_weights(delta, adv, mask, config, tau=1.5, sampler_logps=sampler)
    assert dataclasses.replace(config, tau_space="log").tau_space == "log"


def test_grad_share_weighs_each_class_by_how_unlikely_the_learner_finds_its_tokens():
    """grad_share = Σ_class |w·A|·(1 − p_l) / Σ |w·A|·(1 − p_l), p_l = p_s·e^δ: by hand; a token the learner
    is sure of adds nothing; shares sum to 1; NaN at padding (sampler and δ) never leaks; sums all-reduce."""
    delta = torch.tensor([[-0.5, 0.0, 0.3, 9.0], [0.2, -0.1, 0.0, 0.0]])
    sampler = torch.log(torch.tensor([[0.2, 1.0, 0.5, 0.3], [0.4, 0.9, 0.6, 0.5]]))
    adv = torch.tensor([-1.0, 2.0])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    sampler[0, 3] = float("nan")  # padding may hold anything
    delta = torch.where(mask.bool(), delta, torch.full_like(delta, float("nan")))
    config = TriageConfig()
    w = token_weights(delta, adv, mask, config)
    m = mismatch_metrics(delta, adv, mask, w, config, sampler_logps=sampler)
    classes = classify_tokens(delta, adv, mask, config)
    valid = mask.bool()
    p_l = torch.exp(sampler.double() + torch.where(valid, delta, torch.zeros_like(delta)).double()).clamp(
        max=1
    )
    grad = torch.where(
        valid, (w.double() * adv[:, None].double()).abs() * (1 - p_l), torch.zeros(()).double()
    )
    total = grad.sum()
    for c in (c for c in TokenClass if c != TokenClass.PAD):
        expected = float(grad[classes == int(c)].sum() / total)
        assert m[f"triage/{c.label}/grad_share"] == pytest.approx(expected, rel=1e-12), c.label
    assert sum(m[f"triage/{c.label}/grad_share"] for c in TokenClass if c != TokenClass.PAD) == pytest.approx(
        1.0
    )
    sure = mismatch_sums(  # p_s = 1, δ = 0: the learner is sure of the token, no gradient to speak of
        torch.zeros(1, 1),
        torch.tensor([2.0]),
        torch.ones(1, 1),
        torch.ones(1, 1),
        config,
        sampler_logps=torch.zeros(1, 1),
    )
    assert float(sure["grad_mass"]) == 0.0 and float(sure["mass"]) == 2.0
    parts = [
        mismatch_sums(
            delta[i : i + 1],
            adv[i : i + 1],
            mask[i : i + 1],
            w[i : i + 1],
            config,
            sampler_logps=sampler[i : i + 1],
        )
        for i in (0, 1)
    ]
    whole = mismatch_sums(delta, adv, mask, w, config, sampler_logps=sampler)
    for key in ("grad_mass", "amplify_down/grad_mass", "correct_down/grad_mass"):
        assert float(parts[0][key] + parts[1][key]) == pytest.approx(float(whole[key]), rel=1e-12), key
