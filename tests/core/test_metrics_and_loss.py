"""mismatch_metrics (sums → ratios, all-reduce exactness, quantiles), AdaptiveTau, loss edge cases."""

import math

import numpy as np
import pytest
import torch

from triage import (
    AdaptiveTau,
    TokenClass,
    TriageConfig,
    classify_tokens,
    delta_quantiles,
    metrics_from_sums,
    mismatch_metrics,
    mismatch_sums,
    policy_loss,
    token_weights,
)
from triage.metrics import STAT_CLASSES


def _batch(seed=0, B=8, T=16):
    g = torch.Generator().manual_seed(seed)
    delta = torch.randn(B, T, generator=g) * 0.3
    adv = torch.randn(B, generator=g)
    adv[0] = 0.0
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    return delta * mask, adv, mask


def test_metric_definitions_by_hand():
    delta = torch.tensor([[-0.5, 0.5, 0.01, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    adv = torch.tensor([-2.0])
    cfg = TriageConfig(amplify_down="soft")
    w = token_weights(delta, adv, mask, cfg)
    m = mismatch_metrics(delta, adv, mask, w, cfg)
    assert m["triage/tokens"] == 3
    assert m["triage/amplify_down/share"] == pytest.approx(1 / 3)
    assert m["triage/correct_down/share"] == pytest.approx(1 / 3)
    assert m["triage/consistent/share"] == pytest.approx(1 / 3)
    assert m["triage/amplify_down/mean_delta"] == pytest.approx(-0.5)
    assert m["triage/amplify_down/mean_weight"] == pytest.approx(math.exp(-(0.5 - 0.05)))
    assert m["triage/mean_abs_delta"] == pytest.approx(1.01 / 3)
    total_mass = 2 * float(w.sum())
    assert m["triage/correct_down/mass_share"] == pytest.approx(2 * float(w[0, 1]) / total_mass)
    k3 = sum(math.exp(d) - 1 - d for d in (-0.5, 0.5, 0.01)) / 3
    assert m["triage/kl_k3"] == pytest.approx(k3)
    # amplify_down (0.64) and consistent (e^0.01 > 1? no: 1.01 ≥ 1) → only the tail is suppressed.
    assert m["triage/suppressed_frac"] == pytest.approx(1 / 3)
    assert m["triage/tau"] == 0.05


def test_class_shares_sum_to_one_and_mass_shares_too():
    delta, adv, mask = _batch(1)
    w = token_weights(delta, adv, mask)
    m = mismatch_metrics(delta, adv, mask, w)
    assert sum(m[f"triage/{c.label}/share"] for c in STAT_CLASSES) == pytest.approx(1.0)
    assert sum(m[f"triage/{c.label}/mass_share"] for c in STAT_CLASSES) == pytest.approx(1.0)
    assert m["triage/inert/mass_share"] == 0.0


def test_sums_all_reduce_to_the_global_metrics():
    """Splitting a batch over 'processes' and summing their sums gives the metrics of the whole batch."""
    delta, adv, mask = _batch(2)
    cfg = TriageConfig()
    w = token_weights(delta, adv, mask, cfg)
    whole = metrics_from_sums(mismatch_sums(delta, adv, mask, w, cfg))
    parts = [mismatch_sums(delta[s], adv[s], mask[s], w[s], cfg) for s in (slice(0, 3), slice(3, 8))]
    reduced = {k: parts[0][k] + parts[1][k] for k in parts[0]}
    merged = metrics_from_sums(reduced)
    assert merged.keys() == whole.keys()
    for key in whole:
        assert merged[key] == pytest.approx(whole[key], rel=1e-12, abs=1e-12), key
    assert all(v.dtype == torch.float64 and v.dim() == 0 for v in parts[0].values())


def test_quantiles_match_numpy():
    delta, _, mask = _batch(3)
    got = delta_quantiles(delta, mask)
    values = delta[mask.bool()].numpy()
    for name, q in {"p0.1": 0.001, "p1": 0.01, "p50": 0.5, "p99": 0.99, "p99.9": 0.999}.items():
        assert got[f"triage/delta_{name}"] == pytest.approx(float(np.quantile(values, q)), rel=1e-5, abs=1e-6)


def test_sequence_mean_delta_quantiles_match_numpy_and_ignore_padding():
    """The per-response mean δ (what OPSM thresholds): padding — even NaN there — and empty responses left out."""
    delta, _, mask = _batch(4)
    delta = torch.where(mask.bool(), delta, torch.full_like(delta, float("nan")))
    mask[1] = 0  # a response with no valid token
    got = delta_quantiles(delta, mask)
    rows = [delta[i][mask[i].bool()].numpy() for i in range(delta.shape[0]) if mask[i].any()]
    means = np.array([r.mean() for r in rows])
    for name, q in {"p0.1": 0.001, "p1": 0.01, "p50": 0.5, "p99": 0.99, "p99.9": 0.999}.items():
        want = float(np.quantile(means, q))
        assert got[f"triage/seq_mean_delta_{name}"] == pytest.approx(want, rel=1e-5, abs=1e-6), name
    empty = delta_quantiles(torch.zeros(2, 3), torch.zeros(2, 3))
    assert empty["triage/seq_mean_delta_p50"] == 0.0 and empty["triage/delta_p50"] == 0.0


def test_no_valid_token_gives_zero_loss_and_defined_metrics():
    delta = torch.zeros(3, 4)
    mask = torch.zeros(3, 4)
    adv = torch.tensor([1.0, -1.0, 0.0])
    w = token_weights(delta, adv, mask)
    m = mismatch_metrics(delta, adv, mask, w)
    assert all(math.isfinite(v) for v in m.values())
    logps = torch.full((3, 4), float("nan"), requires_grad=True)  # padding may be garbage
    for loss_type in ["grpo", "bnpo", "dr_grpo", "dapo", "cispo"]:
        loss = policy_loss(
            logps, torch.zeros(3, 4), adv, mask, w, loss_type=loss_type, max_completion_length=4
        )
        assert loss.item() == 0.0
        loss.backward()
        assert torch.isfinite(logps.grad).all()
        logps.grad = None


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo"])
def test_empty_batch_gives_zero_loss(loss_type):
    logps = torch.zeros(0, 4, requires_grad=True)
    loss = policy_loss(
        logps,
        torch.zeros(0, 4),
        torch.zeros(0),
        torch.zeros(0, 4),
        loss_type=loss_type,
        max_completion_length=4,
    )
    assert loss.item() == 0.0
    loss.backward()


def test_masked_tokens_stay_in_the_normaliser():
    torch.manual_seed(0)
    logps = -torch.rand(2, 4)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 4)
    weights = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    per_token = -adv[:, None] * torch.ones(2, 4)  # r = 1 at logps == old
    bnpo = policy_loss(logps, logps, adv, mask, weights, loss_type="bnpo")
    assert bnpo.item() == pytest.approx(float((per_token * weights).sum() / 8))  # not / 4
    grpo = policy_loss(logps, logps, adv, mask, weights, loss_type="grpo")
    assert grpo.item() == pytest.approx(float(((per_token * weights).sum(-1) / 4).mean()))


def test_half_precision_logps_compute_in_fp32():
    torch.manual_seed(0)
    logps = (-torch.rand(3, 5)).to(torch.bfloat16).requires_grad_()
    old = logps.detach().float() + 0.01
    loss = policy_loss(logps, old, torch.randn(3), torch.ones(3, 5), loss_type="dapo")
    assert loss.dtype == torch.float32
    loss.backward()
    assert logps.grad.dtype == torch.bfloat16


def test_loss_rejects_bad_input():
    with pytest.raises(ValueError, match="loss_type"):
        policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1), torch.ones(1, 2), loss_type="ppo")
    with pytest.raises(ValueError, match=r"\(1, 2\).*\(1, 3\)"):
        policy_loss(torch.zeros(1, 2), torch.zeros(1, 3), torch.zeros(1), torch.ones(1, 2))
    bad = torch.zeros(1, 2)
    bad[0, 1] = float("nan")
    with pytest.raises(ValueError, match="logps is nan at row 0, position 1"):
        policy_loss(bad, torch.zeros(1, 2), torch.zeros(1), torch.ones(1, 2))
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([float("inf")]), torch.ones(1, 2))
    with pytest.raises(ValueError, match="dr_grpo' needs max_completion_length"):
        policy_loss(
            torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1), torch.ones(1, 2), loss_type="dr_grpo"
        )


