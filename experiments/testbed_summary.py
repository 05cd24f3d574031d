"""Summary of a mismatch-testbed folder (``experiments/testbed/study.sh``): mean ± std over seeds per
(level, arm), and one small JSON of every run's per-step series for ``docs/results/``.

    python -m triage.experiments.testbed_summary RUN_DIR [RUN_DIR ...] [--json OUT.json] [--plot OUT.png]
    python -m triage.experiments.testbed_summary --from-json docs/results/testbed/X.json [--select LEVEL/ARM,...]
        [--plot OUT.png]                  # the table (and figure) of a committed summary
    python -m triage.experiments.testbed_summary --from-json OLD.json RUN_DIR ... --json NEW.json
                                          # a committed summary extended by new runs (one study)
    python -m triage.experiments.testbed_summary --from-json X.json --early-warning
        [--early-warning-thresholds 4,6,8,10,12]  # the early-warning replay per run; one row per threshold
    python -m triage.experiments.testbed_summary --from-json X.json --window 50:100
                                          # per run and per (level, arm): means over steps 50..100

``RUN_DIR/runs/<level>/<arm>/seed<k>.json`` are the finished runs and ``seed<k>.partial.json`` the runs a time
budget cut short (both written by ``triage ablate``). Several RUN_DIRs (one per GPU call, or one per recipe
override) and summary JSONs (``--from-json``, repeatable) are read as one study. A run whose learning rate or temperature differs from the testbed scale's
(``--set learning_rate=2e-4``) is its own group: its ``variant`` (e.g. ``lr 0.0002``) is shown after the level.
When the same run (level, variant, arm, seed) is found twice, the finished one (else the longer) is kept.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from triage.experiments.ablate import PARTIAL_SUFFIX, SCALES

#: The classes whose ``triage/<class>/grad_share`` a run logs (they sum to 1 at a step with a gradient).
GRAD_SHARE_CLASSES = ("consistent", "amplify_down", "correct_up", "amplify_up", "correct_down")
SERIES = (
    "reward",
    "accuracy",
    "entropy",
    "mean_abs_delta",
    "suppressed_frac",
    "completion_length",
    "kl_k3",
    "grad_norm",
    "guarded_frac",
    "share/amplify_down",
    "share/amplify_up",
    "share/correct_up",
    "share/correct_down",
    "share/inert",
    "seq_mean_delta_p1",
    "seq_mean_delta_p50",
    "mean_abs_dprob",
    *(f"grad_share/{c}" for c in GRAD_SHARE_CLASSES),
)  # the early-warning signal (amplify-down share) included


def variant(recipe: dict) -> str:
    """What a run changed against the testbed scale (learning rate, temperature), "" for none."""
    parts = []
    lr, temperature = recipe.get("learning_rate"), recipe.get("temperature", 1.0)
    if lr is not None and float(lr) != SCALES["testbed"].learning_rate:
        parts.append(f"lr {float(lr):g}")
    if temperature is not None and float(temperature) != 1.0:
        parts.append(f"T {float(temperature):g}")
    return ", ".join(parts)


def group_label(run: dict) -> str:
    """``level`` or ``level (variant)``: what --select and the tables call a run's level."""
    return f"{run['level']} ({run['variant']})" if run.get("variant") else run["level"]


def load_runs(*roots: Path) -> list[dict]:
    runs = []
    for root in roots:
        for f in sorted(Path(root).glob("runs/*/*/seed*.json")):
            e = json.loads(f.read_text())
            s, recipe = e["series"], e.get("recipe") or {}
            run = {
                "level": e["level"],
                "variant": variant(recipe),
                "arm": e["arm"],
                "seed": e["seed"],
                "correction": e.get("correction"),
                "params": e.get("params"),
                "learning_rate": recipe.get("learning_rate"),
                "temperature": recipe.get("temperature"),
                "complete": e.get("complete", True),
                "resumed_at": e.get("resumed_at") or [],
                "steps": len(s["step"]),
                "seconds": e["seconds"],
                "device": e.get("device"),
                "mean_abs_delta_step1": s["mean_abs_delta"][0] if s["mean_abs_delta"] else None,
                "series": {k: s.get(k) for k in ("step", *SERIES)},
                "held_out": {k: e["held_out"][k] for k in ("step", "accuracy")},
            }
            runs.append(run)
    return merge(runs)


