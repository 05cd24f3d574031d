"""Semantics of classes and weights, pinned with property-based tests (hypothesis, derandomized)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from triage import TokenClass, TriageConfig, classify_tokens, token_weights
from triage.config import PROFILES
from triage.weights import guarded_sequences

settings.register_profile("triage", derandomize=True, max_examples=60, deadline=None)
settings.load_profile("triage")

deltas = st.floats(min_value=-12.0, max_value=12.0, allow_nan=False, width=32)
taus = st.floats(min_value=0.0, max_value=1.0, width=32)
nonzero_adv = st.floats(min_value=0.01, max_value=5.0) | st.floats(min_value=-5.0, max_value=-0.01)


def one(delta, adv, config, tau=None):
    """Weight of a one-token response (guard off unless the config sets it)."""
    return float(
        token_weights(torch.tensor([[delta]]), torch.tensor([adv]), torch.ones(1, 1), config, tau=tau)[0, 0]
    )


def no_guard(**kw):
    return TriageConfig(guard_kappa=None, **kw)


@given(d=deltas, a=nonzero_adv, tau=taus)
def test_classes_follow_sign_delta_times_sign_advantage(d, a, tau):
    c = int(
        classify_tokens(torch.tensor([[d]]), torch.tensor([a]), torch.ones(1, 1), TriageConfig(), tau=tau)[
            0, 0
        ]
    )
    if abs(d) <= tau:
        assert c == TokenClass.CONSISTENT
    elif d < 0:
        assert c == (TokenClass.AMPLIFY_DOWN if a < 0 else TokenClass.CORRECT_UP)
    else:
        assert c == (TokenClass.AMPLIFY_UP if a > 0 else TokenClass.CORRECT_DOWN)


def test_inert_and_pad_win():
    delta = torch.tensor([[-3.0, 3.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    codes = classify_tokens(delta, torch.tensor([0.0]), mask)
    assert codes.tolist() == [[TokenClass.INERT, TokenClass.INERT, TokenClass.PAD]]
    assert codes.dtype == torch.int8
    per_token_adv = torch.tensor([[1.0, 0.0, -1.0]])
    assert classify_tokens(delta, per_token_adv, torch.ones(1, 3)).tolist() == [
        [TokenClass.CORRECT_UP, TokenClass.INERT, TokenClass.CONSISTENT]
    ]


@given(tau=taus, a=nonzero_adv, rate=st.floats(0.0, 10.0))
def test_soft_is_continuous_at_tau_and_at_most_one(tau, a, rate):
    cfg = no_guard(
        soft_rate=rate,
        amplify_down="soft",
        amplify_up="soft",
        correct_up="soft",
        correct_down="soft",
        consistent="keep",
        tail_floor=None,
    )
    for sign in (-1.0, 1.0):
        inside = one(sign * tau, a, cfg, tau)
        just_out = one(sign * (tau + 1e-6), a, cfg, tau)
        assert inside == 1.0
        assert 0.0 <= just_out <= 1.0
        assert abs(just_out - inside) < 1e-4
        far = one(sign * (tau + 3.0), a, cfg, tau)
        assert far <= 1.0 and math.isclose(far, math.exp(-rate * 3.0), rel_tol=1e-5, abs_tol=1e-30)


@given(
    d1=deltas,
    d2=deltas,
    policy=st.sampled_from(["keep", "is", "soft", "mask"]),
    floor=st.none() | st.floats(0.0, 10.0),
)
def test_amplify_down_weight_never_increases_as_delta_falls(d1, d2, policy, floor):
    cfg = no_guard(amplify_down=policy, tail_floor=floor)
    lo, hi = sorted((d1, d2))
    tau = cfg.fixed_tau()
    if hi >= -tau:
        hi = -tau - 1e-3
        lo = min(lo, hi)
    assert one(lo, -1.0, cfg) <= one(hi, -1.0, cfg) + 1e-7


@pytest.mark.parametrize("profile", sorted(PROFILES))
@given(mag=st.floats(0.0, 12.0), a=st.floats(0.01, 5.0))
def test_correct_up_never_weighs_less_than_amplify_down_at_equal_gap(profile, mag, a):
    """Equal where both classes share a policy (symmetric-is: e^δ; keep-down: 1); strictly more past the band
    where only amplify-down is cut (suppress-down)."""
    cfg = TriageConfig.profile(profile)
    up, down = one(-mag, a, cfg), one(-mag, -a, cfg)
    assert up >= down
    if profile in ("symmetric-is", "keep-down"):
        assert up == down
    elif mag > 1.0:  # well past τ = 0.05
        assert up > down


@given(d=deltas, a=nonzero_adv, cap=st.floats(1.0, 10.0))
def test_is_and_mask_policies(d, a, cap):
    cfg = no_guard(
        consistent="is",
        amplify_down="is",
        correct_up="is",
        amplify_up="is",
        correct_down="is",
        is_cap=cap,
        tail_floor=None,
    )
    assert math.isclose(one(d, a, cfg), min(math.exp(d), cap), rel_tol=1e-6)
    masked = no_guard(
        consistent="mask", amplify_down="mask", correct_up="mask", amplify_up="mask", correct_down="mask"
    )
    assert one(d, a, masked) == 0.0


def test_tail_floor_zeroes_deep_negative_tail_only_when_pushed_down():
    cfg = no_guard(tail_floor=2.0, correct_up="keep")
    assert one(-2.5, -1.0, cfg) == 0.0
    assert one(-2.5, 1.0, cfg) == 1.0  # correct-up keeps: the floor is for A < 0 only
    assert one(-1.5, -1.0, cfg) > 0.0


@given(d=deltas, a=st.floats(-5, 5))
def test_none_is_one_on_every_valid_token(d, a):
    w = token_weights(
        torch.tensor([[d, d]]), torch.tensor([a]), torch.tensor([[1, 0]]), TriageConfig(correction="none")
    )
    assert w.tolist() == [[1.0, 0.0]]


@given(d=deltas, a=nonzero_adv)
def test_tis_and_icepop(d, a):
    r = math.exp(d)
    assert math.isclose(one(d, a, TriageConfig(correction="tis")), min(r, 2.0), rel_tol=1e-6)
    ice = one(d, a, TriageConfig(correction="icepop"))
    expected = r if 0.5 <= r <= 5.0 else 0.0
    assert math.isclose(ice, expected, rel_tol=1e-5, abs_tol=1e-6) or (
        abs(math.log(0.5) - d) < 1e-6 or abs(math.log(5.0) - d) < 1e-6
    )


def test_sequence_modes_broadcast_and_use_sampler_gap():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    delta = torch.tensor([[-0.4, -0.4, -0.4, 9.0], [0.0, 0.1, 0.0, -0.1], [-11.0, 0.0, 0.0, 0.0]])
    adv = torch.tensor([-1.0, -1.0, 1.0])
    # OPSM: A<0 and mean δ < −thr → dropped; the A>0 row is never dropped.
    w = token_weights(delta, adv, mask, TriageConfig(correction="opsm", opsm_threshold=0.3))
    assert w.tolist() == [[0, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]]
    # veto: any ratio < 1e-4 (δ < −9.21) drops the whole response, whatever A.
    w = token_weights(delta, adv, mask, TriageConfig(correction="veto"))
    assert w.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
    # seq-mis (product): ρ = exp(Σ δ); row 0 ρ = e^-1.2 = 0.30 < 0.5 → 0; row 1 ρ = 1 → 1.
    w = token_weights(delta, adv, mask, TriageConfig(correction="seq-mis"))
    assert w[0].tolist() == [0, 0, 0, 0] and w[1].tolist() == [1, 1, 1, 1]
    w = token_weights(delta, adv, mask, TriageConfig(correction="seq-mis", seq_mis_level="geometric"))
    assert torch.allclose(w[0, :3], torch.full((3,), math.exp(-0.4)))


def test_sequence_guard_scales_long_negative_tails():
    cfg = TriageConfig(guard_kappa=0.1, tail_floor=None)
    delta = torch.tensor([[-0.5, -0.5, 0.0, 0.0], [-0.5, 0.0, 0.0, 0.0], [-0.5, -0.5, 0.0, 0.0]])
    adv = torch.tensor([-1.0, -1.0, 1.0])
    mask = torch.ones(3, 4)
    guarded = guarded_sequences(delta, adv, mask, cfg)
    assert guarded.tolist() == [True, True, False]  # masses 0.25 and 0.125 > 0.1; A>0 never guarded
    w = token_weights(delta, adv, mask, cfg)
    unguarded = token_weights(delta, adv, mask, TriageConfig(guard_kappa=None, tail_floor=None))
    torch.testing.assert_close(w[0], unguarded[0] * (0.1 / 0.25))
    torch.testing.assert_close(w[1], unguarded[1] * (0.1 / 0.125))
    torch.testing.assert_close(w[2], unguarded[2])


@pytest.mark.parametrize("correction", ["none", "tis", "icepop", "seq-mis", "opsm", "veto", "triage"])
def test_every_mode_detached_fp32_zero_at_padding(correction):
    torch.manual_seed(0)
    delta = (torch.randn(5, 7) * 0.5).to(torch.bfloat16).requires_grad_()
    mask = torch.ones(5, 7)
    mask[:, 5:] = 0
    mask[4] = 0
    w = token_weights(delta, torch.randn(5), mask, TriageConfig(correction=correction))
    assert w.dtype == torch.float32 and not w.requires_grad
    assert (w[mask == 0] == 0).all() and torch.isfinite(w).all()


def test_nan_advantage_is_an_error():
    with pytest.raises(ValueError, match="advantages is nan at row 1"):
        token_weights(torch.zeros(2, 2), torch.tensor([0.0, float("nan")]), torch.ones(2, 2))
    with pytest.raises(ValueError, match="advantages has shape"):
        token_weights(torch.zeros(2, 2), torch.zeros(3), torch.ones(2, 2))


def test_huge_gaps_stay_finite():
    delta = torch.tensor([[200.0, -200.0]])
    for correction in ["tis", "icepop", "seq-mis", "triage"]:
        w = token_weights(delta, torch.tensor([1.0]), torch.ones(1, 2), TriageConfig(correction=correction))
        assert torch.isfinite(w).all(), correction
