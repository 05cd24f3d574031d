"""``testbed_summary``: the table of a run folder and the runs it reports as failed (a log, no result)."""

from __future__ import annotations

import json

from triage.experiments import testbed_summary


def _write_run(root, level, arm, seed, suffix=".json"):
    entry = {
        "level": level,
        "arm": arm,
        "seed": seed,
        "correction": "none",
        "complete": suffix == ".json",
        "seconds": 10.0,
        "series": {
            "step": [1, 2],
            "reward": [0.1, 0.3],
            "mean_abs_delta": [0.01, 0.02],
            "entropy": [0.5, 0.4],
        },
        "held_out": {"step": [0, 2], "accuracy": [0.4, 0.5]},
    }
    folder = root / "runs" / level / arm
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"seed{seed}{suffix}").write_text(json.dumps(entry))
    (folder / f"seed{seed}.log").write_text("log\n")


def test_a_log_without_its_own_result_is_reported_failed(tmp_path, capsys):
    """seed1 crashed (a log, no result) beside a finished seed10 and a cut-short seed2: only seed1 is named."""
    _write_run(tmp_path, "aligned", "grpo-none", 10)
    _write_run(tmp_path, "aligned", "grpo-none", 2, suffix=".partial.json")
    (tmp_path / "runs" / "aligned" / "grpo-none" / "seed1.log").write_text("Traceback ...\n")
    assert testbed_summary.main([str(tmp_path), "--json", str(tmp_path / "summary.json")]) == 0
    failed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("FAILED")]
    assert failed == [f"FAILED (no result): {tmp_path / 'runs' / 'aligned' / 'grpo-none' / 'seed1.log'}"]
    runs = json.loads((tmp_path / "summary.json").read_text())["runs"]
    assert sorted((r["seed"], r["complete"]) for r in runs) == [(2, False), (10, True)]
