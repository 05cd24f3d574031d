"""``triage ablate``: the smoke preset end to end (every arm, results.json, PNG, table, resume, time budget)
and unit tests of the series extraction, summaries, aggregation, table and recipes."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import pytest

from triage.experiments import ablate
from triage.experiments.ablate import (
    PRESETS,
    AblationPreset,
    arm_recipe,
    arm_series,
    arm_summary,
    load_arm_results,
    markdown_table,
    mini,
    write_results,
)
from triage.experiments.recipes import ARMS
from triage.experiments.sft import SFTConfig
from triage.trainers.report import CLASSES

TRIAGE_FIELDS = {
    "description",
    "correction",
    "tau",
    "consistent",
    "correct_up",
    "correct_down",
    "amplify_up",
    "amplify_down",
    "is_cap",
    "soft_rate",
    "tail_floor",
    "guard_kappa",
    "icepop_low",
    "icepop_high",
    "opsm_threshold",
    "output_dir",
}


def _args(output, *extra):
    parser = argparse.ArgumentParser()
    ablate.add_arguments(parser)
    return parser.parse_args(["--preset", "smoke", "--output", str(output), *extra])


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The smoke preset run once through the CLI entry point (kernels' torch twins, no interpreter).

    One intra-op thread: the matrices are tiny, and on a shared 2-core machine two spinning threads per op
    made the run several times slower."""
    import torch

    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "0")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("ablate") / "smoke"
    try:
        assert ablate.run(_args(out)) == 0
    finally:
        torch.set_num_threads(threads)
        mp.undo()
    return out


