"""``triage ablate``: a run the time budget cuts short saves a checkpoint and ``--resume`` continues it — the
resumed run's per-step series equals the uninterrupted run's bit for bit on CPU, the step axis and the
held-out schedule continue, ``resumed_at`` records the resume steps — and a checkpoint of another run,
scale or recipe is refused."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

import pytest

from triage.experiments import ablate
from triage.experiments.ablate import PARTIAL_SUFFIX, RUN_STATE_FILE, SCALES, RunKey, Study

SCALE = dataclasses.replace(SCALES["smoke"], steps=4)  # held-out after steps 0, 2, 4
KEY = RunKey("realistic", "grpo-none", 0)


@pytest.fixture(scope="module")
def sft(tmp_path_factory, torch_twins):
    """The smoke SFT checkpoint, trained once (torch twins of the kernels, one thread: ``torch_twins``)."""
    from triage.experiments.sft import ensure_sft_checkpoint

    folder = tmp_path_factory.mktemp("sft") / "sft"
    ensure_sft_checkpoint(SCALE.sft, folder, log=lambda *_: None)
    return folder


def _study_dir(sft: Path, path: Path) -> Path:
    shutil.copytree(sft, path / ablate.SFT_DIR)
    return path


def _cut_after(monkeypatch, *steps: int) -> None:
    """The time budget stops the run after each of ``steps`` (step numbers of the whole run): the clock's
    verdict (:func:`ablate._ends_past`) is replaced by one that reads the step the callback just ended."""
    now = {"step": 0}
    original = ablate._run_callback

    def run_callback(*args, **kwargs):
        callback = original(*args, **kwargs)
        on_step_end = callback.on_step_end

        def tracking(args, state, control, **kw):
            now["step"] = state.global_step
            return on_step_end(args, state, control, **kw)

        callback.on_step_end = tracking
        return callback

    monkeypatch.setattr(ablate, "_ends_past", lambda deadline, began, end: now["step"] in steps)
    monkeypatch.setattr(ablate, "_run_callback", run_callback)


@pytest.mark.parametrize("level", ["realistic", "nvfp4-coarse-fp8kv"])
def test_a_run_cut_twice_and_resumed_equals_the_uninterrupted_run(sft, tmp_path, monkeypatch, level):
    """`realistic`: NVFP4 learner and sampler, fp8 KV cache; `nvfp4-coarse-fp8kv`: stochastic rounding in the
    sampler. Cut after step 1 (off the held-out schedule), resumed and cut after step 3, resumed to step 4."""
    key = dataclasses.replace(KEY, level=level)
    full = ablate.run_one(SCALE, key, _study_dir(sft, tmp_path / "full"))
    assert full["resumed_at"] == [] and full["series"]["step"] == [1, 2, 3, 4]

    out = _study_dir(sft, tmp_path / "cut")
    run_dir, far = key.path(out), time.time() + 1e6
    _cut_after(monkeypatch, 1, 3)
    assert ablate.run_one(SCALE, key, out, deadline=far) is None
    partial = json.loads(key.path(out, PARTIAL_SUFFIX).read_text())
    assert partial["complete"] is False and partial["stopped_by"] == "time_budget"
    assert partial["series"]["step"] == [1] and partial["held_out"]["step"] == [0, 1]  # 1: off schedule
    state = json.loads((run_dir / "checkpoint-1" / RUN_STATE_FILE).read_text())
    assert state["held_out"]["step"] == [0] and state["step"] == 1 and state["resumed_at"] == []

    lines = []
    assert ablate.run_one(SCALE, key, out, deadline=far, log=lines.append, resume=True) is None
    assert f"    {key}: resuming from {run_dir / 'checkpoint-1'} (step 1/4)" in lines
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == ["checkpoint-3"]  # one per run
    partial = json.loads(key.path(out, PARTIAL_SUFFIX).read_text())
    assert partial["series"]["step"] == [1, 2, 3] and partial["held_out"]["step"] == [0, 2, 3]
    assert partial["resumed_at"] == [1]

    monkeypatch.undo()
    entry = ablate.run_one(SCALE, key, out, resume=True)
    assert entry == json.loads(key.path(out, ".json").read_text())
    assert entry["complete"] is True and entry["stopped_by"] == "steps" and entry["resumed_at"] == [1, 3]
    assert entry["summary"]["steps"] == 4 and entry["started"] == partial["started"]
    assert entry["seconds"] > partial["seconds"]
    assert not key.path(out, PARTIAL_SUFFIX).exists() and not list(run_dir.glob("checkpoint-*"))
    assert entry["series"] == full["series"]  # every metric of every step, bit for bit
    assert entry["held_out"] == full["held_out"] and entry["summary"] == full["summary"]
    assert entry["recipe"] == json.loads(json.dumps(full["recipe"]).replace("/full/", "/cut/"))


def test_a_study_cut_by_its_time_budget_continues_under_resume(sft, tmp_path):
    """The real clock: a run far longer than the budget starts (a cut loses no step), is cut and saves a
    checkpoint; the next call with --resume continues it from there and is cut again (one checkpoint kept)."""
    # a-priori 4 s a run, more than the first budget; 5 steps (the held-out interval) expected to take 0.05 s
    scale = dataclasses.replace(SCALES["smoke"], steps=400, eval_every=5, arm_seconds=4.0)
    out = _study_dir(sft, tmp_path / "study")
    study = Study(scale, levels=("aligned",), arms=("grpo-none",), time_budget=2.0)
    key = study.runs()[0]
    _, status = ablate.run_study(study, out, plots=False, log=lambda *_: None)
    assert status == {key: "cut short"}
    (first,) = key.path(out).glob("checkpoint-*")
    one = int(first.name.split("-")[1])
    assert 1 <= one < scale.steps

    # the runs' own pace sets the estimate now (the first call's start-up counted in): a longer budget
    study = dataclasses.replace(study, time_budget=6.0)
    _, status = ablate.run_study(study, out, resume=True, plots=False, log=lambda *_: None)
    assert status == {key: "cut short"}
    (second,) = key.path(out).glob("checkpoint-*")
    two = int(second.name.split("-")[1])
    assert one < two < scale.steps
    partial = json.loads(key.path(out, PARTIAL_SUFFIX).read_text())
    assert partial["resumed_at"] == [one] and partial["series"]["step"] == list(range(1, two + 1))
    scheduled = list(range(0, two + 1, 5))
    assert partial["held_out"]["step"] == scheduled + ([two] if two % 5 else [])
    log = key.path(out, ".log").read_text()  # both calls' lines
    assert "not finished (checkpoint saved" in log and f"resuming from {first} (step {one}/400)" in log


def test_results_name_the_resumed_runs(tmp_path):
    from triage.experiments.ablate import aggregate, run_summary, write_results

    def entry(seed, resumed_at):
        series = {"step": [1, 2], "reward": [0.0, 1.0]}
        held = {"step": [0, 2], "accuracy": [0.1, 0.2]}
        return {
            **dict(level="aligned", arm="grpo-none", seed=seed, seconds=1.0, resumed_at=resumed_at),
            "series": series,
            "held_out": held,
            "summary": run_summary(series, held),
        }

    runs = {RunKey("aligned", "grpo-none", s): entry(s, at) for s, at in ((0, []), (1, [1]), (2, [1, 2]))}
    results = aggregate(runs, SCALE.to_dict(), None)
    assert results["groups"]["aligned"]["grpo-none"]["resumed"] == [
        {"seed": 1, "at": [1]},
        {"seed": 2, "at": [1, 2]},
    ]
    write_results(tmp_path, results, plots=False)
    table = (tmp_path / "results.md").read_text()
    assert table.endswith(
        "\nResumed from a checkpoint: aligned/grpo-none/1 after step 1; aligned/grpo-none/2 after step 1, 2.\n"
    )


def _checkpoint_of(out: Path, key: RunKey, scale=SCALE, **changes) -> Path:
    """A checkpoint folder holding only the run state the run itself would write (``changes`` edit it)."""
    import torch

    recipe = ablate.run_recipe(scale, key, out / "sft", key.path(out), cpu=not torch.cuda.is_available())
    state = {
        "run": str(key),
        "fingerprint": scale.fingerprint(),
        "step": 2,
        "started": 0.0,
        "seconds": 1.0,
        "resumed_at": [],
        "held_out": {"step": [0, 2], "accuracy": [0.0, 0.0], "by_difficulty": [{}, {}]},
        "recipe": json.loads(json.dumps(recipe, default=str)),
    }
    for name, value in changes.items():
        if name in state:
            state[name] = value
        else:
            state["recipe"][name] = value
    folder = key.path(out) / "checkpoint-2"
    folder.mkdir(parents=True)
    (folder / RUN_STATE_FILE).write_text(json.dumps(state))
    return folder


@pytest.mark.parametrize(
    "change, match",
    [
        (
            {"learning_rate": 3e-4},
            r"another recipe than grpo-none/realistic .*differs in \['learning_rate'\]",
        ),
        ({"fingerprint": "0123456789abcdef"}, r"its fingerprint is '0123456789abcdef'"),
        ({"run": "realistic/tis/0"}, r"its run is 'realistic/tis/0', this run's 'realistic/grpo-none/0'"),
    ],
)
def test_resume_refuses_a_checkpoint_of_another_run_scale_or_recipe(tmp_path, change, match):
    folder = _checkpoint_of(tmp_path, KEY, **change)
    with pytest.raises(ValueError, match=match) as err:
        ablate.run_one(SCALE, KEY, tmp_path, resume=True)
    assert str(folder) in str(err.value)
    assert folder.is_dir()  # never removed: the user decides


def test_a_moved_study_folder_resumes_its_checkpoint(tmp_path, monkeypatch):
    """Where the folder lies is no part of the recipe: a checkpoint written under another path is accepted."""
    import triage.experiments.train as train

    _checkpoint_of(tmp_path / "elsewhere", KEY)
    shutil.move(tmp_path / "elsewhere", tmp_path / "here")
    built = []
    monkeypatch.setattr(train, "build_trainer", lambda *a, **k: built.append(a) or 1 / 0)
    lines = []
    with pytest.raises(ZeroDivisionError):
        ablate.run_one(SCALE, KEY, tmp_path / "here", log=lines.append, resume=True)
    assert built and any("resuming from" in line and "(step 2/4)" in line for line in lines)


def test_without_a_complete_checkpoint_a_run_starts_from_step_0_and_says_so(tmp_path, monkeypatch):
    """A checkpoint whose save did not complete (no run state) is not resumed: the run starts from 0, says
    so in its log, and removes it; without --resume a complete checkpoint is removed too."""
    import triage.experiments.train as train

    monkeypatch.setattr(train, "build_trainer", lambda *a, **k: 1 / 0)  # stop once the start is decided
    folder = _checkpoint_of(tmp_path, KEY)
    (folder / RUN_STATE_FILE).unlink()
    KEY.path(tmp_path, PARTIAL_SUFFIX).write_text("{}")
    lines = []
    with pytest.raises(ZeroDivisionError):
        ablate.run_one(SCALE, KEY, tmp_path, log=lines.append, resume=True)
    assert lines == [f"    {KEY}: no checkpoint in {KEY.path(tmp_path)}: starting from step 0"]
    assert not folder.exists() and not KEY.path(tmp_path, PARTIAL_SUFFIX).exists()

    folder = _checkpoint_of(tmp_path, KEY)
    with pytest.raises(ZeroDivisionError):
        ablate.run_one(SCALE, KEY, tmp_path)
    assert not folder.exists()


def test_checkpoints_are_left_out_of_the_gpu_tarball(tmp_path):
    """experiments/testbed/gpu.sh packs RUN_DIR without the run checkpoints, saved models and the SFT weights
    (too large to bring back; a saved model is analysed on the machine), with the SFT's sft.json."""
    import re
    import subprocess
    import tarfile

    script = (Path(ablate.__file__).parent / "testbed" / "gpu.sh").read_text()
    (command,) = re.findall(r"^tar czf .*(?:\n  .*)*", script, flags=re.M)
    run_dir = tmp_path / "runs" / "tb" / "long"
    seed = run_dir / "runs" / "aligned" / "grpo-none" / "seed0"
    (seed / "checkpoint-7").mkdir(parents=True)
    for name in ("model.safetensors", "optimizer.pt", "rng_state.pth", RUN_STATE_FILE, "trainer_state.json"):
        (seed / "checkpoint-7" / name).write_text("x")
    (seed / "model-step5").mkdir()
    for name in ("model.safetensors", "config.json", "tokenizer.json", "training_args.bin"):
        (seed / "model-step5" / name).write_text("x")
    (run_dir / "sft").mkdir()
    for name in ("model.safetensors", "sft.json"):
        (run_dir / "sft" / name).write_text("x")
    for name in ("seed0.partial.json", "seed0.log"):
        (seed.parent / name).write_text("{}")
    command = command.replace('"$REAL_OUT/testbed-runs.tgz"', "out.tgz").replace(
        '"${dirs[@]}"', "runs/tb/long"
    )
    subprocess.run(["bash", "-c", command], cwd=tmp_path, check=True)
    with tarfile.open(tmp_path / "out.tgz") as tar:
        names = [m.name for m in tar.getmembers() if m.isfile()]
    assert sorted(names) == [
        "runs/tb/long/runs/aligned/grpo-none/seed0.log",
        "runs/tb/long/runs/aligned/grpo-none/seed0.partial.json",
        "runs/tb/long/sft/sft.json",  # names the checkpoint for testbed_summary; the weights stay
    ]
