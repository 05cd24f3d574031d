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
    assert "amplify_down" in out and "soft" in out and "0 if δ < −3" in out
    assert "normaliser" in out


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


def test_module_entry_point_runs():
    result = subprocess.run(
        [sys.executable, "-m", "triage", "explain", "--correction", "none"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "vanilla GRPO" in result.stdout