def test_smoke_preset_writes_results_png_and_table_for_every_arm(smoke):
    results = json.loads((smoke / "results.json").read_text())
    preset = PRESETS["smoke"]
    assert list(results["arms"]) == list(ARMS) and results["preset"] == "smoke"
    assert results["sft"]["steps_done"] == preset.sft.steps and (smoke / "sft" / "config.json").is_file()
    for name, arm in results["arms"].items():
        series = arm["series"]
        assert series["step"] == list(range(1, preset.steps + 1)), name
        for key in (
            "reward",
            "entropy",
            "mean_abs_delta",
            "suppressed_frac",
            "accuracy",
            "completion_length",
        ):
            assert all(v is not None and math.isfinite(v) for v in series[key]), (name, key)
        for i in range(preset.steps):
            assert sum(series[f"share/{c}"][i] for c in CLASSES) == pytest.approx(1.0), (name, i)
        assert all(v > 0 for v in series["mean_abs_delta"])  # NVFP4 learner vs NVFP4 sampler: a real gap
        assert arm["held_out"]["step"] == [0, preset.steps]
        assert len(arm["held_out"]["accuracy"]) == 2 and arm["summary"]["steps"] == preset.steps
        # the realistic mismatch of the brief, in every arm
        recipe = arm["recipe"]
        assert recipe["learner_precision"] == "nvfp4" and recipe["quant_recipe"]["scale"] == "tensor"
        kw = recipe["sampler_kwargs"]
        assert kw["precision"] == "nvfp4" and kw["quant_recipe"]["scale"] == "row"
        assert kw["kv_cache_dtype"] == "fp8_e4m3"
    png = (smoke / "ablation.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    table = (smoke / "results.md").read_text()
    assert all(f"| {name} |" in table for name in ARMS)


def test_arms_share_checkpoint_seeds_and_data(smoke):
    """Step 1 runs the same checkpoint on the same prompts with the same sampler seed in every arm, so every
    sampled quantity is identical; only what the correction does with it differs."""
    arms = json.loads((smoke / "results.json").read_text())["arms"]
    first = {name: {k: v[0] for k, v in arm["series"].items()} for name, arm in arms.items()}
    ref = first["grpo-none"]
    for name, values in first.items():
        for key in (
            "reward",
            "entropy",
            "mean_abs_delta",
            "completion_length",
            *[f"share/{c}" for c in CLASSES],
        ):
            assert values[key] == pytest.approx(ref[key], rel=1e-6, abs=1e-9), (name, key)
        assert arms[name]["held_out"]["accuracy"][0] == arms["grpo-none"]["held_out"]["accuracy"][0]
    # the corrections act: vanilla GRPO keeps every token, the token-level IS corrections cut some
    assert ref["suppressed_frac"] == 0.0
    assert first["tis"]["suppressed_frac"] > 0 and first["triage"]["suppressed_frac"] > 0
    # and the recipes differ only in the correction's fields
    recipes = {name: arm["recipe"] for name, arm in arms.items()}
    shared = {k: v for k, v in recipes["grpo-none"].items() if k not in TRIAGE_FIELDS}
    for name, recipe in recipes.items():
        assert {k: v for k, v in recipe.items() if k not in TRIAGE_FIELDS} == shared, name


def test_resume_skips_finished_arms_and_reuses_sft(smoke, capsys):
    before = {a: (smoke / "arms" / f"{a}.json").stat().st_mtime_ns for a in ARMS}
    assert ablate.run(_args(smoke, "--resume", "--arms", "grpo-none,triage")) == 0
    out = capsys.readouterr().out
    assert "0 arm(s) to run" in out and "2 already done" in out and "reusing the checkpoint" in out
    assert {a: (smoke / "arms" / f"{a}.json").stat().st_mtime_ns for a in ARMS} == before
    assert len(json.loads((smoke / "results.json").read_text())["arms"]) == len(ARMS)


def test_time_budget_stops_before_an_arm(smoke, capsys):
    before = (smoke / "arms" / "tis.json").stat().st_mtime_ns
    assert ablate.run(_args(smoke, "--arms", "tis", "--time-budget", "0")) == 0
    assert "stopping before tis" in capsys.readouterr().out
    assert (smoke / "arms" / "tis.json").stat().st_mtime_ns == before


def test_arms_of_another_config_are_refused(smoke):
    with pytest.raises(ValueError, match=r"grpo-none.json was produced by another preset config"):
        ablate.run(_args(smoke, "--steps", "3"))


def test_bad_arm_and_bad_override_are_errors(tmp_path):
    with pytest.raises(ValueError, match=r"unknown arms \['vanilla'\]"):
        ablate.run(_args(tmp_path, "--arms", "grpo-none,vanilla"))
    with pytest.raises(ValueError, match="KEY=VALUE"):
        ablate.resolve_preset(_args(tmp_path, "--set", "learning_rate"))
    assert not (tmp_path / "sft").exists()  # nothing was trained


def test_repeated_set_flags_accumulate_and_parse_like_recipe_overrides(tmp_path):
    args = _args(tmp_path, "--set", "learning_rate=3e-5", "--set", "save_strategy=no", "seed=1")
    overrides = ablate.resolve_preset(args).overrides
    assert (
        overrides["learning_rate"] == 3e-5 and overrides["save_strategy"] == "no" and overrides["seed"] == 1
    )


# ---------------------------------------------------------------------------------------------------------
# units


def _log(step, reward, **extra):
    return {
        "step": step,
        "loss": 0.1,
        "reward": reward,
        "rewards/dapo_accuracy/mean": 2 * reward - 1,
        **extra,
    }


def test_arm_series_reads_training_records_only():
    history = [
        _log(1, 0.25, entropy=1.5, **{"triage/mean_abs_delta": 0.01, "triage/amplify_down/share": 0.1}),
        {"step": 1, "eval_reward": 9.0},  # not a training record
        _log(2, 0.5, entropy=float("nan")),
        {"step": 2, "train_runtime": 3.0, "loss": 0.2},  # the end-of-training summary
    ]
    s = arm_series(history)
    assert s["step"] == [1, 2] and s["reward"] == [0.25, 0.5]
    assert s["accuracy"] == [0.25, 0.5]  # (DAPO ±1 mean + 1) / 2
    assert s["entropy"] == [1.5, None]  # NaN is not a number to plot or average
    assert s["mean_abs_delta"] == [0.01, None] and s["share/amplify_down"] == [0.1, None]
    assert set(s) == {"step", "accuracy", *ablate.SERIES_KEYS}


def test_arm_summary_windows_and_held_out():
    series = {
        "step": list(range(1, 11)),
        "reward": [float(i) for i in range(10)],
        "accuracy": [0.1] * 10,
        "entropy": [None] * 9 + [2.0],
        "mean_abs_delta": [0.02] * 10,
        "suppressed_frac": [0.0, 1.0] * 5,
        "guarded_frac": [0.0] * 7 + [0.3] * 3,
        **{f"share/{c}": [1.0 if c == "consistent" else 0.0] * 10 for c in CLASSES},
    }
    s = arm_summary(series, {"step": [0, 5, 10], "accuracy": [0.2, 0.5, 0.4]}, window=3)
    assert s["reward_first"] == 1.0 and s["reward_last"] == 8.0 and s["entropy_last"] == 2.0
    assert (s["held_out_first"], s["held_out_last"], s["held_out_best"]) == (0.2, 0.4, 0.5)
    assert s["suppressed_frac"] == 0.5 and s["class_share"]["consistent"] == 1.0 and s["steps"] == 10
    assert s["guarded_last"] == pytest.approx(0.3)
    empty = arm_summary({"step": []}, {})
    assert empty["steps"] == 0 and empty["reward_first"] is None and empty["held_out_last"] is None


def _entry(arm, fingerprint="f", accuracy=(0.2, 0.3)):
    series = {"step": [1, 2], "reward": [0.1, 0.2], "accuracy": [0.5, 0.6], "entropy": [1.0, 0.9]}
    held = {"step": [0, 2], "accuracy": list(accuracy)}
    return {
        "arm": arm,
        "correction": arm,
        "fingerprint": fingerprint,
        "seconds": 1.0,
        "series": series,
        "held_out": held,
        "summary": arm_summary(series, held, window=1),
    }


def test_load_arm_results_orders_by_arms_and_checks_the_fingerprint(tmp_path):
    (tmp_path / "arms").mkdir()
    for arm in ("triage", "grpo-none", "tis"):
        (tmp_path / "arms" / f"{arm}.json").write_text(json.dumps(_entry(arm)))
    assert list(load_arm_results(tmp_path, "f")) == ["grpo-none", "tis", "triage"]
    assert load_arm_results(tmp_path / "nothing-here") == {}
    with pytest.raises(ValueError, match="tis.json was produced by another preset config"):
        (tmp_path / "arms" / "tis.json").write_text(json.dumps(_entry("tis", fingerprint="g")))
        load_arm_results(tmp_path, "f")


def test_table_and_files(tmp_path):
    results = ablate.aggregate(
        {"grpo-none": _entry("grpo-none"), "triage": _entry("triage", accuracy=(0.2, None))},
        {"name": "unit"},
        {"params": 10, "steps_done": 5, "final": {"accuracy": 0.25, "by_difficulty": {"1": 0.25}}},
    )
    table = markdown_table(results)
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    cells = [r.replace("\\|", "").count("|") for r in rows]  # escaped pipes (|δ|) are not separators
    assert len(rows) == 3 and cells == [cells[0]] * 3
    assert "| grpo-none | grpo-none | 20.0% → 30.0% | 0.100 → 0.200 |" in table
    assert "20.0% → –" in table  # a missing value is a dash, never a made-up number
    files = write_results(tmp_path, results)
    assert files == ["results.json", "results.md", "ablation.png"]
    assert json.loads((tmp_path / "results.json").read_text())["arms"]["triage"]["arm"] == "triage"
    assert "held-out greedy accuracy 25.0%" in (tmp_path / "results.md").read_text()


def test_presets_fingerprint_and_mini():
    local = PRESETS["local"]
    assert local.fingerprint() == dataclasses.replace(local, arm_seconds=1.0).fingerprint()
    assert local.fingerprint() != dataclasses.replace(local, steps=local.steps + 1).fingerprint()
    small = mini(local)
    assert small.name == "local-mini" and small.sft.difficulty == local.sft.difficulty
    assert small.sft.hidden_size < local.sft.hidden_size and small.steps <= 3
    for name in ("hidden_size", "intermediate_size"):  # NVFP4 blocks of 16 along K
        assert getattr(local.sft, name) % 16 == 0
    with pytest.raises(ValueError, match="generations must be >= 2"):
        dataclasses.replace(local, generations=1)
    with pytest.raises(ValueError, match="n_eval"):
        AblationPreset("x", SFTConfig(n_eval=4), 1, 1, 2, 8, 1e-4, n_eval=8)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_arm_recipes_validate_and_build(name, tmp_path):
    from triage.experiments.recipes import build_config, validate_recipe

    preset = PRESETS[name]
    for arm in ARMS:
        recipe = arm_recipe(preset, arm, tmp_path / "sft", tmp_path / arm, cpu=True)
        validate_recipe(recipe, build=True)
        config = build_config(recipe, output_dir=str(tmp_path / arm))
        assert config.max_steps == preset.steps and config.num_generations == preset.generations
        assert config.generation_batch_size == config.per_device_train_batch_size  # one update per generation
        assert recipe["dataset"]["held_out"] == preset.sft.n_eval and recipe["eval_dataset"] is None
        assert recipe["reward_funcs"][1]["soft_overlong"]["cache_length"] == preset.max_completion_length // 4
