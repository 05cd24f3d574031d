"""Checkpoint save + resume reproduces the uninterrupted run, adaptive τ included."""

from __future__ import annotations

import json
import os

import pytest
from trainer_testkit import make_trainer

from triage.trainers.grpo_trainer import SAMPLER_STATE_FILE, TRIAGE_STATE_FILE


def _losses(trainer):
    return {h["step"]: (h["loss"], h["triage/tau"]) for h in trainer.state.log_history if "loss" in h}


def test_resume_reproduces_the_uninterrupted_loss_sequence(tiny_model_dir, tmp_path):
    common = dict(tau="auto", max_steps=4, save_strategy="steps", save_steps=2)
    full = make_trainer(tiny_model_dir, tmp_path / "full", **common)
    full.train()
    want = _losses(full)
    assert len(want) == 4

    checkpoint = tmp_path / "full" / "checkpoint-2"
    state = json.loads((checkpoint / TRIAGE_STATE_FILE).read_text())
    assert state["adaptive_tau"]["steps"] == 2
    assert state["triage_config"]["tau"] == "auto"

    resumed = make_trainer(tiny_model_dir, tmp_path / "resumed", **common)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    got = _losses(resumed)
    assert sorted(got) == [1, 2, 3, 4]  # steps 1-2 come back with the checkpoint's trainer_state.json
    for step in (3, 4):
        assert got[step] == want[step], f"step {step}: resumed {got[step]} vs uninterrupted {want[step]}"
    assert resumed.adaptive_tau.state_dict() == full.adaptive_tau.state_dict()


def test_resume_without_triage_state_is_an_error_for_adaptive_tau(tiny_model_dir, tmp_path):
    trainer = make_trainer(
        tiny_model_dir, tmp_path / "a", tau="auto", max_steps=2, save_strategy="steps", save_steps=2
    )
    trainer.train()
    checkpoint = tmp_path / "a" / "checkpoint-2"
    os.remove(checkpoint / TRIAGE_STATE_FILE)
    again = make_trainer(tiny_model_dir, tmp_path / "b", tau="auto", max_steps=3)
    with pytest.raises(FileNotFoundError, match="adaptive"):
        again.train(resume_from_checkpoint=str(checkpoint))


def test_resume_restores_the_builtin_samplers_random_stream(tiny_model_dir, tmp_path):
    """With ``sampler="hf"`` and a fixed seed (as the recipes set), the resumed run draws the completions the
    uninterrupted run drew at steps 3-4: the sampler's generator state is saved per process."""

    def content_reward(completions, completion_ids, **kw):  # depends on the sampled tokens
        return [float(sum(ids) % 5) for ids in completion_ids]

    common = dict(
        tau="auto", max_steps=4, save_strategy="steps", save_steps=2, sampler="hf", sampler_kwargs={"seed": 0}
    )

    def run(out, resume=None):
        trainer = make_trainer(tiny_model_dir, out, rollout=None, reward=content_reward, **common)
        trainer.train(resume_from_checkpoint=resume)
        return {
            h["step"]: (h["loss"], h["triage/tau"], h["reward"])
            for h in trainer.state.log_history
            if "loss" in h
        }

    full = run(tmp_path / "full")
    checkpoint = tmp_path / "full" / "checkpoint-2"
    assert "generator" in json.loads((checkpoint / SAMPLER_STATE_FILE.format(rank=0)).read_text())
    resumed = run(tmp_path / "resumed", str(checkpoint))
    for step in (3, 4):
        assert resumed[step] == full[step], (
            f"step {step}: resumed {resumed[step]} vs uninterrupted {full[step]}"
        )
