"""`triage demo`, `triage train --config`, and the run report."""

from __future__ import annotations

import json

import pytest
import yaml
from trainer_testkit import TINY_RECIPE

from triage.cli import main
from triage.trainers.report import CLASSES, format_summary, summarize, write_report


def _fake_history():
    history = []
    for step, (n, consistent, reward) in enumerate([(10, 0.5, -1.0), (30, 0.9, -0.5)], start=1):
        entry = {"step": step, "loss": 0.1, "reward": reward, "triage/tokens": n, "triage/tau": 0.05}
        entry["triage/mean_abs_delta"] = 0.01 * step
        for c in CLASSES:
            entry[f"triage/{c}/share"] = consistent if c == "consistent" else (1 - consistent) / 5
            entry[f"triage/{c}/mean_weight"] = 0.5 if c == "amplify_down" else 1.0
        history.append(entry)
    history.append({"step": 2, "train_runtime": 1.0, "train_loss": 0.1})
    return history


def test_report_is_token_weighted_and_writes_files(tmp_path):
    report = write_report(_fake_history(), tmp_path, config={"correction": "triage"})
    s = report["summary"]
    assert s["steps"] == 2 and s["reward_first"] == -1.0 and s["reward_last"] == -0.5
    assert s["class_share"]["consistent"] == pytest.approx((10 * 0.5 + 30 * 0.9) / 40)
    assert s["class_weight"]["amplify_down"] == pytest.approx(0.5)
    assert sum(s["class_share"].values()) == pytest.approx(1.0)
    assert json.loads((tmp_path / "report.json").read_text())["summary"] == json.loads(json.dumps(s))
    for name in ("reward.png", "mismatch.png", "classes.png", "weights.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    assert "consistent" in format_summary(report)
    assert summarize([]) == {"steps": 0}


def test_demo_options_come_from_flags_and_a_config_file(tmp_path, capsys, monkeypatch):
    """`triage demo` parses its flags into DemoConfig with trl.TrlParser: `--config FILE.yaml` sets fields,
    a flag beats the file, an unknown key or a bad choice is an error naming it."""
    from triage.experiments import demo

    seen = []
    monkeypatch.setattr(demo, "run", lambda args: seen.append(args) or 0)
    path = tmp_path / "demo.yaml"
    path.write_text("steps: 3\nlevel: aligned\nno_baseline: true\nlearning_rate: 1.0e-4\n")
    assert main(["demo", "--config", str(path), "--steps", "5", "--max-completion-length", "12"]) == 0
    assert seen[-1] == demo.DemoConfig(
        steps=5, level="aligned", no_baseline=True, learning_rate=1e-4, max_completion_length=12
    )
    assert main(["demo", "--no-plots"]) == 0 and seen[-1] == demo.DemoConfig(no_plots=True)
    path.write_text("stpes: 3\n")
    assert main(["demo", "--config", str(path)]) == 2
    assert "stpes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "--level", "exact"])
    assert "invalid choice: 'exact'" in capsys.readouterr().err


def test_demo_shows_a_mismatch_triage_acts_on_beside_vanilla_grpo(tmp_path, capsys, monkeypatch):
    """The demo at small size, as `triage demo` runs on a CPU (the kernels' torch twins, no interpreter)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    out = tmp_path / "demo"
    rc = main(["demo", "--output", str(out), "--steps", "2", "--prompts", "2", "--generations", "2",
               "--max-completion-length", "12"])  # fmt: skip
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    step1 = report["step1"]
    # the default sampler (NVFP4 W4A4 copy, per-token scales, fp8 KV cache) vs the fp32 learner: a gap far
    # above a bf16 copy's ~1e-3 nats, on which TRIAGE cuts a visible share of the tokens
    assert report["config"]["level"] == "nvfp4-row-fp8kv"
    assert step1["mean_abs_delta"] > 5e-3
    assert step1["suppressed_frac"] > 0.05 and step1["largest_cut"]["weight"] < 0.99
    assert step1["classes"]["amplify_down"]["share"] + step1["classes"]["amplify_up"]["share"] > 0.1
    assert sum(c["share"] for c in step1["classes"].values()) == pytest.approx(1.0)

    # vanilla GRPO beside it, from the same seed: step 1 samples the same completions
    runs = {arm: json.loads((out / arm / "report.json").read_text()) for arm in ("triage", "none")}
    assert report["same_samples"] is True and set(report["runs"]) == {"triage", "none"}
    assert runs["none"]["config"]["correction"] == "none" and runs["none"]["summary"]["steps"] == 2
    assert runs["none"]["summary"]["suppressed_frac"] == 0.0 < runs["triage"]["summary"]["suppressed_frac"]
    first = {arm: r["steps"][0] for arm, r in runs.items()}
    assert first["none"]["triage/delta_p50"] == first["triage"]["triage/delta_p50"]
    # the per-response mean δ (OPSM's statistic) is logged by the trainer too, from the same gathered δ
    assert first["none"]["triage/seq_mean_delta_p50"] == first["triage"]["triage/seq_mean_delta_p50"]
    assert first["triage"]["triage/seq_mean_delta_p1"] <= first["triage"]["triage/seq_mean_delta_p50"]
    # the step-1 table is what the trainers logged: loss mass without weights = the vanilla run's, with = TRIAGE's
    for c, row in step1["classes"].items():
        assert row["mass_share_unweighted"] == pytest.approx(
            first["none"][f"triage/{c}/mass_share"], abs=1e-6
        )
        assert row["mass_share"] == pytest.approx(first["triage"][f"triage/{c}/mass_share"], abs=1e-6)
    assert step1["suppressed_frac"] == pytest.approx(first["triage"]["triage/suppressed_frac"])

    names = {p.name for p in out.iterdir()}
    assert {"summary.txt", "report.json", "step1.png", "compare.png"} <= names
    assert {"reward.png", "mismatch.png", "classes.png", "weights.png"} <= {
        p.name for p in (out / "triage").iterdir()
    }
    printed = capsys.readouterr().out
    assert (out / "summary.txt").read_text().strip() in printed
    for text in ("mean |δ|", "amplify_down", "vanilla GRPO", "TRIAGE cuts", "report.json"):
        assert text in printed


def test_demo_summary_states_the_measured_weight_change_and_step_count():
    """The closing lines give what the run measured (step-1 |w − 1|, the step count), at any gap and length."""
    import torch

    from triage import TriageConfig, token_weights
    from triage.experiments.demo import format_report, step1_analysis

    config = TriageConfig()
    delta = torch.tensor([[-0.9, 0.6, -0.4, 0.002], [0.8, -0.7, 0.3, -0.001]])  # a wide gap: large cuts
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones_like(delta)
    weights = token_weights(delta, adv, mask, config, tau=0.01)
    step1 = step1_analysis(
        {"delta": delta, "advantages": adv, "mask": mask, "weights": weights, "tau": 0.01}, config
    )
    run = {"reward_first": -1.0, "reward_last": -0.5, "mean_abs_delta": 0.5, "suppressed_frac": 0.4}
    cfg = {"correction": "triage", "triage_config": config.to_dict(), "steps": 50}
    cfg |= {"learner": "fp32", "sampler": "s", "level": "l"}
    text = format_report({"config": cfg, "step1": step1, "runs": {"triage": run}, "same_samples": None})
    change = (weights - 1).abs()
    assert change.max() > 0.2  # far from "a few percent"
    assert f"by {change.mean():.1%} on average (at most {change.max():.1%})" in text
    assert "50 steps of a random tiny model" in text and "few percent" not in text and "dozen" not in text
    assert "None" not in text and "No hard floor and no sequence guard (the defaults)" in text
    old = TriageConfig.profile("suppress-down")
    cfg_old = cfg | {"triage_config": old.to_dict()}
    step1_old = step1_analysis(
        {"delta": delta, "advantages": adv, "mask": mask, "weights": token_weights(delta, adv, mask, old, tau=0.01),
         "tau": 0.01},
        old,
    )  # fmt: skip
    text_old = format_report({"config": cfg_old, "step1": step1_old, "runs": {"triage": run}, "same_samples": None})
    assert "The hard floor (w = 0 for amplify-down δ < −3.0) acts on 0 tokens" in text_old
    assert "sequence guard (κ = 0.1)" in text_old and "None" not in text_old


def _tiny_recipe(tmp_path):
    recipe = {**TINY_RECIPE, "correction": "triage"}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_train_from_a_recipe_with_overrides(tmp_path):
    path = _tiny_recipe(tmp_path)
    out = tmp_path / "run"
    rc = main(
        ["train", "--config", str(path), "--output_dir", str(out), "correction=tis", "learning_rate=0.01"]
    )
    assert rc == 0
    saved = yaml.safe_load((out / "recipe.yaml").read_text())
    assert saved["correction"] == "tis" and saved["learning_rate"] == 0.01
    assert saved["num_generations"] == 2  # the file wins over base.yaml's 16
    report = json.loads((out / "report.json").read_text())
    assert report["summary"]["steps"] == 2
    assert (out / "model.safetensors").is_file()


def _one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("triage: error: "), captured.err
    return lines[0].removeprefix("triage: error: ")


def test_user_errors_print_one_line_and_exit_2(tmp_path, capsys):
    """A bad recipe, file or field: `triage: error: <message>` on stderr, exit 2, no traceback."""
    path = _tiny_recipe(tmp_path)
    assert main(["train", "--config", str(path), "corection=tis"]) == 2
    assert _one_line_error(capsys) == "unknown recipe key 'corection' (did you mean 'correction'?)"
    assert main(["train", "--config", str(path), "sampler_kwargs.sede=0"]) == 2
    assert "'sede' (did you mean 'seed'?)" in _one_line_error(capsys)
    assert main(["train", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "recipe file not found" in _one_line_error(capsys)
    assert main(["explain", "--config", str(tmp_path / "missing.yaml")]) == 2  # every subcommand
    assert "missing.yaml" in _one_line_error(capsys)
    assert main(["ablate", "--scale", "smoke", "--output", str(tmp_path / "a"), "--arms", "vanilla"]) == 2
    assert "unknown arms ['vanilla']" in _one_line_error(capsys)


def test_a_missing_model_folder_is_named_and_points_at_cpu(tmp_path, capsys):
    """The tiny preset's SFT checkpoint exists only after an ablation: say so (and --cpu) before anything runs,
    not a hub lookup error or transformers' bf16 complaint on a laptop."""
    assert main(["train", "--config", "tiny/triage", "--output_dir", str(tmp_path)]) == 2
    message = _one_line_error(capsys)
    assert "model_name_or_path './runs/ablate/sft': no such folder" in message and "--cpu" in message
    assert not any(tmp_path.iterdir())


def test_debug_shows_the_traceback_and_bugs_are_never_swallowed(tmp_path, capsys, monkeypatch):
    path = _tiny_recipe(tmp_path)
    for argv in (["--debug", "train", "--config", str(path)], ["train", "--config", str(path), "--debug"]):
        with pytest.raises(ValueError, match="unknown recipe key 'corection'"):
            main([*argv, "corection=tis"])

    def bug(args):
        raise RuntimeError("a bug, not bad input")

    monkeypatch.setattr("triage.explain.run", bug)
    with pytest.raises(RuntimeError, match="a bug"):  # not a user error: its traceback, never one line
        main(["explain"])
    assert capsys.readouterr().err == ""


def test_error_messages_read_as_written():
    from triage.cli import _message

    assert (
        _message(KeyError("offline rollouts row 3: no column 'prompt'"))
        == "offline rollouts row 3: no column 'prompt'"
    )
    assert _message(KeyError("dataset")) == "KeyError: 'dataset'"  # a bare key: keep its type
    assert _message(FileNotFoundError(2, "No such file or directory", "r.yaml")).endswith("'r.yaml'")


@pytest.mark.parametrize("threads", ["0", "-2", "x"])
def test_a_thread_count_below_one_is_a_usage_error(tmp_path, capsys, threads):
    """`--threads 0` is bad input: argparse's usage error (exit 2) before anything runs, not torch's
    RuntimeError traceback from set_num_threads after the recipe loaded."""
    path = _tiny_recipe(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--config", str(path), "--output_dir", str(tmp_path / "run"), "--threads", threads])
    assert exit_info.value.code == 2
    assert "--threads" in capsys.readouterr().err and not (tmp_path / "run").exists()
