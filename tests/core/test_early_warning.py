"""Early warning on synthetic training logs (triage.early_warning is pure stdlib)."""

import json
import random

import pytest

from triage.early_warning import EarlyWarning, EarlyWarningConfig, read_log, scan_log


def synthetic_log(steps=300, rise_at=None, fall_at=None, seed=0, spike_at=None):
    """Noisy flat metrics; optionally the amplify-down share rises linearly from ``rise_at`` and the reward,
    which climbs slowly, falls from ``fall_at``."""
    rng = random.Random(seed)
    out = []
    for step in range(1, steps + 1):
        share = 0.02 + rng.gauss(0, 0.002)
        delta = -0.08 + rng.gauss(0, 0.005)
        if rise_at is not None and step >= rise_at:
            share += 0.0008 * (step - rise_at)
            delta -= 0.002 * (step - rise_at)
        if spike_at == step:
            share += 0.05
        reward = 0.3 + 0.001 * min(step, fall_at or steps) + rng.gauss(0, 0.01)
        if fall_at is not None and step >= fall_at:
            reward -= 0.01 * (step - fall_at)
        out.append(
            {
                "step": step,
                "reward": reward,
                "triage/amplify_down/share": share,
                "triage/amplify_down/mean_delta": delta,
            }
        )
    return out


def test_sustained_rise_is_flagged_before_the_reward_falls():
    report = scan_log(synthetic_log(rise_at=150, fall_at=220))
    assert set(report.alarms) == {"amplify_down_share", "negative_tail_mass"}
    first = report.first_alarm
    assert 150 <= first.step < 170  # a few steps after the rise starts
    assert report.reward_fall is not None and report.reward_fall.step >= 220
    assert report.lead_steps >= 40
    assert "reward fell" in report.summary() and "sustained rise" in report.summary()


def test_flat_noise_and_a_single_spike_do_not_alarm():
    for seed in range(40):
        report = scan_log(synthetic_log(seed=seed, spike_at=120))
        assert report.alarms == {} and report.reward_fall is None, seed
    assert "no sustained rise" in report.summary()


def test_a_log_too_short_or_without_tail_metrics_is_not_evaluated():
    rising = synthetic_log(steps=30, rise_at=1)  # shorter than the 50-value warm-up
    assert (
        "not evaluated" in scan_log(rising).summary()
        and "no sustained rise" not in scan_log(rising).summary()
    )
    rewards_only = [{"step": r["step"], "reward": r["reward"]} for r in synthetic_log(steps=200, fall_at=100)]
    summary = scan_log(rewards_only).summary()
    assert "not evaluated" in summary and "reward fell" in summary


def test_reward_falling_before_the_tail_alarm_is_said_plainly():
    report = scan_log(synthetic_log(rise_at=200, fall_at=110))
    assert report.lead_steps < 0
    assert f"{-report.lead_steps} steps BEFORE the first alarm" in report.summary()


def test_non_finite_metric_is_an_immediate_alarm():
    log = synthetic_log(steps=60)
    log[40]["triage/amplify_down/share"] = float("nan")
    report = scan_log(log)
    assert report.alarms["amplify_down_share"].step == 41
    assert report.alarms["amplify_down_share"].reason == "non-finite value"


def test_negative_tail_mass_prefers_the_logged_key():
    log = [{"step": s, "triage/negative_tail_mass": 0.001} for s in range(1, 30)]
    log += [{"step": s, "triage/negative_tail_mass": 0.002} for s in range(30, 40)]
    report = scan_log(log, EarlyWarningConfig(warmup=10))
    assert (
        set(report.alarms) == {"negative_tail_mass"} and 30 <= report.alarms["negative_tail_mass"].step <= 35
    )


def test_reads_trainer_state_jsonl_and_lists(tmp_path):
    log = synthetic_log(rise_at=150, fall_at=220)
    mixed = []
    for rec in log:
        mixed.append(rec)
        if rec["step"] % 50 == 0:
            mixed.append({"step": rec["step"], "eval_loss": 1.0})  # eval lines are skipped
    state = tmp_path / "trainer_state.json"
    state.write_text(json.dumps({"global_step": 300, "log_history": mixed}, indent=2))
    lines = tmp_path / "log.jsonl"
    lines.write_text("\n".join(json.dumps(r) for r in log))
    listed = tmp_path / "log.json"
    listed.write_text(json.dumps(log))
    reports = [scan_log(read_log(p)) for p in (state, lines, listed)]
    assert len({r.first_alarm.step for r in reports}) == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1}\n{"step": 2,\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_log(bad)


def test_bad_input_is_named():
    watcher = EarlyWarning()
    watcher.update({"step": 5, "triage/amplify_down/share": 0.1})
    with pytest.raises(ValueError, match="step 5 comes after step 5"):
        watcher.update({"step": 5, "triage/amplify_down/share": 0.1})
    with pytest.raises(ValueError, match="not a number"):
        watcher.update({"step": 6, "triage/amplify_down/share": "high"})
    with pytest.raises(ValueError, match="warmup"):
        EarlyWarningConfig(warmup=1)
    with pytest.raises(ValueError, match="clip"):
        EarlyWarningConfig(clip=0.5, drift=0.5)


def test_mean_abs_delta_rise_is_flagged_and_aligned_noise_is_not():
    rng = random.Random(3)
    log = []
    for step in range(1, 201):
        abs_delta = 0.01 + rng.gauss(0, 0.0005) + (0.0005 * (step - 120) if step >= 120 else 0.0)
        log.append({"step": step, "reward": 0.3 + rng.gauss(0, 0.01), "triage/mean_abs_delta": abs_delta})
    report = scan_log(log)
    assert set(report.alarms) == {"mean_abs_delta"} and 120 <= report.alarms["mean_abs_delta"].step < 140
    # an aligned run: |δ| is rounding noise around 1e-6 nats; a doubling of it is no rise of the mismatch
    aligned = [
        {"step": s, "reward": 0.3, "triage/mean_abs_delta": 1e-6 * (1 + (s > 100)) + rng.gauss(0, 1e-8)}
        for s in range(1, 201)
    ]
    assert scan_log(aligned).alarms == {}
    loose = scan_log(aligned, EarlyWarningConfig(abs_delta_min_scale=0.0))
    assert "mean_abs_delta" in loose.alarms  # without the floor that noise would alarm
