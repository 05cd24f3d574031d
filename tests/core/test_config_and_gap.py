"""TriageConfig validation and δ = token_gap(...) input checks."""

import math

import pytest
import torch

from triage import TriageConfig, token_gap


def test_defaults_follow_design():
    c = TriageConfig()
    assert c.correction == "triage"
    assert (c.consistent, c.correct_up, c.correct_down, c.amplify_up, c.amplify_down) == (
        "is",
        "keep",
        "is",
        "soft",
        "soft",
    )
    assert c.is_cap == 2.0 and c.veto_floor == 1e-4 and (c.icepop_low, c.icepop_high) == (0.5, 5.0)
    assert c.tail_floor is not None


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
    ],
)
def test_bad_config_names_the_field(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        TriageConfig(**kwargs)


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
