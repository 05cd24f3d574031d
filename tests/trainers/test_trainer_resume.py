"""Checkpoint save + resume reproduces the uninterrupted run, adaptive τ and generation windows included."""

from __future__ import annotations

import json
import os
import shutil
import warnings
from types import SimpleNamespace

import pytest
from trainer_testkit import make_trainer

from triage import TriageConfig
from triage.trainers import TriageGRPOTrainer
from triage.trainers.grpo_trainer import GENERATION_STATE_FILE, SAMPLER_STATE_FILE, TRIAGE_STATE_FILE


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


WINDOW = dict(tau="auto", max_steps=4, save_strategy="steps", save_steps=1)


@pytest.fixture(scope="module", params=[{"steps_per_generation": 2}, {"num_iterations": 2}], ids=str)
def windowed_run(request, tiny_model_dir, tmp_path_factory):
    """An uninterrupted run that generates every 2 optimizer steps; checkpoints 1 and 3 lie inside a window."""
    out = tmp_path_factory.mktemp("window")
    trainer = make_trainer(tiny_model_dir, out / "full", **WINDOW, **request.param)
    trainer.train()
    return request.param, out / "full", _losses(trainer)


def test_resume_inside_a_generation_window_reproduces_the_uninterrupted_run(
    windowed_run, tiny_model_dir, tmp_path
):
    knobs, run_dir, want = windowed_run
    checkpoint = run_dir / "checkpoint-1"
    assert (checkpoint / GENERATION_STATE_FILE.format(rank=0)).exists()
    assert not (run_dir / "checkpoint-2" / GENERATION_STATE_FILE.format(rank=0)).exists()  # a boundary
    resumed = make_trainer(tiny_model_dir, tmp_path, **WINDOW, **knobs)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    got = _losses(resumed)
    for step in (2, 3, 4):
        assert got[step] == want[step], f"step {step}: resumed {got[step]} vs uninterrupted {want[step]}"


def test_a_checkpoint_inside_a_window_without_its_buffer_is_refused(windowed_run, tiny_model_dir, tmp_path):
    knobs, run_dir, _ = windowed_run
    checkpoint = tmp_path / "checkpoint-1"
    shutil.copytree(run_dir / "checkpoint-1", checkpoint)
    os.remove(checkpoint / GENERATION_STATE_FILE.format(rank=0))
    again = make_trainer(tiny_model_dir, tmp_path / "b", **WINDOW, **knobs)
    with pytest.raises(ValueError, match="inside a generation window .* would regenerate mid-window"):
        again.train(resume_from_checkpoint=str(checkpoint))


def test_resuming_with_another_triage_config_warns(windowed_run, tiny_model_dir, tmp_path):
    knobs, run_dir, _ = windowed_run
    again = make_trainer(tiny_model_dir, tmp_path, **{**WINDOW, "max_steps": 3}, **knobs, is_cap=3.0)
    with pytest.warns(UserWarning, match="is_cap: 2.0 → 3.0"):
        again.train(resume_from_checkpoint=str(run_dir / "checkpoint-2"))


def test_a_field_missing_from_an_older_checkpoint_counts_as_its_default():
    """A checkpoint saved before a TriageConfig field existed ran with that field's default: no warning for
    it, but a warning when the resumed run sets it otherwise."""
    saved = TriageConfig().to_dict()
    del saved["tau_space"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TriageGRPOTrainer._compare_triage_config(SimpleNamespace(triage_config=TriageConfig()), saved, "ckpt")
    prob = SimpleNamespace(triage_config=TriageConfig(tau_space="prob", tau=0.05))
    with pytest.warns(UserWarning, match="tau_space: 'log' → 'prob'"):
        TriageGRPOTrainer._compare_triage_config(prob, saved, "ckpt")


def test_a_corrupt_adaptive_tau_state_is_refused(windowed_run, tiny_model_dir, tmp_path):
    knobs, run_dir, _ = windowed_run
    checkpoint = tmp_path / "checkpoint-2"
    shutil.copytree(run_dir / "checkpoint-2", checkpoint)
    state = json.loads((checkpoint / TRIAGE_STATE_FILE).read_text())
    state["adaptive_tau"]["scale"] = float("nan")  # json writes NaN
    (checkpoint / TRIAGE_STATE_FILE).write_text(json.dumps(state))
    again = make_trainer(tiny_model_dir, tmp_path / "b", **WINDOW, **knobs)
    with pytest.raises(ValueError, match=r"triage_state.json: AdaptiveTau state 'scale'=nan"):
        again.train(resume_from_checkpoint=str(checkpoint))
