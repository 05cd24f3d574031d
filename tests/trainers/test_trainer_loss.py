"""TriageGRPOTrainer's loss against GRPOTrainer and against the core ``triage.policy_loss``, on the same batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from trainer_testkit import PerturbedRollout, make_args, make_trainer
from trl import GRPOConfig, GRPOTrainer

from triage import mismatch_metrics, policy_loss, token_gap, token_weights

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo")


def _batch(trainer):
    """One generation batch through TRL's own pipeline (rollout → rewards → advantages → tensors)."""
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps  # set by train()
    rows = [trainer.train_dataset[i] for i in range(4)]
    rows = [r for r in rows for _ in range(trainer.num_generations)]
    return trainer._generate_and_score_completions(rows)


def _loss_and_grads(trainer, inputs):
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    grads = [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]
    return loss.detach(), grads


def _grpo_twin(model_dir, tmp_path, triage_trainer):
    """A plain GRPOTrainer with the same GRPOConfig fields (TRL's own defaults for vLLM IS)."""
    fields = {k: getattr(triage_trainer.args, k) for k in GRPOConfig.__dataclass_fields__ if k != "_n_gpu"}
    keep = {
        k: fields[k]
        for k in (
            "use_cpu",
            "bf16",
            "max_steps",
            "per_device_train_batch_size",
            "num_generations",
            "max_completion_length",
            "learning_rate",
            "logging_steps",
            "report_to",
            "save_strategy",
            "seed",
        )
    }
    args = GRPOConfig(output_dir=str(tmp_path / "grpo"), **keep)
    return GRPOTrainer(
        model=model_dir,
        reward_funcs=triage_trainer.reward_funcs,
        args=args,
        train_dataset=triage_trainer.train_dataset,
        rollout_func=PerturbedRollout(),
    )


def _learner_logps(trainer, inputs):
    """The trainer's own per-token log-probs of the batch's completions (no grad)."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, attn, inputs["completion_ids"].size(1)
        )
    return logps


def _core_loss(trainer, inputs, logps, advantages, mask, weights):
    """``policy_loss`` of the core with the trainer's loss settings (old log-probs = current: ratio 1)."""
    return policy_loss(
        logps,
        logps,
        advantages,
        mask,
        weights,
        loss_type=trainer.loss_type,
        epsilon_low=trainer.epsilon_low,
        epsilon_high=trainer.epsilon_high,
        num_items_in_batch=inputs["num_items_in_batch"],
        max_completion_length=trainer.max_completion_length,
    )


def test_none_is_grpotrainer_bit_for_bit(tiny_model_dir, tmp_path):
    """correction='none' (metrics on) gives GRPOTrainer's loss and gradients exactly, for each loss type."""
    ours = make_trainer(tiny_model_dir, tmp_path / "ours", correction="none")
    theirs = _grpo_twin(tiny_model_dir, tmp_path, ours)
    inputs = _batch(ours)
    for loss_type in LOSS_TYPES:
        ours.loss_type = theirs.loss_type = loss_type
        ours._metrics["train"].clear()
        loss_a, grads_a = _loss_and_grads(ours, inputs)
        loss_b, grads_b = _loss_and_grads(theirs, inputs)
        assert torch.equal(loss_a, loss_b), loss_type
        assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b)), loss_type
        assert ours._metrics["train"]["triage/tokens"], "metrics are logged in 'none' mode too"


def test_triage_with_unit_weights_is_grpotrainer_bit_for_bit(tiny_model_dir, tmp_path):
    """All policies 'keep' and no floor/guard: w ≡ 1, so the hook must not perturb TRL's loss by one bit."""
    ours = make_trainer(
        tiny_model_dir,
        tmp_path / "ours",
        consistent="keep",
        amplify_down="keep",
        correct_up="keep",
        amplify_up="keep",
        correct_down="keep",
        tail_floor=None,
        guard_kappa=None,
    )
    theirs = _grpo_twin(tiny_model_dir, tmp_path, ours)
    inputs = _batch(ours)
    for loss_type in ("dapo", "grpo"):
        ours.loss_type = theirs.loss_type = loss_type
        assert torch.equal(_loss_and_grads(ours, inputs)[0], _loss_and_grads(theirs, inputs)[0])


@pytest.mark.parametrize("correction", ["triage", "icepop"])
def test_weighted_loss_matches_core_policy_loss(tiny_model_dir, tmp_path, correction):
    """The trainer's loss = triage.policy_loss(..., token_weights(δ)) for grpo, dapo, dr_grpo, bnpo."""
    trainer = make_trainer(tiny_model_dir, tmp_path, correction=correction, tau=0.05)
    inputs = _batch(trainer)
    logps = _learner_logps(trainer, inputs)
    mask = inputs["completion_mask"]
    delta = token_gap(logps, inputs["sampling_per_token_logps"], mask)
    weights = token_weights(delta, inputs["advantages"], mask, trainer.triage_config)
    assert not torch.all(weights[mask.bool()] == 1), "the test batch must exercise non-unit weights"
    for loss_type in LOSS_TYPES:
        trainer.loss_type = loss_type
        with torch.no_grad():
            got = trainer.compute_loss(trainer.model, inputs)
        want = _core_loss(trainer, inputs, logps, inputs["advantages"], mask, weights)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=loss_type)


