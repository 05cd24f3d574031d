"""``triage ablate --save-models``: a run saves its learner (weights as the trainer holds them, tokenizer) as a
local HF folder after the chosen steps; the folder loads with ``AutoModelForCausalLM`` and gives the live
model's logits; a resumed run keeps a folder already there and lists every folder in its JSON; a finished run
keeps them. The setting reaches the child processes through ``study.json``, leaves the scale's fingerprint
alone, and parses from a study file and the command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import time
from pathlib import Path

import pytest

from triage.experiments import ablate
from triage.experiments.ablate import SCALES, RunKey, Study

SCALE = dataclasses.replace(SCALES["smoke"], steps=2)


@pytest.fixture(scope="module")
def sft(tmp_path_factory, torch_twins):
    """The smoke SFT checkpoint, trained once (torch twins of the kernels, one thread: ``torch_twins``)."""
    from triage.experiments.sft import ensure_sft_checkpoint

    folder = tmp_path_factory.mktemp("sft") / "sft"
    ensure_sft_checkpoint(SCALE.sft, folder, log=lambda *_: None)
    return folder


def _args(*argv):
    parser = argparse.ArgumentParser()
    ablate.add_arguments(parser)
    return parser.parse_args(list(argv))


def _watch(monkeypatch, cut_after: int, logits: bool) -> dict:
    """What the trainer holds after each step (its weights, cloned, and with ``logits`` the logits of a fixed
    batch), taken after the run's own ``on_step_end`` (which saves the model); the time budget stops the run
    after step ``cut_after``."""
    import torch

    seen: dict = {}
    original = ablate._run_callback
    ids = torch.arange(3, 19).reshape(2, 8)

    def run_callback(*args, **kwargs):
        callback = original(*args, **kwargs)
        on_step_end = callback.on_step_end

        def watching(args, state, control, **kw):
            seen["step"] = state.global_step
            out = on_step_end(args, state, control, **kw)
            model = kw["model"]
            training = model.training
            with torch.no_grad():
                weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
                model.eval()
                out_logits = model(input_ids=ids).logits.detach().clone() if logits else None
            model.train(training)
            seen[state.global_step] = (weights, out_logits)
            return out

        callback.on_step_end = watching
        return callback

    monkeypatch.setattr(ablate, "_run_callback", run_callback)
    monkeypatch.setattr(ablate, "_ends_past", lambda deadline, began, end: seen["step"] == cut_after)
    seen["ids"] = ids
    return seen


@pytest.mark.parametrize("level", ["aligned", "realistic"])
def test_a_run_saves_its_learner_and_a_resumed_run_keeps_and_lists_it(sft, tmp_path, monkeypatch, level):
    """`aligned`: an fp32 learner, whose saved folder gives the live model's logits; `realistic`: an NVFP4
    learner, whose folder holds its fp32 masters (plain nn.Linear weights). The run is cut after step 1
    (save_models [1]) and resumed with save_models [1, 2] where a folder of step 2 is already there."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    key = RunKey(level, "grpo-none", 0)
    out = tmp_path / "study"
    shutil.copytree(sft, out / ablate.SFT_DIR)
    run_dir = key.path(out)
    seen = _watch(monkeypatch, cut_after=1, logits=level == "aligned")
    lines: list[str] = []
    assert ablate.run_one(SCALE, key, out, time.time() + 1e6, lines.append, save_models=[1]) is None
    folder = run_dir / "model-step1"
    assert f"    step   1/2: model saved to {folder}" in lines
    assert not (run_dir / "model-step1.tmp").exists() and (run_dir / "checkpoint-1").is_dir()
    partial = json.loads(key.path(out, ablate.PARTIAL_SUFFIX).read_text())
    assert partial["models"] == [f"runs/{level}/grpo-none/seed0/model-step1"]

    weights, logits = seen[1]
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    assert (
        AutoTokenizer.from_pretrained(str(folder)).get_vocab()
        == AutoTokenizer.from_pretrained(str(sft)).get_vocab()
    )
    assert all(
        type(m) is torch.nn.Linear for m in model.model.layers[0].mlp.children() if hasattr(m, "weight")
    )
    saved = model.state_dict()
    assert set(weights) <= set(saved)
    assert all(torch.equal(saved[k], w.float()) for k, w in weights.items())  # what the trainer held
    initial = AutoModelForCausalLM.from_pretrained(str(sft), dtype=torch.float32).state_dict()
    assert any(not torch.equal(saved[k], initial[k]) for k in weights)  # step 1 moved the weights
    if level == "aligned":  # an fp32 learner: the folder computes what the live model computed
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=seen["ids"]).logits, logits)

    # resumed with other steps: step 1 is behind it, step 2's folder (an earlier attempt's) stays as it is
    monkeypatch.undo()
    (run_dir / "model-step2").mkdir()
    (run_dir / "model-step2" / "earlier").write_text("x")
    (run_dir / "model-step7.tmp").mkdir()  # a save that never finished: not a model
    lines = []
    entry = ablate.run_one(SCALE, key, out, log=lines.append, resume=True, save_models=(1, 2))
    assert entry["resumed_at"] == [1] and entry["complete"] is True
    assert f"    step   2/2: model kept, already there: {run_dir / 'model-step2'}" in lines
    assert sorted(p.name for p in (run_dir / "model-step2").iterdir()) == ["earlier"]
    assert entry["models"] == [f"runs/{level}/grpo-none/seed0/model-step{k}" for k in (1, 2)]
    assert not list(run_dir.glob("checkpoint-*")) and (folder / "model.safetensors").is_file()
    again = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).state_dict()
    assert all(torch.equal(again[k], v) for k, v in saved.items())  # the finished run kept step 1's folder
    results = ablate.aggregate(ablate.load_runs(out), SCALE.to_dict(), None)
    assert results["groups"][level]["grpo-none"]["models"] == [{"seed": 0, "paths": entry["models"]}]

    if level == "aligned":
        # the study resumes with yet other steps (the fingerprint and the recipes are the same): skipped
        study = Study(SCALE, levels=(level,), arms=("grpo-none",), save_models=(2,))
        _, status = ablate.run_study(study, out, resume=True, plots=False, log=lambda *_: None)
        assert status == {key: "skipped"}
        assert json.loads((out / ablate.STUDY_FILE).read_text())["save_models"] == [2]
        # a run that starts again from step 0 drops the earlier attempt's models
        ablate.run_one(SCALE, key, out, log=lambda *_: None)
        assert not list(run_dir.glob("model-step*")) and _entry(out, key)["models"] == []