@pytest.mark.parametrize(
    "weight, fragment",
    [
        (float("nan"), "weights is nan at row 1, position 0"),
        (-0.5, "weights is -0.5 at row 1, position 0"),
        (float("inf"), "weights is inf at row 1, position 0"),
    ],
)
def test_loss_rejects_nan_negative_or_infinite_weights(weight, fragment):
    logps, adv, mask = -torch.ones(2, 3), torch.tensor([1.0, -1.0]), torch.ones(2, 3)
    mask[0, 2] = 0
    weights = torch.ones(2, 3)
    weights[0, 2] = float("nan")  # padding may hold anything
    good = policy_loss(logps, logps, adv, mask, weights)
    assert torch.isfinite(good)
    weights[1, 0] = weight
    with pytest.raises(ValueError, match=fragment):
        policy_loss(logps, logps, adv, mask, weights)


@pytest.mark.parametrize("length", [0, -4, 2.5, True])
def test_loss_rejects_a_max_completion_length_below_one(length):
    with pytest.raises(ValueError, match="max_completion_length"):
        policy_loss(
            torch.zeros(1, 2),
            torch.zeros(1, 2),
            torch.ones(1),
            torch.ones(1, 2),
            loss_type="dr_grpo",
            max_completion_length=length,
        )
    one = policy_loss(
        torch.zeros(1, 2),
        torch.zeros(1, 2),
        torch.ones(1),
        torch.ones(1, 2),
        loss_type="dr_grpo",
        max_completion_length=np.int64(4),
    )
    assert one.item() == -0.5  # a numpy integer is an integer


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 9998.0, 3e38])
@pytest.mark.parametrize("api", ["classify_tokens", "token_weights", "mismatch_metrics", "adaptive"])
def test_delta_handed_directly_is_validated_like_token_gaps_output(api, bad):
    """δ = 9998 is what a −9999 sentinel makes of a sampler log-prob: refused as token_gap would."""
    delta, adv, mask = torch.zeros(2, 3), torch.tensor([1.0, -1.0]), torch.ones(2, 3)
    mask[0, 2] = 0
    delta[0, 2] = float("nan")  # padding may hold anything
    calls = {
        "classify_tokens": lambda d: classify_tokens(d, adv, mask),
        "token_weights": lambda d: token_weights(d, adv, mask),
        "mismatch_metrics": lambda d: mismatch_metrics(d, adv, mask, torch.ones(2, 3)),
        "adaptive": lambda d: AdaptiveTau(TriageConfig(tau="auto")).update(d, mask),
    }
    calls[api](delta)
    delta[1, 2] = bad
    with pytest.raises(ValueError, match="delta is .* at row 1, position 2"):
        calls[api](delta)


