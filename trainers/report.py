"""The report of a TRIAGE run: ``report.json`` plus PNG plots, from the trainer's ``state.log_history``.

Every number comes from what the trainer logged (TRL's metrics and the ``triage/...`` metrics); nothing is
recomputed or smoothed. ``report.json``::

    {"config": {...}, "steps": [{"step": 1, "loss": ..., "reward": ..., "triage/...": ...}, ...],
     "summary": {"steps", "reward_first", "reward_last", "reward_mean", "mean_abs_delta", "tau_last",
                 "class_share": {class: share of all tokens}, "class_weight": {class: mean weight},
                 "suppressed_frac", "guarded_frac"}, "plots": [file names]}

Plots: ``reward.png`` (reward ± std per step), ``mismatch.png`` (mean |δ|, δ quantiles and τ),
``classes.png`` (token share of each class, stacked), ``weights.png`` (mean weight per class).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

CLASSES = ("inert", "consistent", "correct_up", "correct_down", "amplify_up", "amplify_down")
QUANTILE_KEYS = ("p0.1", "p1", "p50", "p99", "p99.9")
_STEP_KEYS = ("step", "loss", "reward", "reward_std", "grad_norm", "entropy", "completions/mean_length")


def training_steps(log_history: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The per-step training records (entries with a ``loss``), keeping TRL's and the ``triage/`` keys."""
    steps = []
    for entry in log_history:
        if "loss" not in entry or "train_runtime" in entry:
            continue
        steps.append({k: v for k, v in entry.items() if k in _STEP_KEYS or k.startswith("triage/")})
    return steps


def _mean(values: Sequence[float]) -> float | None:
    values = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return sum(values) / len(values) if values else None


def summarize(steps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Run-level numbers: first/last/mean reward, mean |δ|, final τ, mean class shares and weights."""
    if not steps:
        return {"steps": 0}

    def column(key):
        return [s[key] for s in steps if key in s]

    rewards = column("reward")
    summary: dict[str, Any] = {
        "steps": len(steps),
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "reward_mean": _mean(rewards),
        "mean_abs_delta": _mean(column("triage/mean_abs_delta")),
        "tau_last": column("triage/tau")[-1] if column("triage/tau") else None,
        "suppressed_frac": _mean(column("triage/suppressed_frac")),
        "guarded_frac": _mean(column("triage/guarded_frac")),
    }
    summary.update(_class_totals(steps))
    return summary


def _class_totals(steps: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Token-weighted over the run: share = Σ class tokens / Σ tokens; weight = Σ class weight / Σ class tokens.

    Each logged entry holds TRL's averages over the micro-batches since the last log, so the weighting is
    per logged entry: exact with ``logging_steps=1`` and no gradient accumulation, otherwise the mean of the
    averaged shares weighted by the averaged token counts (a close approximation when batches are alike)."""
    tokens = {c: 0.0 for c in CLASSES}
    weight = {c: 0.0 for c in CLASSES}
    total = 0.0
    for s in steps:
        n = s.get("triage/tokens")
        if not n:
            continue
        total += n
        for c in CLASSES:
            count = s.get(f"triage/{c}/share", 0.0) * n
            tokens[c] += count
            weight[c] += s.get(f"triage/{c}/mean_weight", 0.0) * count
    if total == 0:
        return {"class_share": {c: None for c in CLASSES}, "class_weight": {c: None for c in CLASSES}}
    return {
        "class_share": {c: tokens[c] / total for c in CLASSES},
        "class_weight": {c: (weight[c] / tokens[c] if tokens[c] > 0 else None) for c in CLASSES},
    }


def _plot(path: Path, title: str, xlabel: str, ylabel: str, series, stacked: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    if stacked:
        xs = series[0][1]
        ax.stackplot(xs, *[ys for _, _, ys in series], labels=[name for name, _, _ in series])
    else:
        for name, xs, ys in series:
            if xs:
                ax.plot(xs, ys, marker="o", markersize=3, label=name)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _series(steps, key, name=None):
    pairs = [(s["step"], s[key]) for s in steps if key in s and s[key] is not None]
    return (name or key, [p[0] for p in pairs], [p[1] for p in pairs])


def write_plots(steps: Sequence[Mapping[str, Any]], output_dir: str | Path) -> list[str]:
    """The four PNGs (module docstring) in ``output_dir``; returns their file names (none without steps)."""
    output_dir = Path(output_dir)
    if not steps:
        return []
    files = []
    _plot(output_dir / "reward.png", "reward", "step", "mean reward", [_series(steps, "reward")])
    files.append("reward.png")
    mismatch = [_series(steps, "triage/mean_abs_delta", "mean |δ|"), _series(steps, "triage/tau", "τ")]
    mismatch += [_series(steps, f"triage/delta_{q}", f"δ {q}") for q in QUANTILE_KEYS]
    _plot(output_dir / "mismatch.png", "learner − sampler log-prob gap δ", "step", "nats", mismatch)
    files.append("mismatch.png")
    if all(f"triage/{c}/share" in s for s in steps for c in CLASSES):
        shares = [_series(steps, f"triage/{c}/share", c) for c in CLASSES]
        _plot(output_dir / "classes.png", "token classes", "step", "share of tokens", shares, stacked=True)
        weights = [_series(steps, f"triage/{c}/mean_weight", c) for c in CLASSES if c != "inert"]
        _plot(output_dir / "weights.png", "mean TRIAGE weight per class", "step", "weight", weights)
        files += ["classes.png", "weights.png"]
    return files


def write_report(
    log_history: Sequence[Mapping[str, Any]],
    output_dir: str | Path,
    config: Mapping[str, Any] | None = None,
    plots: bool = True,
) -> dict[str, Any]:
    """Write ``report.json`` (and the plots) to ``output_dir``; returns the report dict."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    steps = training_steps(log_history)
    report = {
        "config": dict(config or {}),
        "steps": steps,
        "summary": summarize(steps),
        "plots": write_plots(steps, output_dir) if plots else [],
    }
    (output_dir / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    return report


def _fmt(value: Any, spec: str = ".3f") -> str:
    return "n/a" if value is None else format(value, spec)


def format_summary(report: Mapping[str, Any]) -> str:
    """A short human-readable summary of a report (what ``triage demo`` prints)."""
    s = report["summary"]
    if not s.get("steps"):
        return "no training step was logged"
    lines = [
        f"steps              {s['steps']}",
        f"reward             {_fmt(s['reward_first'])} (first) -> {_fmt(s['reward_last'])} (last), "
        f"mean {_fmt(s['reward_mean'])}",
        f"mean |δ|           {_fmt(s['mean_abs_delta'], '.4f')} nats (learner − sampler log-prob)",
        f"τ (last)           {_fmt(s['tau_last'], '.4f')}",
        f"suppressed tokens  {_fmt(s['suppressed_frac'], '.1%')}   guarded responses {_fmt(s['guarded_frac'], '.1%')}",
        "token classes      share    mean weight",
    ]
    for c in CLASSES:
        share, weight = s["class_share"].get(c), s["class_weight"].get(c)
        lines.append(f"  {c:<16} {_fmt(share, '6.1%')}   {_fmt(weight, '.3f')}")
    return "\n".join(lines)
