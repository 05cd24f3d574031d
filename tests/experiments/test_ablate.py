"""``triage ablate``: the smoke scale end to end (every arm at the default level, results.json, figure, table,
resume, time budget), the other levels on CPU, parallel child processes with a crashing run, and unit tests
of the series extraction, summaries, recipes and scales. Aggregation and study files: test_study.py."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time

import pytest

from triage.experiments import ablate
from triage.experiments.ablate import (
    SCALES,
    RunKey,
    StudyScale,
    load_runs,
    markdown_table,
    mini,
    run_recipe,
    run_series,
    run_summary,
    write_results,
)
from triage.experiments.recipes import ARMS, LEVELS
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


def _args(output, *extra, scale="smoke"):
    parser = argparse.ArgumentParser()
    ablate.add_arguments(parser)
    return parser.parse_args([*(["--scale", scale] if scale else []), "--output", str(output), *extra])


def _run(key: str, out):
    return json.loads(RunKey.parse(key).path(out, ".json").read_text())


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, torch_twins):
    """The smoke scale run once through the CLI entry point (kernels' torch twins, one thread: ``torch_twins``)."""
    out = tmp_path_factory.mktemp("ablate") / "smoke"
    assert ablate.run(_args(out)) == 0
    return out


def test_smoke_scale_writes_results_figure_and_table_for_every_arm(smoke):
    results = json.loads((smoke / "results.json").read_text())
    scale = SCALES["smoke"]
    assert list(results["groups"]["realistic"]) == list(ARMS) and results["scale"] == "smoke"
    assert results["sft"]["steps_done"] == scale.sft.steps and (smoke / "sft" / "config.json").is_file()
    for name in ARMS:
        run = _run(f"realistic/{name}/0", smoke)
        assert (run["level"], run["arm"], run["seed"]) == ("realistic", name, 0)
        assert run["params"] == results["sft"]["params"] > 0
        assert (RunKey("realistic", name, 0).path(smoke, ".log")).read_text().count("step ") >= scale.steps
        series = run["series"]
        assert series["step"] == list(range(1, scale.steps + 1)), name
        for key in (
            "reward",
            "entropy",
            "mean_abs_delta",
            "suppressed_frac",
            "accuracy",
            "completion_length",
            "grad_norm",
        ):
            assert all(v is not None and math.isfinite(v) for v in series[key]), (name, key)
        for i in range(scale.steps):
            assert sum(series[f"share/{c}"][i] for c in CLASSES) == pytest.approx(1.0), (name, i)
        assert all(v > 0 for v in series["mean_abs_delta"])  # NVFP4 learner vs NVFP4 sampler: a real gap
        assert run["mean_abs_delta_step1"] == series["mean_abs_delta"][0]
        assert run["complete"] is True and run["stopped_by"] == "steps"
        assert run["held_out"]["step"] == [0, scale.steps]
        assert len(run["held_out"]["accuracy"]) == 2 and run["summary"]["steps"] == scale.steps
        # the realistic mismatch, in every arm
        recipe = run["recipe"]
        assert recipe["learner_precision"] == "nvfp4" and recipe["quant_recipe"]["scale"] == "tensor"
        kw = recipe["sampler_kwargs"]
        assert kw["precision"] == "nvfp4" and kw["quant_recipe"]["scale"] == "row"
        assert kw["kv_cache_dtype"] == "fp8_e4m3" and kw["seed"] == 0
        assert (recipe["seed"], recipe["data_seed"]) == (0, 0)
        group = results["groups"]["realistic"][name]
        assert group["n"] == 1 and group["seeds"] == [0]
        assert group["summary"]["reward_last"]["mean"] == run["summary"]["reward_last"]
        assert group["summary"]["reward_last"]["std"] is None  # one seed: no spread
    png = (smoke / "ablation-realistic.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    table = (smoke / "results.md").read_text()
    assert all(f"| realistic | {name} | 1 |" in table for name in ARMS)
    rows = [line for line in table.splitlines() if line.startswith("| realistic |")]
    assert len(rows) == len(ARMS) and not any(" ± " in r for r in rows)  # one seed: plain values


def test_arms_share_checkpoint_seeds_and_data(smoke):
    """Step 1 runs the same checkpoint on the same prompts with the same sampler seed in every arm, so every
    sampled quantity is identical; only what the correction does with it differs."""
    runs = {name: _run(f"realistic/{name}/0", smoke) for name in ARMS}
    first = {name: {k: v[0] for k, v in run["series"].items()} for name, run in runs.items()}
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
        assert runs[name]["held_out"]["accuracy"][0] == runs["grpo-none"]["held_out"]["accuracy"][0]
    # the corrections act: vanilla GRPO keeps every token, the token-level IS corrections cut some
    assert ref["suppressed_frac"] == 0.0
    assert first["tis"]["suppressed_frac"] > 0 and first["triage"]["suppressed_frac"] > 0
    # and the recipes differ only in the correction's fields
    recipes = {name: run["recipe"] for name, run in runs.items()}
    shared = {k: v for k, v in recipes["grpo-none"].items() if k not in TRIAGE_FIELDS}
    for name, recipe in recipes.items():
        assert {k: v for k, v in recipe.items() if k not in TRIAGE_FIELDS} == shared, name


def test_other_levels_run_on_cpu_with_their_numerics(smoke):
    """Three more levels at the smoke scale: each runs its own numerics; `aligned` (the fp32 learner samples
    itself) has no gap at step 1, the others a real one."""
    levels = ("aligned", "nvfp4-matched", "realistic-bf16-learner")
    assert ablate.run(_args(smoke, "--levels", ",".join(levels), "--arms", "grpo-none", "--no-plots")) == 0
    runs = {lv: _run(f"{lv}/grpo-none/0", smoke) for lv in (*levels, "realistic")}
    kw = {lv: run["recipe"]["sampler_kwargs"] for lv, run in runs.items()}
    learner = {lv: run["recipe"]["learner_precision"] for lv, run in runs.items()}
    assert learner == {
        "aligned": "bf16",
        "nvfp4-matched": "nvfp4",
        "realistic-bf16-learner": "bf16",
        "realistic": "nvfp4",
    }
    assert kw["aligned"] == {"sampler_model": "shared", "kv_cache_dtype": "native", "seed": 0}
    assert kw["nvfp4-matched"]["quant_recipe"] == runs["nvfp4-matched"]["recipe"]["quant_recipe"]
    assert kw["realistic-bf16-learner"]["quant_recipe"]["scale"] == "tensor"
    assert kw["realistic-bf16-learner"]["kv_cache_dtype"] == "fp8_e4m3"
    delta = {lv: run["mean_abs_delta_step1"] for lv, run in runs.items()}
    assert delta["aligned"] < 1e-4, delta
    assert all(delta[lv] > 1e-3 for lv in runs if lv != "aligned"), delta


def test_resume_skips_finished_runs_and_reuses_sft(smoke, capsys):
    paths = [RunKey("realistic", a, 0).path(smoke, ".json") for a in ARMS]
    before = [p.stat().st_mtime_ns for p in paths]
    assert ablate.run(_args(smoke, "--resume", "--arms", "grpo-none,triage")) == 0
    out = capsys.readouterr().out
    assert "0 run(s) to run" in out and "2 already done" in out and "reusing the checkpoint" in out
    assert "runs: 2 skipped" in out
    assert [p.stat().st_mtime_ns for p in paths] == before
    assert len(json.loads((smoke / "results.json").read_text())["groups"]["realistic"]) == len(ARMS)


def test_resume_refuses_a_run_whose_recipe_changed(smoke, tmp_path):
    """An edited level or arm file must not mix stale runs into the results."""
    path = RunKey("realistic", "tis", 0).path(smoke, ".json")
    text = path.read_text()
    entry = json.loads(text)
    entry["recipe"]["sampler_kwargs"]["kv_cache_dtype"] = "native"
    try:
        path.write_text(json.dumps(entry))
        with pytest.raises(ValueError, match=r"seed0.json ran another recipe.*\['sampler_kwargs'\]"):
            ablate.run(_args(smoke, "--resume", "--arms", "tis"))
    finally:
        path.write_text(text)


def test_time_budget_starts_no_run_that_would_not_fit(smoke, capsys):
    path = RunKey("realistic", "tis", 0).path(smoke, ".json")
    before = path.stat().st_mtime_ns
    assert ablate.run(_args(smoke, "--arms", "tis", "--time-budget", "0")) == 0
    out = capsys.readouterr().out
    assert "1 run(s) not started" in out and "runs: 1 not started" in out
    assert path.stat().st_mtime_ns == before


def test_a_run_past_its_deadline_stops_cleanly_and_is_not_saved(smoke, capsys):
    """The child entry point (what --parallel starts) with a deadline the run cannot meet: it stops after a
    step, writes no result and exits with the cut-short status, which the parent reports as such. The
    deadline is already due when the run starts (however fast its steps): a cut loses no step, so it still
    takes step 1, then stops."""
    key = RunKey("realistic", "icepop", 9)
    args = _args(smoke, "--run", str(key), "--deadline", repr(time.time()), scale=None)
    assert ablate.run(args) == ablate.EXIT_CUT_SHORT
    assert "stopped by the time budget after step 1/2; not finished" in capsys.readouterr().out
    assert not key.path(smoke, ".json").exists()
    partial = json.loads(key.path(smoke, ".partial.json").read_text())  # what it ran, for inspection
    assert partial["complete"] is False and partial["stopped_by"] == "time_budget"
    assert partial["series"]["step"] == [1] and partial["held_out"]["step"] == [0, 1]
    assert key not in load_runs(smoke)  # never aggregated
    assert (key.path(smoke) / "checkpoint-1" / ablate.RUN_STATE_FILE).is_file()  # what --resume continues


def test_a_child_with_resume_continues_a_run_cut_short(smoke, capsys):
    """``--run KEY --resume`` (what --parallel starts under --resume) continues the run from the checkpoint
    its cut left, to a finished ``seed<k>.json`` that records the resume step; the checkpoint is removed."""
    key = RunKey("realistic", "icepop", 8)
    cut = _args(smoke, "--run", str(key), "--deadline", repr(time.time()), scale=None)  # cut after step 1
    assert ablate.run(cut) == ablate.EXIT_CUT_SHORT
    assert ablate.run(_args(smoke, "--run", str(key), "--resume", scale=None)) == 0
    assert f"{key}: resuming from {key.path(smoke) / 'checkpoint-1'} (step 1/2)" in capsys.readouterr().out
    run = _run(str(key), smoke)
    assert run["complete"] is True and run["resumed_at"] == [1] and run["series"]["step"] == [1, 2]
    assert run["held_out"]["step"] == [0, 2]  # the cut's off-schedule measurement stayed in the partial
    assert not key.path(smoke, ".partial.json").exists() and not list(key.path(smoke).glob("checkpoint-*"))


def test_parallel_children_resume_and_a_crashing_run(smoke, capsys):
    """--parallel 2 runs two seeds at once as child processes, --resume skips the seed that is done, and a
    run that crashes (its output folder is blocked by a file) is named with its log; the others finish. The
    children save their learners after the steps of --save-models (they read them from study.json)."""
    crash = RunKey("realistic", "tis", 3)
    crash.path(smoke).parent.mkdir(parents=True, exist_ok=True)
    crash.path(smoke).write_text("not a folder")
    flags = ("--arms", "tis", "--seeds", "0,1,2,3", "--parallel", "2", "--save-models", "2")
    args = _args(smoke, *flags, "--resume", "--no-plots")
    assert ablate.run(args) == 1  # a run failed
    out = capsys.readouterr().out
    assert "runs: 1 skipped" in out and "2 done" in out and "1 failed" in out
    assert f"failed: {crash} (traceback in {crash.path(smoke, '.log')})" in out
    assert "File exists" in out  # the child's one-line error (triage: error: ...), in the parent's summary
    log = crash.path(smoke, ".log").read_text()
    assert "Traceback (most recent call last)" in log and "FileExistsError" in log
    assert not crash.path(smoke, ".json").exists()
    one, two = (_run(f"realistic/tis/{s}", smoke) for s in (1, 2))
    assert one["started"] < two["finished"] and two["started"] < one["finished"]  # they ran at once
    assert one["series"]["reward"][0] != pytest.approx(two["series"]["reward"][0]) or (
        one["series"]["entropy"][0] != pytest.approx(two["series"]["entropy"][0])
    )  # other prompts, other samples
    child_log = RunKey("realistic", "tis", 1).path(smoke, ".log").read_text()
    assert "step   2/2" in child_log  # the child's own log
    assert "no checkpoint in" in child_log and "starting from step 0" in child_log  # it got --resume
    for s in (1, 2):
        assert _run(f"realistic/tis/{s}", smoke)["models"] == [f"runs/realistic/tis/seed{s}/model-step2"]
        assert (RunKey("realistic", "tis", s).path(smoke) / "model-step2" / "model.safetensors").is_file()
    group = json.loads((smoke / "results.json").read_text())["groups"]["realistic"]["tis"]
    runs = [_run(f"realistic/tis/{s}", smoke) for s in (0, 1, 2)]
    assert group["n"] == 3 and group["seeds"] == [0, 1, 2]
    rewards = [r["summary"]["reward_last"] for r in runs]
    stats = group["summary"]["reward_last"]
    assert stats["mean"] == pytest.approx(statistics.fmean(rewards))
    assert stats["std"] == pytest.approx(statistics.stdev(rewards))
    assert (stats["min"], stats["max"]) == (min(rewards), max(rewards))


def test_in_process_crash_is_logged_and_reported(smoke, capsys):
    crash = RunKey("realistic", "opsm", 4)
    crash.path(smoke).parent.mkdir(parents=True, exist_ok=True)
    crash.path(smoke).write_text("not a folder")
    assert ablate.run(_args(smoke, "--arms", "opsm", "--seeds", "4", "--no-plots")) == 1
    assert f"{crash} FAILED: FileExistsError" in capsys.readouterr().out
    assert "Traceback" in crash.path(smoke, ".log").read_text()


def test_runs_of_another_config_are_refused(smoke):
    with pytest.raises(ValueError, match=r"seed0.json was produced by another study scale"):
        ablate.run(_args(smoke, "--steps", "3"))


def test_bad_names_and_overrides_are_errors(tmp_path):
    with pytest.raises(ValueError, match=r"unknown arms \['vanilla'\]"):
        ablate.run(_args(tmp_path, "--arms", "grpo-none,vanilla"))
    with pytest.raises(ValueError, match=r"unknown levels \['exact'\]"):
        ablate.run(_args(tmp_path, "--levels", "exact"))
    with pytest.raises(ValueError, match="seeds must be distinct non-negative ints"):
        ablate.run(_args(tmp_path, "--seeds", "0,x"))
    with pytest.raises(ValueError, match="KEY=VALUE"):
        ablate.resolve_study(_args(tmp_path, "--set", "learning_rate"))
    with pytest.raises(ValueError, match="'seed': the run seed sets it; choose the seeds with --seeds"):
        ablate.resolve_study(_args(tmp_path, "--set", "seed=1"))
    with pytest.raises(ValueError, match="'sampler_kwargs.seed': the run seed sets it"):
        ablate.resolve_study(_args(tmp_path, "--set", "sampler_kwargs.seed=1"))
    with pytest.raises(ValueError, match="give --scale or a --study file"):
        ablate.resolve_study(_args(tmp_path, scale=None))
    assert not (tmp_path / "sft").exists()  # nothing was trained


def test_repeated_set_flags_accumulate_and_parse_like_recipe_overrides(tmp_path):
    args = _args(tmp_path, "--set", "learning_rate=3e-5", "--set", "save_strategy=no", "top_k=4")
    overrides = ablate.resolve_study(args).scale.overrides
    assert (
        overrides["learning_rate"] == 3e-5 and overrides["save_strategy"] == "no" and overrides["top_k"] == 4
    )


def test_seeds_set_prompt_order_and_sampler_stream(smoke):
    """A run's seed sets TRL's prompt order (RepeatSampler follows ``seed``), ``data_seed`` and the sampler's
    generator; within a seed the order is reproducible."""
    import torch

    from triage.experiments.train import build_trainer

    def trainer(seed):
        key = RunKey("realistic", "grpo-none", seed)
        recipe = run_recipe(SCALES["smoke"], key, smoke / "sft", smoke / "unused" / str(seed), cpu=True)
        return build_trainer(recipe, recipe["output_dir"])

    t0, t0b, t1 = trainer(0), trainer(0), trainer(1)
    order = {name: list(t._get_train_sampler()) for name, t in (("0", t0), ("0b", t0b), ("1", t1))}
    assert order["0"] == order["0b"] and order["0"] != order["1"]
    assert sorted(order["0"]) == sorted(order["1"])  # the same prompts, in another order
    assert (t0.args.seed, t0.args.data_seed, t1.args.seed, t1.args.data_seed) == (0, 0, 1, 1)
    streams = {}
    for name, t in (("0", t0), ("0b", t0b), ("1", t1)):
        source = t._sampler_source()
        source.rank = 0
        streams[name] = torch.rand(4, generator=source._generator_for(torch.device("cpu")))
    assert torch.equal(streams["0"], streams["0b"]) and not torch.equal(streams["0"], streams["1"])


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


def test_run_series_reads_training_records_only():
    history = [
        _log(
            1,
            0.25,
            entropy=1.5,
            grad_norm=0.5,
            **{"triage/mean_abs_delta": 0.01, "triage/amplify_down/share": 0.1},
        ),
        {"step": 1, "eval_reward": 9.0},  # not a training record
        _log(2, 0.5, entropy=float("nan")),
        {"step": 2, "train_runtime": 3.0, "loss": 0.2},  # the end-of-training summary
    ]
    s = run_series(history)
    assert s["step"] == [1, 2] and s["reward"] == [0.25, 0.5]
    assert s["accuracy"] == [0.25, 0.5]  # (DAPO ±1 mean + 1) / 2
    assert s["entropy"] == [1.5, None]  # NaN is not a number to plot or average
    assert s["grad_norm"] == [0.5, None]  # TRL's grad_norm
    assert s["mean_abs_delta"] == [0.01, None] and s["share/amplify_down"] == [0.1, None]
    assert set(s) == {"step", "accuracy", *ablate.SERIES_KEYS}


def test_run_summary_windows_and_held_out():
    series = {
        "step": list(range(1, 11)),
        "reward": [float(i) for i in range(10)],
        "accuracy": [0.1] * 10,
        "entropy": [None] * 9 + [2.0],
        "mean_abs_delta": [0.03] + [0.02] * 9,
        "grad_norm": [1.0, 5.0] + [2.0] * 8,
        "suppressed_frac": [0.0, 1.0] * 5,
        "guarded_frac": [0.0] * 7 + [0.3] * 3,
        **{f"share/{c}": [1.0 if c == "consistent" else 0.0] * 10 for c in CLASSES},
    }
    s = run_summary(series, {"step": [0, 5, 10], "accuracy": [0.2, 0.5, 0.4]}, window=3)
    assert s["reward_first"] == 1.0 and s["reward_last"] == 8.0 and s["entropy_last"] == 2.0
    assert (s["held_out_first"], s["held_out_last"], s["held_out_best"]) == (0.2, 0.4, 0.5)
    assert s["suppressed_frac"] == 0.5 and s["class_share"]["consistent"] == 1.0 and s["steps"] == 10
    assert s["guarded_last"] == pytest.approx(0.3)
    assert s["mean_abs_delta_step1"] == 0.03 and s["mean_abs_delta"] == pytest.approx(0.021)
    assert (s["grad_norm_last"], s["grad_norm_max"]) == (2.0, 5.0)
    assert set(ablate.SUMMARY_KEYS) <= set(s)
    empty = run_summary({"step": []}, {})
    assert empty["steps"] == 0 and empty["reward_first"] is None and empty["held_out_last"] is None
    assert empty["mean_abs_delta_step1"] is None and empty["grad_norm_max"] is None


def _entry(level, arm, seed, fingerprint="f"):
    series = {"step": [1, 2], "reward": [0.1, 0.2], "accuracy": [0.5, 0.6], "entropy": [1.0, 0.9]}
    held = {"step": [0, 2], "accuracy": [0.2, 0.3]}
    return {
        "level": level,
        "arm": arm,
        "seed": seed,
        "correction": arm,
        "fingerprint": fingerprint,
        "seconds": 1.0,
        "series": series,
        "held_out": held,
        "summary": run_summary(series, held, window=1),
    }


def _write(out, entry):
    path = RunKey(entry["level"], entry["arm"], entry["seed"]).path(out, ".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(entry))


def test_load_runs_orders_by_level_arm_seed_and_checks_the_fingerprint(tmp_path):
    for level, arm, seed in [
        ("realistic", "triage", 1),
        ("aligned", "tis", 0),
        ("realistic", "grpo-none", 10),
        ("realistic", "grpo-none", 2),
    ]:
        _write(tmp_path, _entry(level, arm, seed))
    assert [str(k) for k in load_runs(tmp_path, "f")] == [
        "aligned/tis/0",
        "realistic/grpo-none/2",
        "realistic/grpo-none/10",
        "realistic/triage/1",
    ]
    assert load_runs(tmp_path / "nothing-here") == {}
    _write(tmp_path, _entry("aligned", "tis", 0, fingerprint="g"))
    with pytest.raises(ValueError, match="aligned/tis/seed0.json was produced by another study scale"):
        load_runs(tmp_path, "f")


def test_run_key_text_and_paths(tmp_path):
    key = RunKey.parse("nvfp4-matched/triage-mask/12")
    assert (key.level, key.arm, key.seed) == ("nvfp4-matched", "triage-mask", 12) and str(
        key
    ) == "nvfp4-matched/triage-mask/12"
    assert key.path(tmp_path, ".json") == tmp_path / "runs" / "nvfp4-matched" / "triage-mask" / "seed12.json"
    for bad in ("realistic/tis", "realistic/tis/x", "a/b/c/1"):
        with pytest.raises(ValueError, match="LEVEL/ARM/SEED"):
            RunKey.parse(bad)


def test_table_and_files(tmp_path):
    runs = {RunKey("realistic", "grpo-none", 0): _entry("realistic", "grpo-none", 0)}
    for seed, last in ((0, 0.3), (1, 0.5)):
        entry = _entry("aligned", "triage", seed)
        entry["held_out"]["accuracy"][-1] = last
        entry["summary"] = run_summary(entry["series"], entry["held_out"], window=1)
        runs[RunKey("aligned", "triage", seed)] = entry
    results = ablate.aggregate(
        runs,
        {"name": "unit"},
        {"params": 10, "steps_done": 5, "final": {"accuracy": 0.25, "by_difficulty": {"1": 0.25}}},
    )
    table = markdown_table(results)
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    cells = [r.replace("\\|", "").count("|") for r in rows]  # escaped pipes (|δ|) are not separators
    assert len(rows) == 3 and cells == [cells[0]] * 3
    assert "| realistic | grpo-none | 1 | 20.0% → 30.0% | 30.0% | 0.100 → 0.200 |" in table
    assert "| aligned | triage | 2 | 20.0% ± 0.0% → 40.0% ± 14.1% |" in table  # mean ± sample std
    assert "| – |" in table  # a missing value is a dash, never a made-up number
    files = write_results(tmp_path, results)
    assert files == ["results.json", "results.md", "ablation-realistic.png", "ablation-aligned.png"]
    assert json.loads((tmp_path / "results.json").read_text())["groups"]["aligned"]["triage"]["n"] == 2
    assert "held-out greedy accuracy 25.0%" in (tmp_path / "results.md").read_text()
    png = (tmp_path / "ablation-aligned.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_scales_fingerprint_round_trip_and_mini():
    local = SCALES["local"]
    assert local.fingerprint() == dataclasses.replace(local, arm_seconds=1.0).fingerprint()
    assert local.fingerprint() != dataclasses.replace(local, steps=local.steps + 1).fingerprint()
    custom = dataclasses.replace(local, overrides={"quant_recipe.scale": "row"})
    again = StudyScale.from_dict(json.loads(json.dumps(custom.to_dict())))  # DIR/study.json
    assert again == custom and again.fingerprint() == custom.fingerprint()
    small = mini(local)
    assert small.name == "local-mini" and small.sft.difficulty == local.sft.difficulty
    assert small.sft.model.hidden_size < local.sft.model.hidden_size and small.steps <= 3
    for name in ("hidden_size", "intermediate_size"):  # NVFP4 blocks of 16 along K
        assert getattr(local.sft.model, name) % 16 == 0
    with pytest.raises(ValueError, match="generations must be >= 2"):
        dataclasses.replace(local, generations=1)
    with pytest.raises(ValueError, match="n_eval"):
        StudyScale("x", SFTConfig(n_eval=4), 1, 1, 2, 8, 1e-4, n_eval=8)


@pytest.mark.parametrize("name", sorted(SCALES))
def test_run_recipes_validate_and_build(name, tmp_path):
    from triage.experiments.recipes import build_config, validate_recipe

    scale = SCALES[name]
    for level in LEVELS:
        for arm in ARMS:
            key = RunKey(level, arm, 7)
            recipe = run_recipe(scale, key, tmp_path / "sft", tmp_path / arm, cpu=True)
            validate_recipe(recipe, build=True)
            config = build_config(recipe, output_dir=str(tmp_path / arm))
            assert config.max_steps == scale.steps and config.num_generations == scale.generations
            assert (
                config.generation_batch_size == config.per_device_train_batch_size
            )  # one update per generation
            assert recipe["dataset"]["held_out"] == scale.sft.n_eval and recipe["eval_dataset"] is None
            assert (
                recipe["reward_funcs"][1]["soft_overlong"]["cache_length"] == scale.max_completion_length // 4
            )
            assert (config.seed, config.data_seed, recipe["sampler_kwargs"]["seed"]) == (7, 7, 7)


def test_scale_fingerprints_are_pinned():
    """The fingerprints of the built-in scales (study folders on disk are resumed and aggregated by them)."""
    assert {name: p.fingerprint() for name, p in SCALES.items()} == {
        "smoke": "aa2ba77ebb57b650",
        "local": "f871e4389902b3be",
        "testbed": "b417477eb28a0467",
    }
