"""The ablation's combined figure: one PNG, one panel per metric, one line (or bar group) per arm.

Panels (2 × 3): training reward, held-out greedy accuracy, token entropy, mean |δ| (learner − sampler
log-prob gap), fraction of tokens the correction suppressed, and the run-level token share of each TRIAGE
class per arm (grouped bars). Every value is read from ``results.json`` (``triage ablate``); nothing is
smoothed or recomputed.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from triage.trainers.report import CLASSES

__all__ = ["LINE_PANELS", "plot_ablation"]

#: (series key in an arm's ``series``, panel title, y label) of the line panels, in figure order.
LINE_PANELS = (
    ("reward", "training reward (DAPO ±1 + overlong penalty)", "mean reward"),
    ("held_out_accuracy", "held-out accuracy (greedy, learner)", "accuracy"),
    ("entropy", "token entropy", "nats"),
    ("mean_abs_delta", "mean |δ| (learner − sampler)", "nats"),
    ("suppressed_frac", "tokens suppressed by the correction", "fraction"),
)


def _xy(arm: Mapping[str, Any], key: str) -> tuple[list, list]:
    if key == "held_out_accuracy":
        held = arm.get("held_out") or {}
        steps, values = held.get("step", []), held.get("accuracy", [])
    else:
        series = arm.get("series") or {}
        steps, values = series.get("step", []), series.get(key, [])
    pairs = [(s, v) for s, v in zip(steps, values) if v is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot_ablation(results: Mapping[str, Any], path: str | Path, title: str | None = None) -> Path:
    """Write the combined PNG of ``results`` (the ``results.json`` dict) to ``path``; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = results.get("arms") or {}
    if not arms:
        raise ValueError("plot_ablation: results hold no arm")
    path = Path(path)
    fig, axes = plt.subplots(2, 3, figsize=(15, 8), dpi=100)
    colors = {name: plt.cm.tab10(i % 10) for i, name in enumerate(arms)}
    for ax, (key, panel, ylabel) in zip(axes.flat, LINE_PANELS):
        for name, arm in arms.items():
            xs, ys = _xy(arm, key)
            if xs:
                ax.plot(xs, ys, marker="o", markersize=2.5, linewidth=1.2, label=name, color=colors[name])
        ax.set_title(panel, fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8, loc="best")

    ax = axes.flat[5]
    width = 0.8 / len(arms)
    for i, (name, arm) in enumerate(arms.items()):
        shares = (arm.get("summary") or {}).get("class_share") or {}
        values = [shares.get(c) or 0.0 for c in CLASSES]
        xs = [j + (i - (len(arms) - 1) / 2) * width for j in range(len(CLASSES))]
        ax.bar(xs, values, width=width, label=name, color=colors[name])
    ax.set_xticks(range(len(CLASSES)))
    ax.set_xticklabels([c.replace("_", "-") for c in CLASSES], rotation=20, fontsize=8)
    ax.set_yscale("log")
    ax.set_title("token classes over the run (share of tokens, log scale)", fontsize=10)
    ax.grid(alpha=0.3, axis="y")

    fig.suptitle(title or f"TRIAGE ablation, preset {results.get('preset', '?')}", fontsize=12)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