def test_metrics_equal_core_metrics_on_the_batch(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, tau=0.05)
    inputs = _batch(trainer)
    trainer._metrics["train"].clear()
    with torch.no_grad():
        trainer.compute_loss(trainer.model, inputs)
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, attn, inputs["completion_ids"].size(1)
        )
    mask = inputs["completion_mask"]
    delta = token_gap(logps, inputs["sampling_per_token_logps"], mask)
    weights = token_weights(delta, inputs["advantages"], mask, trainer.triage_config)
    want = mismatch_metrics(
        delta,
        inputs["advantages"],
        mask,
        weights,
        trainer.triage_config,
        sampler_logps=inputs["sampling_per_token_logps"],
    )
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items() if k.startswith("triage/")}
    assert {"triage/mean_abs_dprob", "triage/amplify_down/grad_share"} <= set(want) <= set(logged)
    for key, value in want.items():
        assert logged[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    assert logged["triage/tokens"] == mask.sum().item()


def test_probability_space_weights_and_metrics_use_the_sampler_logps(tiny_model_dir, tmp_path):
    """tau_space='prob': the trainer hands the sampler's log-probs to token_weights and mismatch_sums, so its
    loss and metrics are the core's with ``sampler_logps=inputs["sampling_per_token_logps"]``."""
    masks_both_tails = dict(consistent="is", correct_up="keep", correct_down="keep", amplify_up="mask")
    trainer = make_trainer(
        tiny_model_dir, tmp_path, tau_space="prob", tau=5e-4, amplify_down="mask", **masks_both_tails
    )
    inputs = _batch(trainer)
    logps = _learner_logps(trainer, inputs)
    mask, adv, sampler = inputs["completion_mask"], inputs["advantages"], inputs["sampling_per_token_logps"]
    config = trainer.triage_config
    delta = token_gap(logps, sampler, mask)
    with pytest.raises(ValueError, match="sampler_logps is required"):
        token_weights(delta, adv, mask, config)
    weights = token_weights(delta, adv, mask, config, sampler_logps=sampler)
    pushed = mask.bool() & (adv != 0)[:, None]
    assert (weights[pushed] == 0).any() and (weights[pushed] == 1).any(), "the batch must cross the band"
    assert ((weights[pushed] != 0) & (weights[pushed] != 1)).any(), "and have tokens inside it (is weights)"
    log_space = token_weights(delta, adv, mask, dataclasses.replace(config, tau_space="log"))
    assert not torch.equal(weights, log_space), "the probability band must classify differently here"
    trainer._metrics["train"].clear()
    for loss_type in ("dapo", "grpo"):
        trainer.loss_type = loss_type
        with torch.no_grad():
            got = trainer.compute_loss(trainer.model, inputs)
        want = _core_loss(trainer, inputs, logps, adv, mask, weights)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=loss_type)
    metrics = mismatch_metrics(delta, adv, mask, weights, config, sampler_logps=sampler)
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items() if k.startswith("triage/")}
    for key in ("triage/consistent/share", "triage/amplify_up/share", "triage/mean_abs_dprob"):
        assert logged[key] == pytest.approx(metrics[key], rel=1e-6, abs=1e-12), key


def test_delta_uses_trl_old_logps_when_present(tiny_model_dir, tmp_path):
    """When TRL supplies old log-probs (weights moved since generation), δ is measured against them."""
    trainer = make_trainer(tiny_model_dir, tmp_path)
    inputs = _batch(trainer)
    inputs["old_per_token_logps"] = inputs["sampling_per_token_logps"].clone()  # learner == sampler
    trainer._metrics["train"].clear()
    with torch.no_grad():
        trainer.compute_loss(trainer.model, inputs)
    assert trainer._metrics["train"]["triage/mean_abs_delta"][-1] == 0.0
    assert trainer._metrics["train"]["triage/consistent/share"][-1] + trainer._metrics["train"][
        "triage/inert/share"
    ][-1] == pytest.approx(1.0)


def test_vllm_flag_defaults_follow_correction(tmp_path):
    assert make_args(tmp_path, correction="none").vllm_importance_sampling_correction is True
    assert make_args(tmp_path, correction="triage").vllm_importance_sampling_correction is False
    with pytest.raises(ValueError, match="twice"):
        make_args(tmp_path, correction="tis", vllm_importance_sampling_correction=True)
    with pytest.raises(ValueError, match="same off-policy sequence mask twice"):
        make_args(tmp_path, correction="opsm", off_policy_mask_threshold=0.5)


def test_none_trains_like_grpotrainer(tiny_model_dir, tmp_path):
    """Two full optimizer steps give GRPOTrainer's losses and grad norms.

    Compared to 1e-6, not bit for bit: two GRPOTrainer runs in one process already differ in the last bits
    of the weights after two CPU steps (~1e-8), so bit-equality is pinned on a fixed batch above instead.
    """
    ours = make_trainer(tiny_model_dir, tmp_path / "ours", correction="none")
    theirs = _grpo_twin(tiny_model_dir, tmp_path, ours)
    ours.train()
    theirs.train()

    def trail(trainer):
        return [v for h in trainer.state.log_history if "loss" in h for v in (h["loss"], h["grad_norm"])]

    assert len(trail(ours)) == 4
    assert trail(ours) == pytest.approx(trail(theirs), rel=1e-6, abs=1e-9)