def _entry(out: Path, key: RunKey) -> dict:
    return json.loads(key.path(out, ".json").read_text())


def test_save_models_is_no_part_of_the_fingerprint_and_reaches_the_children(tmp_path, monkeypatch):
    plain, saving = Study(SCALES["smoke"]), Study(SCALES["smoke"], save_models=[200, 100])
    assert saving.save_models == (100, 200) and plain.save_models == ()
    assert saving.to_dict()["fingerprint"] == plain.to_dict()["fingerprint"]
    assert saving.to_dict()["save_models"] == [100, 200]

    calls = []
    monkeypatch.setattr(ablate, "run_one", lambda *args, **kwargs: calls.append(kwargs) or {})
    study = saving.to_dict()
    (tmp_path / ablate.STUDY_FILE).write_text(json.dumps(study))
    assert ablate.run(_args("--output", str(tmp_path), "--run", "realistic/tis/0")) == 0
    del study["save_models"]  # a study.json written before the key: no models
    (tmp_path / ablate.STUDY_FILE).write_text(json.dumps(study))
    assert ablate.run(_args("--output", str(tmp_path), "--run", "realistic/tis/0")) == 0
    assert [c["save_models"] for c in calls] == [(100, 200), ()]


def test_save_models_from_a_study_file_and_the_flag(tmp_path):
    path = tmp_path / "study.yaml"
    path.write_text("scale: smoke\nsave_models: [100]\n")
    study = ablate.resolve_study(_args("--study", str(path), "--output", str(tmp_path)))
    assert study.save_models == (100,)
    over = ablate.resolve_study(
        _args("--study", str(path), "--output", str(tmp_path), "--save-models", "200,50")
    )
    assert over.save_models == (50, 200)
    flag = ablate.resolve_study(_args("--scale", "smoke", "--output", str(tmp_path), "--save-models", "3"))
    assert flag.save_models == (3,)
    assert ablate.resolve_study(_args("--scale", "smoke", "--output", str(tmp_path))).save_models == ()


@pytest.mark.parametrize(
    "flag, text",
    [
        ("0", "save_models: [0]"),
        ("5,5", "save_models: [5, 5]"),
        ("-3", "save_models: -3"),
        ("1,x", "save_models: [1.5]"),
        ("100;200", "save_models: {100: 1}"),
        ("2.0", "save_models: [true]"),
    ],
)
def test_bad_save_models_are_errors_naming_the_field(tmp_path, flag, text):
    with pytest.raises(ValueError, match="save_models must be"):
        ablate.resolve_study(_args("--scale", "smoke", "--output", str(tmp_path), "--save-models", flag))
    path = tmp_path / "study.yaml"
    path.write_text(f"scale: smoke\n{text}\n")
    with pytest.raises(ValueError, match="save_models must be"):
        ablate.resolve_study(_args("--study", str(path), "--output", str(tmp_path)))


def test_saving_does_not_change_what_a_run_computes(sft, tmp_path):
    """The same run with and without save_models: the same series and held-out accuracy, step for step."""
    key = RunKey("aligned", "grpo-none", 0)
    entries = []
    for name, steps in (("plain", ()), ("saving", (1,))):
        out = tmp_path / name
        shutil.copytree(sft, out / ablate.SFT_DIR)
        entries.append(ablate.run_one(SCALE, key, out, None, lambda *_: None, save_models=steps))
    plain, saving = entries
    assert (tmp_path / "saving" / "runs" / "aligned" / "grpo-none" / "seed0" / "model-step1").is_dir()
    assert saving["models"] and not plain.get("models")
    assert plain["series"] == saving["series"] and plain["held_out"] == saving["held_out"]
