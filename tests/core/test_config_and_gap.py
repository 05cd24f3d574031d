"""TriageConfig validation and δ = token_gap(...) input checks."""

import dataclasses
import math

import pytest
import torch

from triage import TriageConfig, token_gap, token_weights


def test_defaults_are_the_symmetric_is_profile():
    c = TriageConfig()
    assert c.correction == "triage"
    assert (c.consistent, c.correct_up, c.correct_down, c.amplify_up, c.amplify_down) == ("is",) * 5
    assert c.tail_floor is None and c.guard_kappa is None  # nothing removes the δ < 0, A < 0 updates
    assert c.is_cap == 2.0 and c.veto_floor == 1e-4 and (c.icepop_low, c.icepop_high) == (0.5, 5.0)
    assert TriageConfig.profile("symmetric-is") == c


def test_default_weights_are_token_tis_for_both_advantage_signs():
    """The default weighs every token as TIS does, min(e^δ, C), whatever its class: the δ < 0 tokens of
    both advantage signs are scaled alike (docs/triage.md, "Defaults")."""
    g = torch.Generator().manual_seed(0)
    delta = torch.randn(8, 40, generator=g) * 2.0  # far past τ and past log C both ways
    adv = torch.randn(8, 1, generator=g).sign().expand(8, 40).clone()
    adv[0] = 0.0  # an inert response: TIS still weights it, TRIAGE gives 1; A = 0 carries no gradient
    mask = torch.ones(8, 40)
    mask[3, 30:] = 0
    tis = token_weights(delta, adv, mask, TriageConfig(correction="tis"))
    ours = token_weights(delta, adv, mask, TriageConfig())
    assert torch.equal(ours[1:], tis[1:])
    assert torch.equal(ours[0], torch.ones(40))
    below = (delta < -0.05) & (mask > 0)
    up, down = below & (adv > 0), below & (adv < 0)
    assert up.any() and down.any() and (ours[up] < 1).all() and (ours[down] < 1).all()


def test_earlier_defaults_by_name():
    keep = TriageConfig.profile("keep-down")
    assert (keep.amplify_down, keep.correct_up, keep.amplify_up) == ("keep", "keep", "soft")
    assert (keep.consistent, keep.correct_down, keep.tail_floor, keep.guard_kappa) == ("is", "is", None, None)
    old = TriageConfig.profile("suppress-down")
    assert (old.amplify_down, old.tail_floor, old.guard_kappa) == ("soft", 3.0, 0.1)
    assert dataclasses.replace(old, amplify_down="keep", tail_floor=None, guard_kappa=None) == keep
    assert TriageConfig.profile("suppress-down", tau=0.1).tau == 0.1  # overrides on top
    with pytest.raises(ValueError, match="unknown profile 'v0'.*symmetric-is"):
        TriageConfig.profile("v0")


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"correction": "tis2"}, "correction"),
        ({"tau": -0.1}, "tau"),
        ({"tau": "sometimes"}, "tau"),
        ({"tau": float("nan")}, "tau"),
        ({"amplify_down": "drop"}, "amplify_down"),
        ({"is_cap": 0.0}, "is_cap"),
        ({"icepop_low": 5.0, "icepop_high": 0.5}, "icepop_low"),
        ({"seq_mis_level": "mean"}, "seq_mis_level"),
        ({"tau_ema": 1.0}, "tau_ema"),
        ({"guard_kappa": 0.0}, "guard_kappa"),
        ({"soft_rate": True}, "soft_rate"),
        # values that would invert a field's meaning
        ({"is_cap": 0.5}, "is_cap"),  # would cut on-policy tokens (r = 1) to 0.5
        ({"veto_floor": 1.0}, "veto_floor"),  # would drop every response with a token below the sampler
        ({"tau_floor": 50.0}, "tau_floor"),  # τ ≥ 50 nats: every token "consistent"
        ({"tau_init": 2.0}, "tau_init"),
        ({"tau": 3.0}, "tau"),
        ({"icepop_low": 1.5, "icepop_high": 5.0}, "icepop_low"),  # band without r = 1
        ({"seq_mis_low": 0.1, "seq_mis_high": 0.9}, "seq_mis_low"),
    ],
)
def test_bad_config_names_the_field(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        TriageConfig(**kwargs)


def test_config_is_frozen():
    c = TriageConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.is_cap = -3.0
    assert c.is_cap == 2.0
    assert dataclasses.replace(c, is_cap=3.0).is_cap == 3.0  # the way to change a field: validated again
    with pytest.raises(ValueError, match="is_cap"):
        dataclasses.replace(c, is_cap=-3.0)


def test_tau_strings():
    assert TriageConfig(tau="0.2").tau == 0.2
    assert TriageConfig(tau="auto").adaptive
    assert TriageConfig(tau="auto").fixed_tau() == TriageConfig().tau_init


def test_from_dict_ignores_foreign_keys():
    c = TriageConfig.from_dict({"correction": "tis", "learning_rate": 1e-6, "is_cap": 3})
    assert c.correction == "tis" and c.is_cap == 3


def test_gap_is_difference_in_fp32_and_zero_at_padding():
    learner = torch.tensor([[-1.0, -2.0, float("nan")]], dtype=torch.bfloat16)
    sampler = torch.tensor([[-1.5, -1.0, 0.7]], dtype=torch.float16)  # padding may hold anything
    mask = torch.tensor([[1, 1, 0]])
    delta = token_gap(learner, sampler, mask)
    assert delta.dtype == torch.float32
    assert delta.tolist() == [[0.5, -1.0, 0.0]]


def test_gap_shape_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(2, 4\)"):
        token_gap(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="mask"):
        token_gap(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 4))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("which", ["learner_logps", "sampler_logps"])
