"""Bad sampler output gets an error naming the sample; documented rules for the legal edge cases."""

from __future__ import annotations

import math

import pytest
import torch
from trainer_testkit import PerturbedRollout, make_trainer


@pytest.fixture(scope="module")
def trainer(tiny_model_dir, tmp_path_factory):
    trainer = make_trainer(tiny_model_dir, tmp_path_factory.mktemp("inputs"))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def _rows(trainer, n_prompts=2):
    rows = [trainer.train_dataset[i] for i in range(n_prompts)]
    return [r for r in rows for _ in range(trainer.num_generations)]


def _set(index, position, value):
    def corrupt(out):
        out["logprobs"][index][position] = value

    return corrupt


BAD = {
    "nan": (_set(1, 0, float("nan")), r"sample 1 .*position 0.*NaN"),
    "none": (_set(1, 0, None), r"sample 1 .*None"),
    "+inf": (_set(2, 0, math.inf), r"sample 2 .*\+inf"),
    "-inf": (_set(2, 0, -math.inf), r"sample 2 .*-inf"),
    "positive": (_set(3, 0, 0.5), r"sample 3 .*must be <= 0"),
    "length mismatch": (lambda out: out["logprobs"][1].append(-1.0), r"sample 1 .*log-probs"),
    "empty completion": (
        lambda out: (out["completion_ids"].__setitem__(0, []), out["logprobs"].__setitem__(0, [])),
        r"sample 0 .*empty",
    ),
    "token outside vocab": (
        lambda out: out["completion_ids"][2].__setitem__(0, 10**6),
        r"sample 2 .*not in \[0",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_rollouts_name_the_sample(trainer, case):
    corrupt, pattern = BAD[case]
    trainer.rollout_func = trainer._validated(PerturbedRollout(corrupt=corrupt))
    with pytest.raises(ValueError, match=pattern):
        trainer._generate_and_score_completions(_rows(trainer))


def test_missing_logprobs_key_is_an_error(trainer):
    trainer.rollout_func = trainer._validated(PerturbedRollout(corrupt=lambda out: out.pop("logprobs")))
    with pytest.raises(ValueError, match="logprobs"):
        trainer._generate_and_score_completions(_rows(trainer))


def test_multi_turn_rollout_with_env_mask_trains(trainer):
    """TRL's multi-turn ``env_mask``: a turn may end with EOS before environment tokens, whose log-probs are
    placeholders (NaN here). Validation accepts it; TRL masks the environment tokens out of δ and the loss."""
    eos = trainer.processing_class.eos_token_id

    def two_turns(out):
        out["env_mask"] = []
        for i, c in enumerate(out["completion_ids"]):
            env = [5, eos, 6]  # tool output, its chat template's end-of-turn included
            out["completion_ids"][i] = [7, eos] + env + c
            out["logprobs"][i] = [-1.0, -0.5] + [math.nan] * 3 + out["logprobs"][i]
            out["env_mask"].append([1, 1, 0, 0, 0] + [1] * len(c))

    trainer.rollout_func = trainer._validated(PerturbedRollout(corrupt=two_turns))
    inputs = trainer._generate_and_score_completions(_rows(trainer))
    assert inputs["tool_mask"][:, 2:5].eq(0).all() and inputs["tool_mask"][:, :2].eq(1).all()
    loss = trainer.compute_loss(trainer.model, inputs)
    assert torch.isfinite(loss)


def test_nan_sampler_logprob_reaching_the_loss_is_named(trainer):
    """A batch built elsewhere (bypassing the rollout checks) still fails loudly, naming row and position."""
    trainer.rollout_func = trainer._validated(PerturbedRollout())
    inputs = trainer._generate_and_score_completions(_rows(trainer))
    inputs["sampling_per_token_logps"][1, 0] = float("nan")
    with pytest.raises(ValueError, match="row 1, position 0"):
        trainer.compute_loss(trainer.model, inputs)


def test_group_with_equal_rewards_is_inert(tiny_model_dir, tmp_path):
    """Rule: equal rewards in a group → advantage 0 → every token 'inert': no gradient, weight irrelevant."""
    trainer = make_trainer(
        tiny_model_dir, tmp_path, reward=lambda completions, **kw: [1.0] * len(completions)
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = trainer._generate_and_score_completions(_rows(trainer))
    assert torch.all(inputs["advantages"] == 0)
    trainer._metrics["train"].clear()
    loss = trainer.compute_loss(trainer.model, inputs)
    assert loss.item() == 0.0
    loss.backward()
    assert all(p.grad is None or torch.all(p.grad == 0) for p in trainer.model.parameters())
    assert trainer._metrics["train"]["triage/inert/share"][-1] == 1.0
    assert trainer._metrics["train"]["triage/suppressed_frac"][-1] == 0.0


def _rewarding(values):
    """A reward function returning ``values`` (by sample index) and ``-1.0``/``1.0`` elsewhere."""

    def scripted_reward(completions, **kwargs):
        return [values.get(i, float(i % 2)) for i in range(len(completions))]

    return scripted_reward


@pytest.mark.parametrize(
    "value, pattern",
    [
        (float("nan"), r"reward function 'scripted_reward' returned nan for sample 1 \(prompt 'What is 0"),
        (math.inf, r"reward function 'scripted_reward' returned inf for sample 1"),
        (-math.inf, r"reward function 'scripted_reward' returned -inf for sample 1"),
        (1e39, r"returned inf for sample 1"),  # a Python float beyond fp32: inf in TRL's tensor
        (3e19, r"returned 3.* for sample 1"),  # finite, but its group std overflows fp32
    ],
)
def test_a_reward_that_would_zero_its_groups_advantages_is_refused(trainer, value, pattern):
    trainer.rollout_func = trainer._validated(PerturbedRollout())
    funcs = trainer.reward_funcs
    trainer.reward_funcs = [_rewarding({1: value})]
    trainer.reward_func_names = ["scripted_reward"]
    try:
        with pytest.raises(ValueError, match=pattern):
            trainer._generate_and_score_completions(_rows(trainer))
    finally:
        trainer.reward_funcs, trainer.reward_func_names = funcs, ["length_reward"]


def test_none_reward_keeps_trls_missing_semantics(trainer):
    """None = the function does not score that sample (TRL's rule): no error, the sample gets advantage 0 and
    the rest of its group keeps its advantages."""
    trainer.rollout_func = trainer._validated(PerturbedRollout())
    funcs = trainer.reward_funcs
    trainer.reward_funcs = [_rewarding({1: None, 2: 5.0})]
    try:
        inputs = trainer._generate_and_score_completions(_rows(trainer))
    finally:
        trainer.reward_funcs = funcs
    adv = inputs["advantages"].tolist()
    assert adv[1] == 0.0 and adv[0] == 0.0  # group 0: one scored sample left, nothing to compare against
    assert adv[2] > 0 > adv[3]  # group 1 untouched


def test_weighted_reward_sum_beyond_the_limit_is_refused(tiny_model_dir, tmp_path):
    """Each reward is within REWARD_MAX, their weighted sum is not: TRL's group std would overflow."""

    def big(completions, **kwargs):
        return [9e17 * (i % 2) for i in range(len(completions))]

    trainer = make_trainer(tiny_model_dir, tmp_path, reward=[big, big])
    trainer.model.train()
    with pytest.raises(
        ValueError, match=r"weighted sum of the rewards of sample 1 .* is 1\.8e\+18 \(big=9e\+17"
    ):
        trainer._generate_and_score_completions(_rows(trainer))


def test_check_rewards_refuses_nan_from_a_reward_model():
    """A reward model (an nn.Module) never returns None, so a NaN in its column is always an error."""
    from triage.trainers.grpo_trainer import check_rewards

    rewards = torch.tensor([[0.5, float("nan")], [0.1, 0.2]])
    no_nan = torch.zeros(2, 2, dtype=torch.bool)
    args = (rewards, no_nan, ["fn", "rm"], torch.ones(2))
    check_rewards(*args, [True, True], lambda r: f"sample {r}")  # NaN in a function's column: None
    with pytest.raises(ValueError, match="reward function 'rm' returned nan for sample 0"):
        check_rewards(*args, [True, False], lambda r: f"sample {r}")