def test_metrics_reject_bad_weights():
    delta, adv, mask = torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2)
    with pytest.raises(ValueError, match="weights is nan at row 0, position 1"):
        mismatch_metrics(delta, adv, mask, torch.tensor([[1.0, float("nan")]]))


def test_an_infinite_tau_is_refused():
    with pytest.raises(ValueError, match="tau"):
        token_weights(torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1), tau=float("inf"))


@pytest.mark.parametrize(
    "state, fragment",
    [
        ({"scale": float("nan"), "steps": 3}, "'scale'=nan"),
        ({"scale": float("inf"), "steps": 3}, "'scale'=inf"),
        ({"scale": -0.1, "steps": 3}, "'scale'=-0.1"),
        ({"scale": 0.02, "steps": -1}, "'steps'=-1"),
        ({"scale": 0.02, "steps": 2.5}, "'steps'=2.5"),
        ({"scale": 0.02}, "no \\['steps'\\]"),
    ],
)
def test_adaptive_tau_refuses_a_corrupt_state(state, fragment):
    tracker = AdaptiveTau(TriageConfig(tau="auto"))
    before = tracker.state_dict()
    with pytest.raises(ValueError, match=fragment):
        tracker.load_state_dict(state)
    assert tracker.state_dict() == before


@pytest.mark.parametrize("median", [float("nan"), float("inf"), -1.0])
def test_adaptive_tau_refuses_a_non_finite_median(median):
    tracker = AdaptiveTau(TriageConfig(tau="auto"))
    with pytest.raises(ValueError, match="median"):
        tracker.update_from_median(median)
    assert tracker.steps == 0