def test_gap_rejects_non_finite_at_valid_positions(bad, which):
    learner = -torch.ones(3, 5)
    sampler = -torch.ones(3, 5)
    target = learner if which == "learner_logps" else sampler
    target[2, 3] = bad
    with pytest.raises(ValueError, match=rf"{which} is .* at row 2, position 3"):
        token_gap(learner, sampler, torch.ones(3, 5))


def test_gap_explains_engine_minus_inf():
    sampler = -torch.ones(1, 2)
    sampler[0, 1] = -math.inf
    with pytest.raises(ValueError, match="engine returned -inf"):
        token_gap(-torch.ones(1, 2), sampler, torch.ones(1, 2))


def test_gap_rejects_positive_sampler_logprob_but_allows_rounding():
    sampler = -torch.ones(2, 2)
    sampler[1, 0] = 5e-5  # log 1 with rounding: fine
    token_gap(-torch.ones(2, 2), sampler, torch.ones(2, 2))
    sampler[1, 1] = 0.3
    with pytest.raises(ValueError, match="row 1, position 1.*not a log-probability"):
        token_gap(-torch.ones(2, 2), sampler, torch.ones(2, 2))


@pytest.mark.parametrize("sentinel", [-9999.0, torch.finfo(torch.float32).min, -1e3])
def test_gap_rejects_engine_sentinels_for_minus_inf(sentinel):
    """vLLM writes -9999 for -inf, other engines finfo.min: δ would be 1e4..3e38 and take the IS cap."""
    sampler = -torch.ones(3, 4)
    sampler[2, 1] = sentinel
    sampler[0, 3] = sentinel  # padding: ignored
    mask = torch.ones(3, 4)
    mask[0, 3] = 0
    with pytest.raises(ValueError, match=r"sampler_logps is .* at row 2, position 1: an engine's sentinel"):
        token_gap(-torch.ones(3, 4), sampler, mask)
    sampler[2, 1] = -999.0  # just above the threshold: a (very unlikely) real log-prob
    assert token_gap(-torch.ones(3, 4), sampler, mask)[2, 1] == pytest.approx(998.0)


def test_gap_sentinel_rule_is_for_the_sampler_only():
    learner = -torch.ones(1, 2)
    learner[0, 1] = -5000.0  # a learner that disagrees catastrophically is data (δ = -4999), not a sentinel
    assert token_gap(learner, -torch.ones(1, 2), torch.ones(1, 2))[0, 1] == -4999.0
