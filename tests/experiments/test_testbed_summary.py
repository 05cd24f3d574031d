"""``testbed_summary``: the table of a run folder and the runs it reports as failed (a log, no result)."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest

from triage.early_warning import EarlyWarningConfig, scan_log
from triage.experiments import testbed_summary


def _write_full_run(
    root,
    level,
    arm,
    seed,
    suffix=".json",
    steps=60,
    lr=5e-5,
    reward=0.3,
    delta=0.01,
    resumed_at=None,
    held=(0.5, 0.6),
):
    series = {k: [0.0] * steps for k in testbed_summary.SERIES}
    series.update(step=list(range(1, steps + 1)), reward=[reward] * steps, mean_abs_delta=[delta] * steps)
    entry = {
        "level": level,
        "arm": arm,
        "seed": seed,
        "correction": "none",
        "complete": suffix == ".json",
        "seconds": 10.0,
        "params": 123,
        "series": series,
        "held_out": {"step": [0, steps], "accuracy": list(held)},
        "recipe": {"learning_rate": lr, "temperature": 1.0},
        "resumed_at": resumed_at or [],
    }
    folder = root / "runs" / level / arm
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"seed{seed}{suffix}").write_text(json.dumps(entry))
    (folder / f"seed{seed}.log").write_text("log\n")


def test_a_log_without_its_own_result_is_reported_failed(tmp_path, capsys):
    """seed1 crashed (a log, no result) beside a finished seed10 and a cut-short seed2: only seed1 is named."""
    _write_full_run(tmp_path, "aligned", "grpo-none", 10)
    _write_full_run(tmp_path, "aligned", "grpo-none", 2, suffix=".partial.json")
    (tmp_path / "runs" / "aligned" / "grpo-none" / "seed1.log").write_text("Traceback ...\n")
    assert testbed_summary.main([str(tmp_path), "--json", str(tmp_path / "summary.json")]) == 0
    failed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("FAILED")]
    assert failed == [f"FAILED (no result): {tmp_path / 'runs' / 'aligned' / 'grpo-none' / 'seed1.log'}"]
    runs = json.loads((tmp_path / "summary.json").read_text())["runs"]
    assert sorted((r["seed"], r["complete"]) for r in runs) == [(2, False), (10, True)]


def test_several_folders_read_as_one_study(tmp_path, capsys):
    """Two calls' folders: the finished copy of a run wins over a cut-short one; a learning-rate override is
    its own group; --rename-arm relabels (keeping the name it ran under); --select refuses an unknown pair."""
    a, b = tmp_path / "a", tmp_path / "b"
    _write_full_run(a, "aligned", "grpo-none", 0, suffix=".partial.json", steps=30)
    _write_full_run(b, "aligned", "grpo-none", 0, steps=60)
    _write_full_run(b, "aligned", "old-name", 0, lr=2e-4)
    out = tmp_path / "s.json"
    assert (
        testbed_summary.main([str(a), str(b), "--json", str(out), "--rename-arm", "old-name=new-name"]) == 0
    )
    runs = json.loads(out.read_text())["runs"]
    by = {(testbed_summary.group_label(r), r["arm"]): r for r in runs}
    assert set(by) == {("aligned", "grpo-none"), ("aligned (lr 0.0002)", "new-name")}
    assert by["aligned", "grpo-none"]["complete"] and by["aligned", "grpo-none"]["steps"] == 60
    assert by["aligned (lr 0.0002)", "new-name"]["arm_as_run"] == "old-name"
    again = tmp_path / "again.json"  # renamed twice: still the name it ran under
    assert (
        testbed_summary.main(
            ["--from-json", str(out), "--json", str(again), "--rename-arm", "new-name=newer"]
        )
        == 0
    )
    (twice,) = [r for r in json.loads(again.read_text())["runs"] if r["arm"] == "newer"]
    assert twice["arm_as_run"] == "old-name"
    with pytest.raises(SystemExit):
        testbed_summary.main([str(b), "--select", "aligned/nope"])
    assert "no run is aligned/nope" in capsys.readouterr().err


def test_a_committed_summary_extended_by_new_folders(tmp_path, capsys):
    """--from-json OLD.json RUN_DIR --json NEW.json: one study; a run finished in the folder replaces its
    cut-short copy in the old summary, the old summary's other runs (and its SFT record) are kept."""
    old_dir, new_dir = tmp_path / "old", tmp_path / "new"
    _write_full_run(old_dir, "aligned", "grpo-none", 0)
    _write_full_run(old_dir, "aligned", "tis", 1, suffix=".partial.json", steps=30)
    old = tmp_path / "old.json"
    assert testbed_summary.main([str(old_dir), "--json", str(old)]) == 0
    summary = json.loads(old.read_text())
    summary["sft"] = {"params": 7}
    old.write_text(json.dumps(summary))
    _write_full_run(new_dir, "aligned", "tis", 1, steps=60)
    _write_full_run(new_dir, "aligned", "tis", 2, steps=60, resumed_at=[25])
    new = tmp_path / "new.json"
    assert testbed_summary.main(["--from-json", str(old), str(new_dir), "--json", str(new)]) == 0
    assert (
        "Continued from a checkpoint (a later call): aligned/tis/seed 2 at step 25" in capsys.readouterr().out
    )
    merged = json.loads(new.read_text())
    got = sorted((r["arm"], r["seed"], r["steps"], r["complete"]) for r in merged["runs"])
    assert got == [("grpo-none", 0, 60, True), ("tis", 1, 60, True), ("tis", 2, 60, True)]
    assert merged["sft"] == {"params": 7}
    with pytest.raises(SystemExit):
        testbed_summary.main([])