def merge(runs: list[dict]) -> list[dict]:
    """One run per (level, variant, arm, seed): the finished one, else the longer (the first of equals)."""
    found: dict[tuple, dict] = {}
    for run in runs:
        key = (run["level"], run["variant"], run["arm"], run["seed"])
        old = found.get(key)
        if old is None or (run["complete"], run["steps"]) > (old["complete"], old["steps"]):
            found[key] = run
    return sorted(found.values(), key=lambda r: (group_label(r), r["arm"], r["seed"]))


def _mean(values):
    """The mean of ``values``' non-None entries; None when there are none."""
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _window(values, first: bool, n: int = 10):
    if values is None:  # a series the run did not log
        return None
    return _mean(values[:n] if first else values[-n:])


def _between(steps, values, lo: int, hi: int):
    """The mean of ``values`` (a per-step series) over the logged ``steps`` lo..hi, both included; None for a
    series the run did not log and for a run with no value in the range."""
    if values is None:
        return None
    return _mean(v for t, v in zip(steps, values) if lo <= t <= hi)


def _below_band_grad(series: dict):
    """Per step, the share of the policy gradient's size (``triage/<class>/grad_share``) held by the tokens
    below the band, δ < −τ (amplify-down + correct-up); None for runs that did not log it, and at steps
    without a gradient (every class's share 0)."""
    down, up = series.get("grad_share/amplify_down"), series.get("grad_share/correct_up")
    if down is None or up is None:
        return None
    shares = [series.get(f"grad_share/{c}") or [None] * len(down) for c in GRAD_SHARE_CLASSES]
    # a step with no gradient (every advantage zero: a collapsed run) logs 0 for every class: no share
    total = [None if None in col else sum(col) for col in zip(*shares)]
    return [None if a is None or b is None or not t else a + b for a, b, t in zip(down, up, total)]


def _percent(value):
    return None if value is None else 100.0 * value


def _ms(values) -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "–"
    if len(vals) == 1:
        return f"{vals[0]:.3f}"
    return f"{statistics.mean(vals):.3f} ± {statistics.stdev(vals):.3f}"


def _groups(runs: list[dict]) -> dict[tuple, list]:
    """The runs per (level as :func:`group_label` shows it, arm), in the runs' order."""
    groups: dict[tuple, list] = {}
    for r in runs:
        groups.setdefault((group_label(r), r["arm"]), []).append(r)
    return groups


