"""The console script: --version, help, and `triage explain` printing weights token_weights computes."""

import subprocess
import sys

import pytest

from triage import __version__
from triage.cli import main


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert __version__ in capsys.readouterr().out


def test_help_lists_commands(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    for command in ("explain", "demo", "train", "diagnose", "ablate"):
        assert command in out


def test_explain_default_table(capsys):
    assert main(["explain"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.split()}
    # the default weighs the δ < −τ tokens of both advantage signs alike (symmetric IS), no floor
    assert rows["amplify_down"].split()[-7:] == rows["correct_up"].split()[-7:]
    assert "0.3679" in rows["amplify_down"] and "0 if δ" not in rows["amplify_down"]
    assert all(
        " is " in rows[c] for c in ("consistent", "amplify_down", "correct_up", "amplify_up", "correct_down")
    )
    assert "sequence guard: off" in out and "normaliser" in out


def test_explain_flags_and_yaml(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("correction: triage\namplify_down: mask\nlearning_rate: 1.0e-6\n")
    assert main(["explain", "--config", str(recipe), "--tau", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "τ = 0.1 nats" in out
    line = next(line for line in out.splitlines() if line.startswith("amplify_down"))
    assert "mask" in line and "0.0000" in line
    assert main(["explain", "--correction", "tis", "--is_cap", "3"]) == 0
    out = capsys.readouterr().out
    assert "min(exp δ, is_cap)" in out and "3.0000" in out  # e^2 capped at 3
    assert main(["explain", "--correction", "nope"]) == 2
    assert "correction" in capsys.readouterr().out


def test_explain_probability_space(capsys):
    """τ as a probability, classes by the band at p_s = 0.5, and the band's edges in δ."""
    args = [
        "explain",
        "--tau_space",
        "prob",
        "--tau",
        "0.2",
        "--amplify_down",
        "mask",
        "--consistent",
        "keep",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "τ = 0.2 (probability" in out and "nats" not in out.splitlines()[1]
    line = next(line for line in out.splitlines() if line.startswith("amplify_down"))
    assert "Δp < −τ, A < 0" in line
    # at p_s = 0.5 the band ends at δ = log(0.6) ≈ −0.511: δ = −0.5 is consistent, δ = −1 is masked
    cells = line.split()[-7:]
    assert cells[:3] == ["0.0000", "0.0000", "·"]
    consistent = next(line for line in out.splitlines() if line.startswith("consistent")).split()[-7:]
    assert consistent[2:5] == ["1.0000", "1.0000", "1.0000"]
    assert "p_s = 0.1   below the band: never (p_s ≤ τ)" in out and "δ < -0.511" in out
    assert main(["explain", "--tau_space", "prob", "--tau", "auto"]) == 2
    assert "tau_space='prob'" in capsys.readouterr().out


def test_explain_refuses_a_layered_recipe_it_would_misread(tmp_path, capsys):
    """preset/arm layers hold the TRIAGE fields: reading the file flat would explain the wrong correction."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("preset: tiny\narm: grpo-none\n")
    assert main(["explain", "--config", str(recipe)]) == 2
    assert "layered recipe" in capsys.readouterr().out


def test_adaptive_tau_starts_at_the_trackers_value():
    from triage import AdaptiveTau, TriageConfig

    config = TriageConfig(tau="auto", tau_init=1e-4, tau_floor=1e-3)
    assert config.fixed_tau() == AdaptiveTau(config).value == 1e-3


def test_module_entry_point_runs():
    result = subprocess.run(
        [sys.executable, "-m", "triage", "explain", "--correction", "none"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "vanilla GRPO" in result.stdout