def test_adaptive_tau_tracks_median_and_round_trips():
    cfg = TriageConfig.profile(
        "keep-down", tau="auto", tau_init=0.05, tau_multiplier=2.0, tau_ema=0.5, tau_floor=1e-3
    )
    tracker = AdaptiveTau(cfg)
    assert tracker.value == pytest.approx(0.05)
    delta = torch.tensor([[0.1, -0.1, 0.1, 5.0]])  # the tail (5.0) does not move the median
    mask = torch.ones(1, 4)
    tau = tracker.update(delta, mask)
    assert tau == pytest.approx(2.0 * (0.5 * 0.025 + 0.5 * 0.1))
    clone = AdaptiveTau(cfg)
    clone.load_state_dict(tracker.state_dict())
    assert clone.value == tracker.value and clone.steps == 1
    assert tracker.update(delta, torch.zeros(1, 4)) == tau  # empty step: unchanged
    for _ in range(200):
        tracker.update(torch.zeros(1, 4), mask)
    assert tracker.value == pytest.approx(1e-3)  # floored
    assert AdaptiveTau(TriageConfig(tau=0.2)).value == 0.2
    # The tracked τ drives the classes.
    w = token_weights(torch.tensor([[0.03]]), torch.tensor([1.0]), torch.ones(1, 1), cfg, tau=0.01)
    assert w.item() < 1.0  # amplify-up (soft) at τ = 0.01; consistent (w = e^δ > 1) at the config τ
    codes = TriageConfig(tau="auto")
    assert codes.fixed_tau() == 0.05
    assert int(TokenClass.AMPLIFY_DOWN) == 3


@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), -float("inf")])
def test_per_token_advantages_may_hold_anything_at_padding(garbage):
    """(B, T) advantages follow the padding rule of every other tensor: a non-finite value at a masked position
    is ignored (never refused, never leaked into the loss, weights or metrics through 0 · NaN); at a valid
    position it is still an error."""
    delta, adv, mask = _batch()
    logps = -torch.rand(*delta.shape, generator=torch.Generator().manual_seed(1))
    clean = adv[:, None].expand_as(delta).clone()
    dirty = torch.where(mask.bool(), clean, torch.full_like(clean, garbage))
    config = TriageConfig(guard_kappa=0.05)
    weights = token_weights(delta, clean, mask, config)
    assert torch.equal(token_weights(delta, dirty, mask, config), weights)
    assert torch.equal(
        classify_tokens(delta, dirty, mask, config), classify_tokens(delta, clean, mask, config)
    )
    assert mismatch_metrics(delta, dirty, mask, weights, config) == mismatch_metrics(
        delta, clean, mask, weights, config
    )
    for loss_type in ("grpo", "dapo"):
        expected = policy_loss(logps, logps.detach(), clean, mask, weights, loss_type=loss_type)
        got = policy_loss(logps, logps.detach(), dirty, mask, weights, loss_type=loss_type)
        assert torch.isfinite(got) and torch.equal(got, expected)
    dirty[1, 0] = garbage
    with pytest.raises(ValueError, match="advantages is .* at row 1 \\(position 0\\)"):
        policy_loss(logps, logps, dirty, mask)
    with pytest.raises(ValueError, match="advantages is .* at row 1 \\(position 0\\)"):
        token_weights(delta, dirty, mask)
