"""``triage ablate`` studies without training: study files and flags, and the aggregation over seeds on
synthetic run JSONs (mean, sample std, min, max; per-step bands)."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from triage.experiments import ablate
from triage.experiments.ablate import SCALES, RunKey, Study, aggregate, load_runs, run_summary, seed_stats
from triage.experiments.recipes import ARMS


def _args(*argv):
    parser = argparse.ArgumentParser()
    ablate.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_study_file_sets_the_study_and_flags_override_it(tmp_path):
    path = tmp_path / "study.yaml"
    path.write_text(
        "scale: local\n"
        "levels: [aligned, realistic]\n"
        "arms: grpo-none, triage\n"
        "seeds: [0, 1, 2]\n"
        "steps: 300\n"
        "parallel: 12\n"
        "time_budget: 540\n"
        "overrides: {learning_rate: 3.0e-5, sampler_kwargs.batch_size: 64}\n"
    )
    study = ablate.resolve_study(_args("--study", str(path), "--output", str(tmp_path)))
    assert study.scale.name == "local" and study.scale.steps == 300
    assert study.levels == ("aligned", "realistic") and study.arms == ("grpo-none", "triage")
    assert study.seeds == (0, 1, 2) and study.parallel == 12 and study.time_budget == 540
    assert study.scale.overrides == {"learning_rate": 3e-5, "sampler_kwargs.batch_size": 64}
    assert [str(k) for k in study.runs()[:3]] == [
        "aligned/grpo-none/0",
        "aligned/triage/0",
        "realistic/grpo-none/0",
    ]
    assert len(study.runs()) == 12  # 2 levels x 2 arms x 3 seeds, seed-major

    flags = ("--seeds", "4", "--parallel", "2", "--steps", "5", "--levels", "nvfp4-matched", "--mini")
    flags += ("--time-budget", "60", "--set", "learning_rate=1e-4", "--scale", "smoke")
    over = ablate.resolve_study(_args("--study", str(path), "--output", str(tmp_path), *flags))
    assert over.scale.name == "smoke-mini" and over.scale.steps == 5
    assert over.levels == ("nvfp4-matched",) and over.arms == ("grpo-none", "triage")  # arms from the file
    assert over.seeds == (4,) and over.parallel == 2 and over.time_budget == 60
    assert over.scale.overrides == {"learning_rate": 1e-4, "sampler_kwargs.batch_size": 64}


def test_defaults_are_the_single_seed_ablation(tmp_path):
    study = ablate.resolve_study(_args("--scale", "smoke", "--output", str(tmp_path)))
    assert study.levels == ("realistic",) and study.arms == ARMS and study.seeds == (0,)
    assert study.parallel == 1 and study.time_budget is None and study.scale == SCALES["smoke"]


@pytest.mark.parametrize(
    "text, match",
    [
        ("scale: smoke\nseed: [0]\n", r"unknown study keys \['seed'\]"),
        ("scale: tiny\n", "scale 'tiny' is not one of"),
        ("scale: smoke\noverrides: [a]\n", "overrides must be a mapping"),
        ("scale: smoke\nparallel: 0\n", "parallel must be a positive int"),
        ("scale: smoke\nsteps: 0\n", "steps must be a positive int"),
        ("scale: smoke\nlevels: []\n", "levels must be a non-empty list"),
        ("scale: smoke\nseeds: [1, 1]\n", "seeds must be distinct"),
        ("scale: smoke\ntime_budget: -1\n", "time_budget must be >= 0"),
        ("scale: smoke\noverrides: {data_seed: 3}\n", "'data_seed': the run seed sets it"),
        ("levels: [aligned]\n", "give --scale or a --study file that names a scale"),
    ],
)
def test_bad_study_files_are_errors(tmp_path, text, match):
    path = tmp_path / "study.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        ablate.resolve_study(_args("--study", str(path), "--output", str(tmp_path)))


def test_the_key_preset_is_an_error_naming_scale(tmp_path):
    """A study file or DIR/study.json with the key ``preset`` is an error naming the file and the key
    ``scale`` (renaming the key is enough: the fingerprint of the sizes does not depend on it)."""
    path = tmp_path / "old.yaml"
    path.write_text("preset: smoke\nlevels: [aligned]\n")
    with pytest.raises(ValueError, match=r"old.yaml: a study names its scale with the key 'scale', not 'preset'"):
        ablate.resolve_study(_args("--study", str(path), "--output", str(tmp_path)))
    study = Study(SCALES["smoke"]).to_dict()
    assert "preset" not in study and study["scale"]["name"] == "smoke"  # what study.json holds
    study["preset"] = study.pop("scale")
    (tmp_path / "study.json").write_text(json.dumps(study))
    with pytest.raises(ValueError, match=r"study.json: a study names its scale with the key 'scale', not 'preset'"):
        ablate.run(_args("--output", str(tmp_path), "--run", "aligned/tis/0"))


def test_missing_study_file_and_child_without_study_are_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="study file not found"):
        ablate.resolve_study(_args("--study", str(tmp_path / "nope.yaml"), "--output", str(tmp_path)))
    with pytest.raises(FileNotFoundError, match="study.json not found"):
        ablate.run(_args("--output", str(tmp_path), "--run", "realistic/tis/0"))


def test_seed_stats():
    s = seed_stats([1.0, None, 2.0, 4.0])
    assert s == {
        "n": 3,
        "mean": pytest.approx(7 / 3),
        "std": pytest.approx(math.sqrt(7 / 3)),
        "min": 1.0,
        "max": 4.0,
    }
    assert seed_stats([0.5]) == {"n": 1, "mean": 0.5, "std": None, "min": 0.5, "max": 0.5}
    assert seed_stats([None]) == {"n": 0, "mean": None, "std": None, "min": None, "max": None}


def _entry(seed, rewards, held, deltas, fingerprint="f", level="realistic", arm="grpo-none"):
    series = {
        "step": list(range(1, len(rewards) + 1)),
        "reward": rewards,
        "mean_abs_delta": deltas,
        "accuracy": [None] * len(rewards),
    }
    held_out = {"step": [0, len(rewards)], "accuracy": held}
    return {
        "level": level,
        "arm": arm,
        "seed": seed,
        "correction": "none",
        "description": "vanilla",
        "fingerprint": fingerprint,
        "seconds": 10.0 * (seed + 1),
        "series": series,
        "held_out": held_out,
        "summary": run_summary(series, held_out, window=1),
    }


def test_aggregation_over_seeds_from_run_files(tmp_path):
    entries = [
        _entry(0, [0.0, 1.0, 2.0], [0.2, 0.4], [0.01, 0.02, 0.03]),
        _entry(1, [1.0, 1.0, 4.0], [0.2, 0.6], [0.03, None, 0.05]),
        _entry(2, [2.0, 4.0, 6.0], [0.2, 0.5], [0.02, 0.02, 0.02]),
        _entry(0, [1.0, 2.0], [0.1, 0.1], [0.1, 0.1], arm="tis"),
    ]
    for e in entries:
        path = RunKey(e["level"], e["arm"], e["seed"]).path(tmp_path, ".json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(e))
    study = Study(SCALES["smoke"], arms=("grpo-none", "tis"), seeds=(0, 1, 2)).to_dict()
    results = aggregate(load_runs(tmp_path, "f"), {"name": "unit"}, None, study)
    assert results["study"] == {"levels": ["realistic"], "arms": ["grpo-none", "tis"], "seeds": [0, 1, 2]}
    assert results["scale"] == "unit" and "preset" not in results  # results.json names the scale
    group = results["groups"]["realistic"]["grpo-none"]
    assert group["n"] == 3 and group["seeds"] == [0, 1, 2] and group["correction"] == "none"
    last = group["summary"]["reward_last"]  # window 1: each seed's last reward 2, 4, 6
    assert (last["n"], last["mean"], last["std"], last["min"], last["max"]) == (3, 4.0, 2.0, 2.0, 6.0)
    first = group["summary"]["held_out_last"]  # 0.4, 0.6, 0.5
    assert first["mean"] == pytest.approx(0.5) and first["std"] == pytest.approx(0.1)
    step1 = group["summary"]["mean_abs_delta_step1"]  # 0.01, 0.03, 0.02
    assert step1["mean"] == pytest.approx(0.02) and step1["std"] == pytest.approx(0.01)
    run_delta = group["summary"]["mean_abs_delta"]  # per-run means 0.02, 0.04, 0.02
    assert run_delta["mean"] == pytest.approx(0.08 / 3) and run_delta["max"] == pytest.approx(0.04)
    assert group["summary"]["accuracy_last"]["n"] == 0 and group["summary"]["accuracy_last"]["mean"] is None
    assert group["seconds"]["mean"] == pytest.approx(20.0)
    band = group["series"]["reward"]
    assert band["step"] == [1, 2, 3]
    assert band["mean"] == pytest.approx([1.0, 2.0, 4.0])
    assert (band["min"], band["max"]) == ([0.0, 1.0, 2.0], [2.0, 4.0, 6.0])
    delta = group["series"]["mean_abs_delta"]  # step 2: seed 1 did not log it, so two values
    assert delta["mean"][1] == pytest.approx(0.02) and delta["min"][1] == delta["max"][1] == 0.02
    assert group["held_out"]["step"] == [0, 3] and group["held_out"]["mean"] == pytest.approx([0.2, 0.5])
    # a series no run logged stays empty: nothing is made up
    assert group["series"]["grad_norm"] == {"step": [], "mean": [], "min": [], "max": []}
    tis = results["groups"]["realistic"]["tis"]
    assert tis["n"] == 1 and tis["summary"]["reward_last"] == {
        "n": 1,
        "mean": 2.0,
        "std": None,
        "min": 2.0,
        "max": 2.0,
    }


def test_a_run_that_starts_again_drops_its_earlier_result(tmp_path, monkeypatch):
    """Without --resume a finished run is run again: once it starts, its earlier ``seed<k>.json`` (and an
    earlier partial file) are gone, so a re-run that crashes (or is cut short) leaves no stale result in the
    aggregate."""
    import triage.experiments.train as train

    key = RunKey("realistic", "grpo-none", 0)
    for suffix in (".json", ablate.PARTIAL_SUFFIX):
        path = key.path(tmp_path, suffix)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_entry(0, [1.0], [0.1, 0.2], [0.01])))
    assert key in load_runs(tmp_path)

    def crash(*args, **kwargs):
        raise RuntimeError("the re-run crashed")

    monkeypatch.setattr(train, "build_trainer", crash)
    with pytest.raises(RuntimeError, match="the re-run crashed"):
        ablate.run_one(SCALES["smoke"], key, tmp_path)
    assert not key.path(tmp_path, ".json").exists() and not key.path(tmp_path, ablate.PARTIAL_SUFFIX).exists()
    assert load_runs(tmp_path) == {}


def test_resume_checks_a_moved_study_folder_by_its_recipe_not_its_path(tmp_path):
    """A study folder copied elsewhere (off a GPU box, say) resumes; a changed numerics key is still refused."""
    import torch

    study = Study(SCALES["smoke"], arms=("tis",))
    key, cpu = study.runs()[0], not torch.cuda.is_available()
    old = tmp_path / "elsewhere" / "study"
    ran = json.loads(json.dumps(ablate.run_recipe(study.scale, key, old / "sft", key.path(old), cpu=cpu)))
    here = tmp_path / "study"
    ablate._check_recipes(study, here, {key: {"recipe": ran}})
    ran["sampler_kwargs"]["kv_cache_dtype"] = "native"
    with pytest.raises(ValueError, match=r"ran another recipe .*differs in \['sampler_kwargs'\]"):
        ablate._check_recipes(study, here, {key: {"recipe": ran}})


def test_shipped_testbed_study_files_resolve(tmp_path):
    """The study files under experiments/testbed/ name the testbed scale, known levels and arms: 300 steps
    and 3 seeds, but for the long runs (900 steps, over several calls)."""
    from pathlib import Path

    from triage.experiments.recipes import ALL_ARMS, LEVELS

    folder = Path(ablate.__file__).parent / "testbed"
    files = sorted(folder.glob("*.yaml"))
    assert {f.name for f in files} >= {
        "dose-response.yaml",
        "corrections.yaml",
        "isolation.yaml",
        "long.yaml",
    }
    for f in files:
        study = ablate.resolve_study(_args("--study", str(f), "--output", str(tmp_path)))
        assert study.scale.name == "testbed", f
        assert set(study.levels) <= set(LEVELS) and set(study.arms) <= set(ALL_ARMS), f
        if f.name == "learner-precision.yaml":  # its runs' learners at step 100, before the collapses
            assert study.save_models == (100,)
        if f.name == "long.yaml":
            assert study.levels == ("aligned", "nvfp4-coarse-fp8kv") and study.arms == ("grpo-none",)
            assert study.seeds == (0, 1) and study.scale.steps == 900 and study.time_budget is not None
        else:
            assert study.scale.steps == 300 and len(study.seeds) >= 3 and study.runs(), f
