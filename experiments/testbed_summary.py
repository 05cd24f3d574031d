"""Summary of a mismatch-testbed folder (``experiments/testbed/study.sh``): mean ± std over seeds per
(level, arm), and one small JSON of every run's per-step series for ``docs/results/``.

    python -m triage.experiments.testbed_summary RUN_DIR [--json OUT.json] [--plot OUT.png]
    python -m triage.experiments.testbed_summary --from-json docs/results/testbed/X.json [--select LEVEL/ARM,...]
        [--plot OUT.png]                  # the table (and figure) of a committed summary

``RUN_DIR/runs/<level>/<arm>/seed<k>.json`` are the finished runs and ``seed<k>.partial.json`` the runs a time
budget cut short (both written by ``triage ablate``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from triage.experiments.ablate import PARTIAL_SUFFIX

SERIES = (
    "reward", "accuracy", "entropy", "mean_abs_delta", "suppressed_frac", "completion_length", "kl_k3",
    "grad_norm", "guarded_frac", "share/amplify_down", "share/amplify_up", "share/inert",
)  # the early-warning signal (amplify-down share) included


def load_runs(root: Path) -> list[dict]:
    runs = []
    for f in sorted(root.glob("runs/*/*/seed*.json")):
        e = json.loads(f.read_text())
        level, arm, seed = e["level"], e["arm"], e["seed"]
        s = e["series"]
        runs.append({
            "level": level, "arm": arm, "seed": seed, "correction": e.get("correction"),
            "complete": e.get("complete", True), "steps": len(s["step"]), "seconds": e["seconds"],
            "mean_abs_delta_step1": s["mean_abs_delta"][0] if s["mean_abs_delta"] else None,
            "series": {k: s.get(k) for k in ("step", *SERIES)},
            "held_out": {k: e["held_out"][k] for k in ("step", "accuracy")},
        })
    return runs


def _window(values, first: bool, n: int = 10):
    vals = [v for v in (values[:n] if first else values[-n:]) if v is not None]
    return sum(vals) / len(vals) if vals else None


def _ms(values) -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "–"
    if len(vals) == 1:
        return f"{vals[0]:.3f}"
    return f"{statistics.mean(vals):.3f} ± {statistics.stdev(vals):.3f}"


def table(runs: list[dict]) -> str:
    lines = [
        "| level | arm | seeds | steps | \\|δ\\| step 1 | \\|δ\\| run | reward first 10 → last 10 | held-out first → last "
        "| entropy last 10 | s/step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple, list] = {}
    for r in runs:
        groups.setdefault((r["level"], r["arm"]), []).append(r)
    for (level, arm), rs in groups.items():
        s = [r["series"] for r in rs]
        held = [r["held_out"]["accuracy"] for r in rs]
        lines.append(
            f"| {level} | {arm} | {len(rs)} | {'/'.join(str(r['steps']) for r in rs)} "
            f"| {_ms([r['mean_abs_delta_step1'] for r in rs])} "
            f"| {_ms([_window(x['mean_abs_delta'], True, 10**9) for x in s])} "
            f"| {_ms([_window(x['reward'], True) for x in s])} → {_ms([_window(x['reward'], False) for x in s])} "
            f"| {_ms([h[0] for h in held])} → {_ms([h[-1] for h in held])} "
            f"| {_ms([_window(x['entropy'], False) for x in s])} "
            f"| {_ms([r['seconds'] / max(r['steps'], 1) for r in rs])} |"
        )
    return "\n".join(lines)


PANELS = (("reward", "sampled reward (DAPO ±1 + overlong)"), ("held_out", "held-out greedy accuracy (learner)"),
          ("mean_abs_delta", "mean |δ| (nats)"), ("entropy", "entropy (nats/token)"))


def _steps_and_values(run: dict, name: str) -> tuple[list, list]:
    if name == "held_out":
        return run["held_out"]["step"], run["held_out"]["accuracy"]
    return run["series"]["step"], run["series"][name]


def plot(runs: list[dict], path: str | Path) -> None:
    """Reward, held-out accuracy, mean |δ| and entropy vs step: one colour per (level, arm), the mean over
    seeds as a line and the min–max over seeds as a band (steps where every seed has a value)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[str, list] = {}
    for r in runs:
        groups.setdefault(f"{r['level']} / {r['arm']}", []).append(r)
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.8))
    for ax, (name, title) in zip(axes, PANELS):
        for i, (label, rs) in enumerate(groups.items()):
            per_seed = [dict(zip(*_steps_and_values(r, name))) for r in rs]
            steps = sorted(set.intersection(*(set(k for k, v in d.items() if v is not None) for d in per_seed)))
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", nargs="?")
    ap.add_argument("--json", default=None, help="write every run's series here (default RUN_DIR/testbed.json)")
    ap.add_argument("--from-json", default=None, help="read a summary JSON this command wrote, not a RUN_DIR")
    ap.add_argument("--select", default=None, help="comma-separated LEVEL/ARM pairs to keep")
    ap.add_argument("--plot", default=None, help="write the figure (reward, held-out, |δ|, entropy vs step)")
    args = ap.parse_args(argv)
    if (args.run_dir is None) == (args.from_json is None):
        ap.error("give RUN_DIR or --from-json, not both")
    if args.from_json:
        runs = json.loads(Path(args.from_json).read_text())["runs"]
        if args.select:
            keep = {tuple(k.split("/")) for k in args.select.split(",")}
            runs = [r for r in runs if (r["level"], r["arm"]) in keep]
        print(table(runs))
        if args.plot:
            plot(runs, args.plot)
        return 0
    root = Path(args.run_dir)
    runs = load_runs(root)
    print(table(runs))
    if args.plot:
        plot(runs, args.plot)
    missing = sorted(  # a log without its run's result file (seed1.log is not answered by seed10.json)
        str(p)
        for p in root.glob("runs/*/*/seed*.log")
        if not any(p.with_name(p.stem + suffix).is_file() for suffix in (".json", PARTIAL_SUFFIX))
    )
    for m in missing:
        print(f"FAILED (no result): {m}")
    sft = root / "sft" / "sft.json"
    out = {"sft": json.loads(sft.read_text()) if sft.is_file() else None, "runs": runs}
    if out["sft"]:
        out["sft"] = {k: out["sft"].get(k) for k in ("config", "params", "steps_done", "stopped_by", "final", "eval")}
    Path(args.json or root / "testbed.json").write_text(json.dumps(out, separators=(",", ":")) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