def table(runs: list[dict]) -> str:
    lines = [
        "| level | arm | seeds | steps | \\|δ\\| step 1 | \\|δ\\| run | reward first 10 → last 10 | held-out first → last "
        "| entropy last 10 | grad norm first 10 → last 10 | suppressed % first 10 → last 10 "
        "| below-band grad share % first 10 → last 10 | s/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (level, arm), rs in _groups(runs).items():
        s = [r["series"] for r in rs]
        held = [r["held_out"]["accuracy"] for r in rs]
        lines.append(
            f"| {level} | {arm} | {len(rs)} | {'/'.join(str(r['steps']) for r in rs)} "
            f"| {_ms([r['mean_abs_delta_step1'] for r in rs])} "
            f"| {_ms([_window(x['mean_abs_delta'], True, 10**9) for x in s])} "
            f"| {_ms([_window(x['reward'], True) for x in s])} → {_ms([_window(x['reward'], False) for x in s])} "
            f"| {_ms([h[0] for h in held])} → {_ms([h[-1] for h in held])} "
            f"| {_ms([_window(x['entropy'], False) for x in s])} "
            f"| {_ms([_window(x['grad_norm'], True) for x in s])} → {_ms([_window(x['grad_norm'], False) for x in s])} "
            f"| {_ms([_percent(_window(x.get('suppressed_frac'), True)) for x in s])} → "
            f"{_ms([_percent(_window(x.get('suppressed_frac'), False)) for x in s])} "
            f"| {_ms([_percent(_window(_below_band_grad(x), True)) for x in s])} → "
            f"{_ms([_percent(_window(_below_band_grad(x), False)) for x in s])} "
            f"| {_ms([r['seconds'] / max(r['steps'], 1) for r in rs])} |"
        )
    resumed = [
        f"{group_label(r)}/{r['arm']}/seed {r['seed']} at step {', '.join(map(str, r['resumed_at']))}"
        for r in runs
        if r.get("resumed_at")
    ]
    if resumed:
        lines += ["", "Continued from a checkpoint (a later call): " + "; ".join(resumed)]
    return "\n".join(lines)


DEGRADED_DROP = 0.1  # a run degraded when its last held-out accuracy is this far below its first
COLLAPSED_BELOW = (
    0.05  # and collapsed when its last held-out accuracy is below this (greedy answers ~all wrong)
)


def degraded(run: dict) -> bool:
    """Whether the run's last held-out accuracy is more than :data:`DEGRADED_DROP` below its first."""
    held = run["held_out"]["accuracy"]
    return held[-1] < held[0] - DEGRADED_DROP


def collapsed(run: dict) -> bool:
    """Whether the run's last held-out accuracy is below :data:`COLLAPSED_BELOW`."""
    return run["held_out"]["accuracy"][-1] < COLLAPSED_BELOW


#: The series :func:`window_table` averages (then the below-band gradient share, :func:`_below_band_grad`).
WINDOW_SERIES = ("reward", "entropy", "mean_abs_delta", "grad_norm", "completion_length")


def parse_window(spec: str, what: str = "--window") -> tuple[int, int]:
    """``A:B`` as the steps (A, B), both included; ``ValueError`` naming ``what`` unless A and B are integers
    with 0 ≤ A ≤ B."""
    lo, sep, hi = spec.partition(":")
    try:
        if not sep:
            raise ValueError
        a, b = int(lo), int(hi)
    except ValueError:
        raise ValueError(f"{what}: {spec!r} is not A:B (two integer steps)") from None
    if not 0 <= a <= b:
        raise ValueError(f"{what}: {spec!r} needs 0 <= A <= B")
    return a, b


def window_means(run: dict, lo: int, hi: int) -> list:
    """The run's means over its logged steps lo..hi (:func:`_between`) of :data:`WINDOW_SERIES` and of the
    below-band gradient share in % (:func:`_below_band_grad`); None where nothing was logged."""
    s = run["series"]
    means = [_between(s["step"], s.get(name), lo, hi) for name in WINDOW_SERIES]
    return means + [_percent(_between(s["step"], _below_band_grad(s), lo, hi))]


def window_table(runs: list[dict], lo: int, hi: int) -> str:
    """One row per run: its last held-out accuracy, whether it degraded and collapsed (:func:`degraded`,
    :func:`collapsed`) and its means over steps lo..hi (:func:`window_means`); then one row per (level, arm):
    mean ± std over its runs, and how many of them degraded and collapsed."""
    lines = [
        f"Means over the logged steps {lo}..{hi} (both included):",
        "",
        "| level | arm | seed | held-out last | degraded | collapsed | reward | entropy | mean \\|δ\\| "
        "| grad norm | completion length | below-band grad share % |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {group_label(r)} | {r['arm']} | {r['seed']} | {r['held_out']['accuracy'][-1]:.3f} "
            f"| {'yes' if degraded(r) else 'no'} | {'yes' if collapsed(r) else 'no'} | "
            + " | ".join(_ms([v]) for v in window_means(r, lo, hi))
            + " |"
        )
    for (level, arm), rs in _groups(runs).items():
        columns = zip(*(window_means(r, lo, hi) for r in rs))
        lines.append(
            f"| {level} | {arm} | {len(rs)} runs | {_ms([r['held_out']['accuracy'][-1] for r in rs])} "
            f"| {sum(map(degraded, rs))} of {len(rs)} | {sum(map(collapsed, rs))} of {len(rs)} | "
            + " | ".join(_ms(c) for c in columns)
            + " |"
        )
    return "\n".join(lines)


def fisher_greater(a: int, n_a: int, b: int, n_b: int) -> float:
    """One-sided Fisher exact test: the probability, with the margins fixed, that group A (``a`` of ``n_a``
    runs) holds at least ``a`` of the ``a + b`` events if the events fell on the ``n_a + n_b`` runs at random:
    P(X ≥ a), X hypergeometric(N = n_a + n_b, K = a + b, n = n_a)."""
    from math import comb

    if not (0 <= a <= n_a and 0 <= b <= n_b):
        raise ValueError(f"fisher_greater: counts out of range ({a}/{n_a}, {b}/{n_b})")
    total, events = n_a + n_b, a + b
    hi = min(n_a, events)
    return sum(comb(events, x) * comb(total - events, n_a - x) for x in range(a, hi + 1)) / comb(total, n_a)


def select(runs: list[dict], spec: str, what: str = "--select") -> list[dict]:
    """The runs of the comma-separated LEVEL/ARM groups in ``spec`` (LEVEL as the tables show it, e.g.
    ``aligned (lr 0.0002)``); ``ValueError`` naming ``what`` and any group no run belongs to."""
    parts = [k.strip() for k in spec.split(",") if k.strip()]
    bad = [k for k in parts if "/" not in k]
    if bad:
        raise ValueError(f"{what}: {bad[0]!r} is not LEVEL/ARM")
    keys = [tuple(k.rsplit("/", 1)) for k in parts]
    known = {(group_label(r), r["arm"]) for r in runs}
    unknown = [f"{lv}/{arm}" for lv, arm in keys if (lv, arm) not in known]
    if unknown or not keys:
        raise ValueError(
            f"{what}: no run is {', '.join(unknown) or repr(spec)} "
            f"(known: {', '.join(sorted(f'{a}/{b}' for a, b in known))})"
        )
    return [r for r in runs if (group_label(r), r["arm"]) in set(keys)]


def compare_table(runs: list[dict], spec: str) -> str:
    """``A vs B`` (each a comma-separated list of LEVEL/ARM groups, pooled): how many runs of each degraded and
    collapsed (:func:`degraded`, :func:`collapsed`), and the one-sided Fisher exact p that A's runs degrade
    (collapse) more often than B's by chance (:func:`fisher_greater`). Small samples: a p-value, not a rate."""
    left, sep, right = spec.partition(" vs ")
    if not sep:
        raise ValueError(f"--compare {spec!r}: expected 'LEVEL/ARM,... vs LEVEL/ARM,...'")
    a, b = select(runs, left, "--compare A"), select(runs, right, "--compare B")
    shared = {id(r) for r in a} & {id(r) for r in b}
    if shared:
        raise ValueError(f"--compare {spec!r}: A and B share {len(shared)} run(s); compare disjoint groups")
    lines = [f"A = {left.strip()}", f"B = {right.strip()}"]
    for name, test in (("degraded", degraded), ("collapsed", collapsed)):
        ka, kb = sum(map(test, a)), sum(map(test, b))
        p = fisher_greater(ka, len(a), kb, len(b))
        lines.append(f"{name}: A {ka} of {len(a)}, B {kb} of {len(b)}; one-sided Fisher p (A > B) = {p:.3f}")
    return "\n".join(lines)


def early_warning_reports(runs: list[dict], config=None) -> list:
    """``triage.early_warning.scan_log`` replayed over each run's logged series (mean |δ|, amplify-down share,
    reward): one report per run. The signals' alarms come from ``config`` (an ``EarlyWarningConfig``; None:
    the default one), the reward fall always from the default config, so the fall is the same event whatever
    ``config`` changes."""
    from dataclasses import replace

    from triage.early_warning import EarlyWarningConfig, scan_log

    def replay(run, cfg):
        s = run["series"]
        records = [
            {"step": st, "reward": rw, "triage/mean_abs_delta": d, "triage/amplify_down/share": sh}
            for st, rw, d, sh in zip(s["step"], s["reward"], s["mean_abs_delta"], s["share/amplify_down"])
        ]
        return scan_log(records, cfg)

    default = [replay(r, None) for r in runs]
    if config is None or config == EarlyWarningConfig():
        return default
    return [replace(replay(r, config), reward_fall=d.reward_fall) for r, d in zip(runs, default)]


def early_warning_counts(runs: list[dict], reports: list) -> dict:
    """What the early-warning replay's last line counts, from :func:`early_warning_reports`: ``degraded`` runs
    (:func:`degraded`), ``falls`` (degraded runs whose reward fell), ``leads`` (per degraded run whose first
    alarm, of any signal, came before the fall: the steps it came ahead), ``false_alarms`` (runs that did not
    degrade but alarmed) of ``stable`` (runs that did not degrade)."""
    counts = {"degraded": 0, "falls": 0, "leads": [], "false_alarms": 0, "stable": 0}
    for run, report in zip(runs, reports, strict=True):
        if degraded(run):
            counts["degraded"] += 1
            counts["falls"] += report.reward_fall is not None
            if report.lead_steps is not None and report.lead_steps > 0:
                counts["leads"].append(report.lead_steps)
        else:
            counts["stable"] += 1
            counts["false_alarms"] += bool(report.alarms)
    return counts


def early_warning_table(runs: list[dict]) -> str:
    """The early-warning replay per run (:func:`early_warning_reports`): the run's steps and held-out accuracy
    (first → last), whether it degraded (:func:`degraded`), the step of each signal's first alarm, of the reward
    fall, and the lead (reward fall − first alarm). The last line counts them (:func:`early_warning_counts`):
    degraded runs, those whose reward fell and how many of them an alarm preceded (lead range), and false
    alarms (runs that did not degrade but alarmed)."""
    lines = [
        "| level | arm | seed | steps | held-out first → last | degraded | reward fall | mean \\|δ\\| alarm "
        "| amplify-down share alarm | lead (steps) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    reports = early_warning_reports(runs)
    for r, report in zip(runs, reports):
        held = r["held_out"]["accuracy"]
        alarm = {name: a.step for name, a in report.alarms.items()}
        fall = report.reward_fall.step if report.reward_fall else "–"
        lead = report.lead_steps if report.lead_steps is not None else "–"
        lines.append(
            f"| {group_label(r)} | {r['arm']} | {r['seed']} | {r['steps']} | {held[0]:.3f} → {held[-1]:.3f} "
            f"| {'yes' if degraded(r) else 'no'} | {fall} "
            f"| {alarm.get('mean_abs_delta', '–')} | {alarm.get('amplify_down_share', '–')} | {lead} |"
        )
    c = early_warning_counts(runs, reports)
    leads = c["leads"]
    ahead = f" ({min(leads)}–{max(leads)} steps ahead)" if leads else ""
    lines.append(
        f"\ndegraded: {c['degraded']} run(s), the reward fell in {c['falls']}, an alarm came first in "
        f"{len(leads)}{ahead}; false alarms: {c['false_alarms']} of {c['stable']} run(s) that did not degrade"
    )
    return "\n".join(lines)


def parse_thresholds(spec: str, what: str = "--early-warning-thresholds") -> tuple[float, ...]:
    """The comma-separated CUSUM thresholds in ``spec``; ``ValueError`` naming ``what`` and the first value
    that is not a positive finite number."""
    values = []
    for part in spec.split(","):
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"{what}: {part.strip()!r} is not a number") from None
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{what}: {part.strip()!r} is not a positive finite number")
        values.append(value)
    return tuple(values)


def early_warning_sweep(runs: list[dict], thresholds) -> str:
    """One row per CUSUM threshold: the early-warning replay (:func:`early_warning_reports`) with only
    ``EarlyWarningConfig.threshold`` changed, counted as its last line counts (:func:`early_warning_counts`).
    The reward fall stays the default config's, so every row counts alarms against the same falls: degraded
    runs whose reward fell, of them those an alarm preceded, the median and min–max of those leads, and false
    alarms among the runs that did not degrade."""
    from dataclasses import replace

    from triage.early_warning import EarlyWarningConfig

    default = EarlyWarningConfig()
    lines = [
        "| threshold | degraded runs with a reward fall | alarm before the fall | median lead (steps) "
        "| lead min–max (steps) | false alarms |",
        "|---|---|---|---|---|---|",
    ]
    for threshold in thresholds:
        config = replace(default, threshold=threshold)
        c = early_warning_counts(runs, early_warning_reports(runs, config))
        leads = c["leads"]
        label = f"{threshold:g}" + (" (default)" if threshold == default.threshold else "")
        median = f"{statistics.median(leads):g}" if leads else "–"
        span = f"{min(leads)}–{max(leads)}" if leads else "–"
        lines.append(
            f"| {label} | {c['falls']} of {c['degraded']} | {len(leads)} of {c['falls']} | {median} | {span} "
            f"| {c['false_alarms']} of {c['stable']} |"
        )
    return "\n".join(lines)


PANELS = (
    ("reward", "sampled reward (DAPO ±1 + overlong)"),
    ("held_out", "held-out greedy accuracy (learner)"),
    ("mean_abs_delta", "mean |δ| (nats)"),
    ("entropy", "entropy (nats/token)"),
    ("grad_norm", "gradient norm"),
)


#: Drawn when a run logged the per-class gradient shares (``triage/<class>/grad_share``).
GRAD_SHARE_PANEL = ("below_band_grad_share", "gradient share below the band (δ < −τ)")


def _steps_and_values(run: dict, name: str) -> tuple[list, list]:
    if name == "held_out":
        return run["held_out"]["step"], run["held_out"]["accuracy"]
    steps = run["series"]["step"]
    if name == GRAD_SHARE_PANEL[0]:
        return steps, _below_band_grad(run["series"]) or [None] * len(steps)
    return steps, run["series"][name]


def plot(runs: list[dict], path: str | Path) -> None:
    """Reward, held-out accuracy, mean |δ|, entropy and gradient norm vs step (and, when a run logged the
    per-class gradient shares, the share below the band): one colour per (level, arm), the mean over seeds
    as a line and the min–max over seeds as a band (steps where every seed has a value)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = {f"{level} / {arm}": rs for (level, arm), rs in _groups(runs).items()}
    panels = PANELS + ((GRAD_SHARE_PANEL,) if any(_below_band_grad(r["series"]) for r in runs) else ())
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8))
    for ax, (name, title) in zip(axes, panels):
        for i, (label, rs) in enumerate(groups.items()):
            per_seed = [dict(zip(*_steps_and_values(r, name))) for r in rs]
            steps = sorted(
                set.intersection(*(set(k for k, v in d.items() if v is not None) for d in per_seed))
            )
            if not steps:
                continue
            vals = [[d[t] for d in per_seed] for t in steps]
            color = f"C{i}"
            ax.plot(steps, [sum(v) / len(v) for v in vals], color=color, label=f"{label} ({len(rs)} seeds)")
            ax.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals], color=color, alpha=0.15)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("optimizer step")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _compact(value):
    """``value`` with every float rounded to 6 significant digits (the committed summaries stay small)."""
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {k: _compact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_compact(v) for v in value]
    return value


def _checkpoint(sft: dict) -> dict:
    """The SFT record a summary keeps (config, size, how it stopped, its evaluations), floats compacted: two
    sources with different records trained on different checkpoints."""
    return _compact(
        {k: sft.get(k) for k in ("config", "params", "steps_done", "stopped_by", "final", "eval")}
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", nargs="*", help="one or more study folders, read as one study")
    ap.add_argument(
        "--json", default=None, help="write every run's series here (default RUN_DIR/testbed.json)"
    )
    ap.add_argument(
        "--from-json",
        action="append",
        default=[],
        help="also read a summary JSON this command wrote (repeatable; with RUN_DIRs, one study)",
    )
    ap.add_argument(
        "--select",
        default=None,
        help="comma-separated LEVEL/ARM pairs to keep (LEVEL as the table "
        "shows it, e.g. 'aligned (lr 0.0002)')",
    )
    ap.add_argument(
        "--plot", default=None, help="write the figure (reward, held-out, |δ|, entropy, grad norm vs step)"
    )
    ap.add_argument(
        "--rename-arm",
        action="append",
        default=[],
        metavar="OLD=NEW",
        help="report runs of arm OLD as NEW (an arm renamed since the runs; the run keeps arm_as_run, the name it ran under)",
    )
    ap.add_argument(
        "--early-warning", action="store_true", help="also print the early-warning replay per run"
    )
    ap.add_argument(
        "--early-warning-thresholds",
        default=None,
        metavar="T,T,...",
        help="also print one row per CUSUM threshold (e.g. 4,6,8,10,12): the early-warning replay's alarms, "
        "leads and false alarms with only the threshold changed (the reward fall stays the default's)",
    )
    ap.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="'A vs B'",
        help="'LEVEL/ARM,... vs LEVEL/ARM,...' (repeatable): runs degraded and collapsed in each pooled group "
        "and the one-sided Fisher exact p that A's do so more often than B's",
    )
    ap.add_argument(
        "--window",
        default=None,
        metavar="A:B",
        help="also print, per run and per (level, arm), the means over the logged steps A..B (both included) "
        "of reward, entropy, mean |δ|, grad norm, completion length and the below-band grad share",
    )
    args = ap.parse_args(argv)
    if args.window is not None:
        try:
            window = parse_window(args.window)
        except ValueError as err:
            ap.error(str(err))
    if args.early_warning_thresholds is not None:
        try:
            thresholds = parse_thresholds(args.early_warning_thresholds)
        except ValueError as err:
            ap.error(str(err))
    if not (args.run_dir or args.from_json):
        ap.error("give RUN_DIR(s) and/or --from-json FILE")
    earlier = [json.loads(Path(f).read_text()) for f in args.from_json]
    sources = {f: e.get("sft") for f, e in zip(args.from_json, earlier)}
    for d in args.run_dir:
        if (Path(d) / "sft" / "sft.json").is_file():
            sources[d] = json.loads((Path(d) / "sft" / "sft.json").read_text())
    checkpoints = {json.dumps(_checkpoint(v), sort_keys=True): name for name, v in sources.items() if v}
    if len(checkpoints) > 1:  # a run's (level, arm, seed) means another run on another checkpoint
        ap.error(
            f"{', '.join(checkpoints.values())} come from different SFT checkpoints: summarize each on its own"
        )
    unknown = [name for name, v in sources.items() if not v]
    if unknown and checkpoints:
        print(
            f"warning: {', '.join(unknown)} name no SFT checkpoint; read as runs of the one of "
            f"{next(iter(checkpoints.values()))}",
            file=sys.stderr,
        )
    runs = merge([r for e in earlier for r in e["runs"]] + load_runs(*map(Path, args.run_dir)))
    for spec in args.rename_arm:
        old, sep, new = spec.partition("=")
        if not (sep and old and new):
            ap.error(f"--rename-arm {spec!r}: expected OLD=NEW")
        renamed = [r for r in runs if r["arm"] == old]
        for r in renamed:  # a run renamed before keeps the name it ran under
            r["arm_as_run"], r["arm"] = r.get("arm_as_run") or old, new
    if args.select:
        try:
            runs = select(runs, args.select)
        except ValueError as err:
            ap.error(str(err))
    print(table(runs))
    if args.early_warning:
        print()
        print(early_warning_table(runs))
    if args.early_warning_thresholds is not None:
        print()
        print(early_warning_sweep(runs, thresholds))
    if args.window is not None:
        print()
        print(window_table(runs, *window))
    for spec in args.compare:
        print()
        try:
            print(compare_table(runs, spec))
        except ValueError as err:
            ap.error(str(err))
    if args.plot:
        plot(runs, args.plot)
    missing = sorted(  # a log without its run's result file (seed1.log is not answered by seed10.json)
        str(p)
        for d in args.run_dir
        for p in Path(d).glob("runs/*/*/seed*.log")
        if not any(p.with_name(p.stem + suffix).is_file() for suffix in (".json", PARTIAL_SUFFIX))
    )
    for m in missing:
        print(f"FAILED (no result): {m}")
    if not (args.run_dir or args.json):
        return 0  # only summary JSONs read: nothing new to write unless --json asks for the merged study
    sft = next(
        (Path(d) / "sft" / "sft.json" for d in args.run_dir if (Path(d) / "sft" / "sft.json").is_file()), None
    )
    out = {
        "sft": json.loads(sft.read_text()) if sft else next((e["sft"] for e in earlier if e.get("sft")), None)
    }
    out["runs"] = runs
    if sft and out["sft"]:
        out["sft"] = _checkpoint(out["sft"])
    Path(args.json or Path(args.run_dir[0]) / "testbed.json").write_text(
        json.dumps(_compact(out), separators=(",", ":")) + "\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
