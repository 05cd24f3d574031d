"""The study's figures: one PNG per mismatch level, one panel per metric, one colour per arm.

Each panel plots a metric against the optimizer step: the mean over seeds as a line, and the band from the
minimum to the maximum over seeds (no band with one seed). Panels (2 × 3): training reward, held-out greedy
accuracy (learner), mean |δ| (learner − sampler log-prob gap), token entropy, fraction of tokens the
correction suppressed, and the gradient norm. Every value is read from ``results.json`` (``triage ablate``:
``groups[level][arm]``); nothing is smoothed or recomputed.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["PANELS", "plot_level"]

#: (series name in a group's ``series``, or ``"held_out"``; panel title; y label), in figure order.
PANELS = (
    ("reward", "training reward (DAPO ±1 + overlong penalty)", "mean reward"),
    ("held_out", "held-out accuracy (greedy, learner)", "accuracy"),
    ("mean_abs_delta", "mean |δ| (learner − sampler)", "nats"),
    ("entropy", "token entropy", "nats"),
    ("suppressed_frac", "tokens suppressed by the correction", "fraction"),
    ("grad_norm", "gradient norm (before clipping)", "L2 norm"),
)


def _band(group: Mapping[str, Any], name: str) -> tuple[list, list, list, list]:
    """(steps, mean, min, max) of one series of a group, at the steps where some seed measured it."""
    band = group.get("held_out") if name == "held_out" else (group.get("series") or {}).get(name)
    band = band or {}
    rows = [
        (s, m, lo, hi)
        for s, m, lo, hi in zip(
            band.get("step", []), band.get("mean", []), band.get("min", []), band.get("max", [])
        )
        if m is not None
    ]
    return tuple(list(col) for col in zip(*rows)) if rows else ([], [], [], [])


def plot_level(results: Mapping[str, Any], level: str, path: str | Path) -> Path:
    """Write the figure of ``level`` (``results["groups"][level]``) to ``path``; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = (results.get("groups") or {}).get(level) or {}
    if not arms:
        raise ValueError(f"plot_level: results hold no run of level {level!r}")
    path = Path(path)
    fig, axes = plt.subplots(2, 3, figsize=(15, 8), dpi=100)
    colors = {name: plt.cm.tab10(i % 10) for i, name in enumerate(arms)}
    for ax, (key, panel, ylabel) in zip(axes.flat, PANELS):
        for name, group in arms.items():
            steps, mean, low, high = _band(group, key)
            if not steps:
                continue
            label = f"{name} (n={group.get('n')})"
            ax.plot(steps, mean, marker="o", markersize=2.5, linewidth=1.2, label=label, color=colors[name])
            if (group.get("n") or 0) > 1:
                ax.fill_between(steps, low, high, alpha=0.2, color=colors[name], linewidth=0)
        ax.set_title(panel, fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8, loc="best")
    fig.suptitle(
        f"triage ablate, scale {results.get('scale', '?')}, level {level}: mean over seeds, band min–max",
        fontsize=12,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