def test_early_warning_replay_names_the_alarm_and_the_lead(tmp_path):
    _write_full_run(tmp_path, "lv", "grpo-none", 0, steps=200)
    run = testbed_summary.load_runs(tmp_path)[0]
    s = run["series"]
    s["mean_abs_delta"] = [0.01 + (0.002 * (t - 100) if t >= 100 else 0.0) for t in s["step"]]
    s["reward"] = [0.3 - (0.02 * (t - 150) if t >= 150 else 0.0) for t in s["step"]]
    run["held_out"]["accuracy"] = [0.5, 0.1]
    stable = copy.deepcopy(run)  # did not degrade, but its |δ| alarmed: a false alarm
    stable["seed"], stable["held_out"]["accuracy"] = 1, [0.5, 0.55]
    quiet = copy.deepcopy(stable)  # did not degrade, no alarm
    quiet["seed"], quiet["series"]["mean_abs_delta"] = 2, [0.01] * len(s["step"])
    lines = testbed_summary.early_warning_table([run, stable, quiet]).splitlines()
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[:6] == ["lv", "grpo-none", "0", str(run["steps"]), "0.500 → 0.100", "yes"]
    fall, alarm, lead = int(cells[6]), int(cells[7]), int(cells[9])
    assert 100 <= alarm < 110 and 150 <= fall < 160 and lead == fall - alarm and cells[8] == "–"
    assert lines[-1] == (
        f"degraded: 1 run(s), the reward fell in 1, an alarm came first in 1 ({lead}–{lead} steps ahead); "
        "false alarms: 1 of 2 run(s) that did not degrade"
    )


def test_summaries_of_different_sft_checkpoints_are_not_one_study(tmp_path, capsys):
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    a.write_text(json.dumps({"sft": {"params": 7, "final": {"accuracy": 0.51953125}}, "runs": []}))
    b.write_text(json.dumps({"sft": {"params": 7, "final": {"accuracy": 0.54296875}}, "runs": []}))
    c.write_text(
        json.dumps({"sft": {"params": 7, "final": {"accuracy": 0.519531}}, "runs": []})
    )  # a compacted a
    with pytest.raises(SystemExit):
        testbed_summary.main(["--from-json", str(a), "--from-json", str(b)])
    assert "different SFT checkpoints" in capsys.readouterr().err
    assert testbed_summary.main(["--from-json", str(a), "--from-json", str(c)]) == 0


def test_plot_adds_the_gradient_share_panel_only_for_runs_that_logged_it(tmp_path):
    pytest.importorskip("matplotlib")
    _write_full_run(tmp_path, "lv", "grpo-none", 0)
    run = testbed_summary.load_runs(tmp_path)[0]
    old = copy.deepcopy(run)  # a run from before the per-class gradient shares
    for key in ("grad_share/amplify_down", "grad_share/correct_up"):
        old["series"][key] = None

    def width(runs):
        path = tmp_path / "fig.png"
        testbed_summary.plot(runs, path)
        return int.from_bytes(path.read_bytes()[16:20], "big")  # the PNG header's width

    assert width([run]) == width([old]) * 6 // 5  # six panels of equal width instead of five
    assert width([old, run]) == width([run])


def test_below_band_share_is_undefined_at_a_step_without_gradient():
    """A collapsed run's zero-gradient step logs 0 for every class: no share (not 0 %), so it neither drags
    the window means nor the figure's band to 0."""
    series = {f"grad_share/{c}": [0.2, 0.0] for c in testbed_summary.GRAD_SHARE_CLASSES}
    assert testbed_summary._below_band_grad(series) == [0.4, None]
    assert testbed_summary._window(testbed_summary._below_band_grad(series), first=False) == 0.4


def test_fisher_greater_is_the_hypergeometric_tail():
    """P(X ≥ a) by brute force over every way the events can fall on the runs, and the textbook values."""
    import itertools
    from fractions import Fraction

    def brute(a, n_a, b, n_b):
        runs, events = n_a + n_b, a + b
        ways = list(itertools.combinations(range(runs), events))  # which runs hold the events
        return Fraction(sum(sum(i < n_a for i in w) >= a for w in ways), len(ways))

    for a, n_a, b, n_b in [
        (4, 6, 0, 3),
        (5, 6, 0, 3),
        (4, 5, 0, 15),
        (0, 3, 2, 3),
        (2, 4, 2, 4),
        (3, 3, 0, 0),
    ]:
        assert testbed_summary.fisher_greater(a, n_a, b, n_b) == pytest.approx(float(brute(a, n_a, b, n_b)))
    assert testbed_summary.fisher_greater(4, 6, 0, 3) == pytest.approx(10 / 84)
    assert testbed_summary.fisher_greater(0, 3, 3, 3) == 1.0  # nothing in A: the tail is everything
    with pytest.raises(ValueError, match="out of range"):
        testbed_summary.fisher_greater(4, 3, 0, 3)


def test_compare_counts_degraded_and_collapsed_runs_and_tests_them(tmp_path, capsys):
    """--compare 'A vs B': pooled groups, degraded (10 points below the start) and collapsed (below 5 %)
    counted per group, with the one-sided Fisher p; an unknown group is an error naming it."""
    for seed, held in enumerate([(0.6, 0.0), (0.6, 0.45), (0.6, 0.55)]):  # collapsed, degraded, stable
        _write_full_run(tmp_path, "row", "grpo-none", seed, held=held)
    for seed in range(3):
        _write_full_run(tmp_path, "pair", "grpo-none", seed, held=(0.5, 0.6))
    assert testbed_summary.main([str(tmp_path), "--json", str(tmp_path / "s.json"), "--compare",
                                 "row/grpo-none vs pair/grpo-none"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    p_degraded = testbed_summary.fisher_greater(2, 3, 0, 3)
    p_collapsed = testbed_summary.fisher_greater(1, 3, 0, 3)
    assert f"degraded: A 2 of 3, B 0 of 3; one-sided Fisher p (A > B) = {p_degraded:.3f}" in out
    assert f"collapsed: A 1 of 3, B 0 of 3; one-sided Fisher p (A > B) = {p_collapsed:.3f}" in out
    with pytest.raises(SystemExit):
        testbed_summary.main(
            [str(tmp_path), "--json", str(tmp_path / "s.json"), "--compare", "row/grpo-none vs x/y"]
        )
    assert "--compare B: no run is x/y" in capsys.readouterr().err
    for spec, message in (
        ("row vs pair/grpo-none", "'row' is not LEVEL/ARM"),
        ("row/grpo-none vs row/grpo-none", "share 3 run"),
    ):
        with pytest.raises(SystemExit):
            testbed_summary.main([str(tmp_path), "--json", str(tmp_path / "s.json"), "--compare", spec])
        assert message in capsys.readouterr().err


def _sweep_study(tmp_path):
    """A summary JSON of eight 200-step runs (warm-up 50 steps): degraded runs whose mean |δ| rises from step 100
    at four slopes (reward falling steeply from step 150), one whose reward drops by a small step at 180 (a fall
    the default threshold sees by step 190 and a threshold of 32 would not see in the run) and whose
    amplify-down share alone alarms, and stable runs: flat, a short bump of |δ| (an alarm only at a low
    threshold) and a share rise (a false alarm of the share alone)."""
    _write_full_run(tmp_path / "dirs", "lv", "grpo-none", 0, steps=200)
    base = testbed_summary.load_runs(tmp_path / "dirs")[0]
    steps = base["series"]["step"]
    fall = [0.3 - (0.02 * (t - 150) if t >= 150 else 0.0) for t in steps]

    def run(seed, held, delta=lambda t: 0.0, reward=fall, share=lambda t: 0.0):
        r = copy.deepcopy(base)
        r["seed"], r["held_out"]["accuracy"] = seed, list(held)
        r["series"]["mean_abs_delta"] = [0.01 + delta(t) + 1e-4 * (t % 3) for t in steps]
        r["series"]["reward"] = list(reward)
        r["series"]["share/amplify_down"] = [0.05 + share(t) + 1e-3 * (t % 2) for t in steps]
        return r

    def ramp(start, slope):
        return lambda t: slope * (t - start) if t >= start else 0.0

    slopes = (4e-4, 1e-3, 3e-3, 1e-2)
    runs = [run(seed, (0.5, 0.1), delta=ramp(100, slope)) for seed, slope in enumerate(slopes)]
    small_fall = [0.3 - (0.012 if t >= 180 else 0.0) for t in steps]  # 2σ (σ floor 2 % of 0.3): +1 a step
    runs.append(run(4, (0.5, 0.2), reward=small_fall, share=ramp(120, 0.01)))
    runs.append(run(5, (0.5, 0.55), reward=[0.3] * len(steps)))

    def bump(t):  # four steps 4.5σ (σ floor 1e-3) high
        return 0.0045 if 120 <= t < 124 else 0.0

    runs.append(run(6, (0.5, 0.55), delta=bump, reward=[0.3] * len(steps)))
    runs.append(run(7, (0.5, 0.55), share=ramp(120, 0.01), reward=[0.3] * len(steps)))
    path = tmp_path / "study.json"
    path.write_text(json.dumps({"sft": None, "runs": runs}))
    return path


def _sweep_rows(out):
    lines = out[out.index("| threshold |") :].splitlines()[2:]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines if line.startswith("|")]
    return {float(r[0].split()[0]): r for r in rows}


def test_threshold_sweep_trades_alarms_for_lead(tmp_path, capsys):
    """A lower threshold never gives fewer alarms (before a fall, or false) nor a shorter longest lead; the
    falls are the default config's in every row, including at 32 where the reward detector itself would miss
    the small fall."""
    study = _sweep_study(tmp_path)
    thresholds = (2, 4, 8, 16, 32)
    args = ["--from-json", str(study), "--early-warning-thresholds", ",".join(map(str, thresholds))]
    assert testbed_summary.main(args) == 0
    rows = _sweep_rows(capsys.readouterr().out)
    small = json.loads(study.read_text())["runs"][4]["series"]  # a fall that a threshold of 32 would miss
    records = [{"step": t, "reward": r} for t, r in zip(small["step"], small["reward"])]
    assert scan_log(records, replace(EarlyWarningConfig(), threshold=32)).reward_fall is None
    assert scan_log(records).reward_fall is not None
    assert list(rows) == list(thresholds) and rows[8][0] == "8 (default)"
    assert {r[1] for r in rows.values()} == {"5 of 5"}  # the same falls in every row
    ahead = [int(rows[t][2].split(" of ")[0]) for t in thresholds]
    false = [int(rows[t][5].split(" of ")[0]) for t in thresholds]
    longest = [int(rows[t][4].split("–")[1]) for t in thresholds]
    assert ahead == sorted(ahead, reverse=True) and false == sorted(false, reverse=True)
    assert longest == sorted(longest, reverse=True)
    assert false[0] > false[-1]  # the |δ| bump alarms only at a low threshold
    assert all(r[5].endswith(" of 3") for r in rows.values())


def test_threshold_sweep_at_the_default_is_the_replay_last_line(tmp_path, capsys):
    """The row at the default threshold counts what --early-warning's last line counts (any signal's alarm:
    the runs where only the amplify-down share alarms are in both)."""
    study = _sweep_study(tmp_path)
    assert testbed_summary.main(["--from-json", str(study), "--early-warning",
                                 "--early-warning-thresholds", "8,4"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    (last,) = [line for line in out.splitlines() if line.startswith("degraded: ")]
    row = _sweep_rows(out)[8]
    lo, hi = row[4].split("–")
    assert last == (
        f"degraded: {row[1].split(' of ')[1]} run(s), the reward fell in {row[1].split(' of ')[0]}, "
        f"an alarm came first in {row[2].split(' of ')[0]} ({lo}–{hi} steps ahead); "
        f"false alarms: {row[5]} run(s) that did not degrade"
    )
    assert last.endswith("false alarms: 1 of 3 run(s) that did not degrade")  # the share's alone


@pytest.mark.parametrize("spec", ["4,x", "0", "4,-1", "nan", "inf", "", "4,,8"])
def test_threshold_sweep_refuses_a_bad_threshold(tmp_path, capsys, spec):
    study = _sweep_study(tmp_path)
    with pytest.raises(SystemExit):
        testbed_summary.main(["--from-json", str(study), "--early-warning-thresholds", spec])
    assert "--early-warning-thresholds: " in capsys.readouterr().err


def _window_study(tmp_path):
    """A summary JSON: lv/grpo-none seeds 0 and 2 with 10 steps (seed 2's reward 2 higher), seed 1 with 2 steps
    (none in the window 3:6), and other/grpo-none; completion length not logged, one entropy missing (step 4)
    and a step without gradient (step 6: every class's share 0)."""
    _write_full_run(tmp_path / "dirs", "lv", "grpo-none", 0, steps=10, held=(0.5, 0.0))
    base = testbed_summary.load_runs(tmp_path / "dirs")[0]
    s = base["series"]
    s["reward"] = [float(t * t) for t in s["step"]]  # 9, 16, 25, 36 at steps 3..6
    s["entropy"] = [None if t == 4 else 0.1 * t for t in s["step"]]
    s["mean_abs_delta"] = [t / 100 for t in s["step"]]
    s["grad_norm"] = [5.0 if t == 3 else 1.0 for t in s["step"]]
    s["completion_length"] = None
    down = {3: 0.1, 4: 0.2, 5: 0.3}  # below the band: amplify-down + correct-up (0.1)
    s["grad_share/amplify_down"] = [down.get(t, 0.0) for t in s["step"]]
    s["grad_share/correct_up"] = [0.0 if t == 6 else 0.1 for t in s["step"]]
    s["grad_share/consistent"] = [0.0 if t == 6 else 0.9 - down.get(t, 0.0) for t in s["step"]]
    short = copy.deepcopy(base)
    short["seed"], short["held_out"]["accuracy"] = 1, [0.5, 0.45]
    short["series"] = {k: v[:2] if v else v for k, v in s.items()}
    higher = copy.deepcopy(base)
    higher["seed"], higher["series"]["reward"] = 2, [r + 2 for r in s["reward"]]
    other = copy.deepcopy(base)
    other["level"] = "other"
    path = tmp_path / "study.json"
    path.write_text(json.dumps({"sft": None, "runs": [base, short, higher, other]}))
    return path


def _window_rows(out):
    lines = out[out.index("| level | arm | seed | held-out last") :].splitlines()[2:]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines if line.startswith("|")]
    return {tuple(r[:3]): r[3:] for r in rows}


def test_window_means_over_the_steps_both_included(tmp_path, capsys):
    """--window 3:6: per run the means over steps 3..6 (both ends count: the reward's square steps make any
    other range give another mean), missing values skipped, a series not logged and a run without a step in
    the window shown '–'; per (level, arm) mean ± std over its runs; --select keeps only its groups."""
    study = _window_study(tmp_path)
    args = ["--from-json", str(study), "--window", "3:6", "--select", "lv/grpo-none"]
    assert testbed_summary.main(args) == 0
    out = capsys.readouterr().out
    assert "Means over the logged steps 3..6 (both included):" in out
    rows = _window_rows(out)
    reward = (9 + 16 + 25 + 36) / 4  # exclusive (4, 5): 20.5; half-open: 16.667 or 25.667
    entropy = (0.3 + 0.5 + 0.6) / 3  # step 4 missing
    share = 100 * (0.2 + 0.3 + 0.4) / 3  # step 6 has no gradient
    assert rows["lv", "grpo-none", "0"] == [
        "0.000", "yes", "yes", f"{reward:.3f}", f"{entropy:.3f}", "0.045", "2.000", "–", f"{share:.3f}"
    ]  # fmt: skip
    assert rows["lv", "grpo-none", "1"] == ["0.450", "no", "no"] + ["–"] * 6
    assert rows["lv", "grpo-none", "2"][3] == f"{reward + 2:.3f}"
    group = rows["lv", "grpo-none", "3 runs"]
    assert group[:3] == ["0.150 ± 0.260", "2 of 3", "2 of 3"]
    assert group[3] == f"{reward + 1:.3f} ± {2 ** 0.5:.3f}" and group[4:] == [
        f"{entropy:.3f} ± 0.000", "0.045 ± 0.000", "2.000 ± 0.000", "–", f"{share:.3f} ± 0.000"
    ]  # fmt: skip
    assert not [key for key in rows if key[0] == "other"]
    testbed_summary.main(["--from-json", str(study), "--window", "3:6"])
    assert ("other", "grpo-none", "0") in _window_rows(capsys.readouterr().out)


@pytest.mark.parametrize("spec", ["5", "a:b", "9:3", "-1:4", "1.5:3", ""])
def test_window_refuses_a_bad_range(tmp_path, capsys, spec):
    study = _window_study(tmp_path)
    with pytest.raises(SystemExit):
        testbed_summary.main(["--from-json", str(study), f"--window={spec}"])  # '-1:4' is no option
    assert f"--window: {spec!r}" in capsys.readouterr().err
