"""``triage demo``: the learner–sampler mismatch of a low-precision sampler, and what TRIAGE does with it.

Runs on any machine (CPU is fine, no hub) in about a minute:

* a tiny Qwen3-architecture model and a ChatML BPE tokenizer built locally (``triage.trainers.tiny``);
* synthetic DAPO-format arithmetic prompts (``triage.experiments.data.synthetic_math``);
* rewards: DAPO's ±1 ``math_dapo`` accuracy plus a dense shaping reward, the share of digits in the response
  (a randomly initialised model never writes a correct ``Answer: N``, so accuracy alone gives every group
  equal rewards, zero advantages and nothing to learn or to show);
* the learner/sampler numerics of a mismatch level (``experiments/recipes/levels``; default
  ``nvfp4-row-fp8kv``: an fp32 learner against the built-in HF sampler on an NVFP4 W4A4 copy with per-row
  outer scales (per token for activations, per output row for weights) and an fp8 e4m3 KV cache, the tiny
  preset's sampler);
* the same steps twice from the same seed: with the correction (default ``triage``) and with vanilla GRPO
  (``correction="none"``). Step 1 of both samples the same completions from the same weights.

What it reports: at step 1, the per-token gap δ = log π_learner − log π_sampler (mean |δ|, quantiles), the
TRIAGE class of every token with its share, mean δ, mean weight and loss-mass share without → with the
weights (``triage.mismatch_metrics`` on the captured batch, once with w = 1), the share of tokens cut by
more than 1 % (w < 0.99) and the largest cut; then both runs side by side (reward, mean |δ|, suppressed
share per step). Files in ``--output``: ``summary.txt`` (what it prints), ``report.json``, ``step1.png``
(δ histogram by class; weight against δ), ``compare.png`` (both runs per step), and one folder per run with
that run's ``report.json`` and plots (``triage.trainers.report``).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from triage import CORRECTIONS
from triage.experiments.recipes import LEVELS

DEFAULT_LEVEL = "nvfp4-row-fp8kv"
# About the median |δ| of the default level on the tiny model (mean |δ| ≈ 0.014), so roughly half of the
# tokens fall outside the band and get their class policy; the library default (0.05) would put ~99 % of them
# inside it at this gap.
DEFAULT_TAU = "0.01"
BASELINE = "none"


def _option(default, help: str, **extra) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class DemoConfig:
    """The options of ``triage demo``: each field is a flag (``--max-completion-length 12``), and ``--config
    demo.yaml`` reads them from a YAML mapping of these keys (flags win), both by ``trl.TrlParser``; an
    unknown key in the file is an error naming it."""

    output: str = _option("./triage-demo", "folder for the report and the plots")
    steps: int = _option(12, "optimizer steps per run")
    prompts: int = _option(4, "prompts per step")
    generations: int = _option(4, "completions per prompt")
    max_completion_length: int = _option(24, "completion tokens at most")
    learning_rate: float = _option(3e-3, "AdamW learning rate")
    correction: str = _option("triage", "mismatch correction", choices=CORRECTIONS)
    no_baseline: bool = _option(False, "skip the vanilla GRPO run (correction none) beside the corrected one")
    tau: str = _option(
        DEFAULT_TAU,
        f"tolerance band |δ| ≤ τ in nats, or 'auto' (default {DEFAULT_TAU}: about the median |δ| of the "
        "default level on the tiny model)",
    )
    level: str = _option(
        DEFAULT_LEVEL,
        f"learner/sampler numerics (experiments/recipes/levels; default {DEFAULT_LEVEL}: fp32 learner, "
        "NVFP4 W4A4 sampler copy with per-row/per-token scales and an fp8 KV cache)",
        choices=LEVELS,
    )
    seed: int = _option(0, "run seed (model init, prompts, sampling)")
    no_plots: bool = _option(False, "write the text and JSON only")


def parse_args(argv: list[str], prog: str = "triage demo", description: str | None = None) -> DemoConfig:
    """``triage demo``'s flags: the :class:`DemoConfig` fields through ``trl.TrlParser`` (``--config FILE``
    sets the fields from a YAML mapping, flags win; an unknown key in the file is a ``ValueError``)."""
    from trl import TrlParser

    from triage.cli import DEBUG_FLAG, DEBUG_HELP

    parser = TrlParser([DemoConfig], prog=prog, description=description)
    parser.add_argument("--config", metavar="FILE.yaml", help="a YAML mapping of DemoConfig fields")
    parser.add_argument(DEBUG_FLAG, action="store_true", help=DEBUG_HELP)
    return parser.parse_args_and_config(argv)[0]


def digit_share(completions, **_) -> list[float]:
    """Dense shaping reward: the share of characters of the response that are digits (0..1)."""
    from triage.trainers.rewards import completion_text

    out = []
    for i, completion in enumerate(completions):
        text = completion_text(completion, i)
        out.append(sum(ch.isdigit() for ch in text) / len(text) if text else 0.0)
    return out


@contextlib.contextmanager
def quiet():
    """Silence library warnings and progress bars for a CLI run (the demo's, `triage ablate`'s; restored
    afterwards)."""
    import transformers

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    hf_logging = transformers.utils.logging
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _progress_callback(total: int, desc: str):
    from tqdm.auto import tqdm
    from transformers import TrainerCallback

    class DemoProgress(TrainerCallback):
        """One bar per run; the postfix shows the last step's reward and mean |δ|."""

        def on_train_begin(self, args, state, control, **kwargs):
            self.bar = tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.bar.set_postfix(
                    reward=f"{logs.get('reward', float('nan')):.3f}",
                    mean_abs_delta=f"{logs.get('triage/mean_abs_delta', float('nan')):.4f}",
                )

        def on_step_end(self, args, state, control, **kwargs):
            self.bar.update(1)

        def on_train_end(self, args, state, control, **kwargs):
            self.bar.close()

    return DemoProgress()


def _trainer_class():
    from triage.trainers.grpo_trainer import TriageGRPOTrainer

    class DemoTrainer(TriageGRPOTrainer):
        """``TriageGRPOTrainer`` that keeps the tensors its loss used on the first training batch: per-token
        δ, advantages, completion mask, correction weights, sampler log-probs and τ (``first_batch``, on the
        CPU)."""

        first_batch: dict[str, Any] | None = None

        def _observe(self, delta, advantages, mask, weights, tau: float, sampler_logps) -> None:
            if self.first_batch is None and self.model.training:
                tensors = {
                    "delta": delta,
                    "advantages": advantages,
                    "mask": mask,
                    "weights": weights,
                    "sampler_logps": sampler_logps,
                }
                self.first_batch = {k: v.detach().float().cpu() for k, v in tensors.items()} | {"tau": tau}
            super()._observe(delta, advantages, mask, weights, tau, sampler_logps)

    return DemoTrainer


def level_numerics(name: str) -> dict[str, Any]:
    """The learner/sampler numerics keys of mismatch level ``name`` (``experiments/recipes/levels``)."""
    from triage.experiments.recipes import load_layer

    return load_layer("levels", name)


def describe_numerics(level: dict[str, Any]) -> tuple[str, str]:
    """(learner, sampler) in words, from a level's keys (the demo's model is built in fp32)."""

    def nvfp4(recipe: dict[str, Any] | None) -> str:
        recipe = recipe or {}
        scale = recipe.get("scale", "tensor")
        scale = {
            "row": "outer scales per token and per weight row",
            "tensor": "tensor-wide outer scales",
        }.get(scale, f"{scale} outer scales")
        return f"NVFP4 W4A4 ({scale}, {recipe.get('profile', 'te')} profile)"

    learner = nvfp4(level.get("quant_recipe")) if level.get("learner_precision") == "nvfp4" else "fp32"
    if level.get("bf16"):
        learner += " under bf16 autocast"
    sampler_kwargs = level.get("sampler_kwargs", {})
    precision = sampler_kwargs.get("precision")
    if precision == "nvfp4":
        sampler = f"{nvfp4(sampler_kwargs.get('quant_recipe'))} copy"
    elif precision is not None or sampler_kwargs.get("sampler_model") == "copy":
        sampler = f"{precision or sampler_kwargs.get('dtype') or 'fp32'} copy"
    else:
        sampler = "the learner's own model"
    kv = sampler_kwargs.get("kv_cache_dtype")
    return learner, sampler + f", {'native' if kv in (None, 'auto', 'native') else kv} KV cache"


def build_trainer(args: DemoConfig, correction: str | None = None):
    """The demo's trainer (tiny model, synthetic data, HF sampler with the level's numerics) for one run."""
    import torch

    from triage.experiments.data import synthetic_math
    from triage.trainers.config import TriageGRPOConfig
    from triage.trainers.rewards import build_reward_funcs
    from triage.trainers.tiny import TinyModelSpec, build_model, build_tokenizer

    for name in ("steps", "prompts", "max_completion_length"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.generations < 2:
        raise ValueError("--generations must be >= 2 (GRPO compares completions of the same prompt)")
    correction = correction or args.correction
    level = dict(level_numerics(args.level))
    sampler_kwargs = {"seed": args.seed, **level.pop("sampler_kwargs", {})}
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, TinyModelSpec(), seed=args.seed)
    dataset = synthetic_math(args.steps * args.prompts, difficulty=1, seed=args.seed)
    config = TriageGRPOConfig(
        output_dir=str(Path(args.output) / correction / "trainer"),
        use_cpu=not torch.cuda.is_available(),
        max_steps=args.steps,
        per_device_train_batch_size=args.prompts * args.generations,
        num_generations=args.generations,
        max_completion_length=args.max_completion_length,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=args.seed,
        correction=correction,
        tau=args.tau,
        sampler="hf",
        sampler_kwargs=sampler_kwargs,
        **level,  # learner_precision, quant_recipe, bf16
    )
    rewards = build_reward_funcs(["dapo_accuracy"], args.max_completion_length) + [digit_share]
    trainer = _trainer_class()(
        model=model,
        reward_funcs=rewards,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # the raw log dicts; the demo prints a summary instead
    trainer.add_callback(_progress_callback(args.steps, _arm_name(correction)))
    return trainer


def _arm_name(correction: str) -> str:
    return {"none": "vanilla GRPO", "triage": "TRIAGE"}.get(correction, correction)


def step1_analysis(batch: dict[str, Any], triage_config) -> dict[str, Any]:
    """Step 1 of the corrected run: δ statistics, per-class numbers with and without the weights, cuts.

    ``mass_share`` is a class's share of Σ |w·A| (what the class contributes to the gradient's scale);
    ``mass_share_unweighted`` the same with w = 1, i.e. vanilla GRPO on the same tokens."""
    import torch

    from triage import TokenClass, classify_tokens, mismatch_metrics
    from triage.trainers.report import CLASSES

    delta, adv, mask, weights, tau = (batch[k] for k in ("delta", "advantages", "mask", "weights", "tau"))
    sampler = {"sampler_logps": batch.get("sampler_logps")}  # the probability-space band needs them
    with_w = mismatch_metrics(delta, adv, mask, weights, triage_config, tau=tau, **sampler)
    without_w = mismatch_metrics(
        delta, adv, mask, torch.ones_like(weights), triage_config, tau=tau, **sampler
    )
    valid = mask.bool()
    classes = classify_tokens(delta, adv, mask, triage_config, tau=tau, **sampler)[valid]
    w = weights[valid]
    labels = [TokenClass(int(c)).label for c in classes]
    d = delta[valid]
    floor = triage_config.tail_floor
    return {
        "tokens": int(with_w["triage/tokens"]),
        "tau": tau,
        "mean_abs_delta": with_w["triage/mean_abs_delta"],
        "mean_delta": with_w["triage/mean_delta"],
        "kl_k3": with_w["triage/kl_k3"],
        "quantiles": {k.removeprefix("triage/delta_"): v for k, v in with_w.items() if "/delta_p" in k},
        "suppressed_frac": with_w["triage/suppressed_frac"],
        "guarded_frac": with_w["triage/guarded_frac"],
        # amplify-down tokens below the hard floor (w = 0 under TRIAGE)
        "floored": 0
        if floor is None
        else sum(c == "amplify_down" and x < -floor for c, x in zip(labels, d.tolist())),
        "classes": {
            c: {
                "share": with_w[f"triage/{c}/share"],
                "mean_delta": with_w[f"triage/{c}/mean_delta"],
                "mean_weight": with_w[f"triage/{c}/mean_weight"],
                "mass_share_unweighted": without_w[f"triage/{c}/mass_share"],
                "mass_share": with_w[f"triage/{c}/mass_share"],
            }
            for c in CLASSES
        },
        "largest_cut": None
        if w.numel() == 0
        else {"weight": float(w.min()), "delta": float(d[w.argmin()]), "class": labels[int(w.argmin())]},
        "token_delta": d.tolist(),
        "token_weight": w.tolist(),
        "token_class": labels,
    }


def plot_step1(step1: dict[str, Any], path: Path, correction: str) -> None:
    """``step1.png``: the δ histogram stacked by class (top) and each token's weight against its δ (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from triage.trainers.report import CLASSES

    tau = step1["tau"]
    by_class = {c: [] for c in CLASSES}
    for d, w, c in zip(step1["token_delta"], step1["token_weight"], step1["token_class"]):
        by_class[c].append((d, w))
    present = [c for c in CLASSES if by_class[c]]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.0, 6.4), dpi=100, sharex=True)
    top.hist([[d for d, _ in by_class[c]] for c in present], bins=40, stacked=True, label=present)
    top.set_ylabel("tokens")
    top.set_title(f"step 1: δ = log π_learner − log π_sampler per token ({step1['tokens']} tokens)")
    for c in present:
        bottom.scatter(*zip(*by_class[c]), s=8, label=c)
    bottom.axhline(0.99, color="grey", linewidth=0.8, linestyle=":", label="w = 0.99 (suppressed below)")
    bottom.set_ylabel(f"{_arm_name(correction)} weight w")
    bottom.set_xlabel("δ (nats)")
    for ax in (top, bottom):
        ax.axvspan(-tau, tau, color="grey", alpha=0.15, label=f"|δ| ≤ τ = {tau:g}" if ax is top else None)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_compare(runs: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """``compare.png``: reward, mean |δ| and suppressed share per step, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("reward", "mean reward"), ("triage/mean_abs_delta", "mean |δ| (nats)"))
    panels += (("triage/suppressed_frac", "suppressed share (w < 0.99)"),)
    fig, axes = plt.subplots(1, len(panels), figsize=(12.0, 3.4), dpi=100)
    for ax, (key, title) in zip(axes, panels):
        for correction, steps in runs.items():
            pairs = [(s["step"], s[key]) for s in steps if s.get(key) is not None]
            ax.plot(*zip(*pairs), marker="o", markersize=3, label=_arm_name(correction))
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def format_report(report: dict[str, Any]) -> str:
    """The demo's text summary (``summary.txt``, also printed)."""
    from triage import TokenClass, TriageConfig
    from triage.explain import CONDITIONS, RISK, policy_formula
    from triage.trainers.report import CLASSES

    cfg, s1, runs = report["config"], report["step1"], report["runs"]
    correction = cfg["correction"]
    triage_config = TriageConfig.from_dict(cfg["triage_config"])
    name = _arm_name(correction)
    same = {True: ", the same samples in both runs", False: ", the runs sampled different completions"}
    lines = [
        f"learner  {cfg['learner']}",
        f"sampler  {cfg['sampler']}   (level {cfg['level']})",
        f"correction {correction}, τ = {s1['tau']:g} nats, the library's class policies",
        "",
        f"Step 1: {s1['tokens']} completion tokens{same.get(report['same_samples'], '')}",
        f"  δ = log π_learner − log π_sampler: mean |δ| {s1['mean_abs_delta']:.4f} nats, "
        f"mean δ {s1['mean_delta']:+.4f}, KL k3 {s1['kl_k3']:.1e}",
        "  δ quantiles: " + ", ".join(f"{k} {v:+.4f}" for k, v in s1["quantiles"].items()),
        "",
        f"  {'class':<13} {'condition':<14} {'risk':<6} {'share':>6} {'mean δ':>8}  {'rule':<26} {'mean w':>7}"
        f"  {'loss mass, w = 1 → w':>20}",
    ]
    for c in CLASSES:
        row = s1["classes"][c]
        if c == "inert":
            condition, risk, rule = "A = 0", "none", "no gradient"
        else:
            cls = TokenClass[c.upper()]
            condition, risk, policy = CONDITIONS[cls], RISK[cls], getattr(triage_config, c)
            rule = f"{policy}: {policy_formula(policy, triage_config)}" if correction == "triage" else "-"
        if row["share"]:
            numbers = f"{row['mean_delta']:+8.4f}  {rule:<26} {row['mean_weight']:7.4f}"
            numbers += f"  {_pct(row['mass_share_unweighted']):>9} → {_pct(row['mass_share']):>6}"
        else:
            numbers = f"{'-':>8}  {rule:<26} {'-':>7}"
        lines.append(f"  {c:<13} {condition:<14} {risk:<6} {_pct(row['share']):>6} {numbers}")
    lines += [
        "  (amplify: the update pushes a token further the way the learner already deviates, sign δ = sign A;",
        "   loss mass: the class's share of Σ|w·A|, with w = 1 as in vanilla GRPO, then with the weights)",
        "",
        f"  {name} cuts {_pct(s1['suppressed_frac'])} of the tokens by more than 1 % (w < 0.99)"
        + (
            f"; the largest cut:\n  w = {s1['largest_cut']['weight']:.4f} at δ = {s1['largest_cut']['delta']:+.4f} "
            f"({s1['largest_cut']['class']})."
            if s1["largest_cut"]
            else "."
        ),
    ]
    if correction == "triage":
        floor, kappa = triage_config.tail_floor, triage_config.guard_kappa
        parts = []
        if floor is not None:
            parts.append(
                f"the hard floor (w = 0 for amplify-down δ < −{floor}) acts on {s1['floored']} tokens"
            )
        if kappa is not None:
            parts.append(f"the sequence guard (κ = {kappa}) on {_pct(s1['guarded_frac'])} of the responses")
        if parts:
            lines.append("  " + " and ".join(parts).capitalize() + ".")
        else:
            lines.append(
                "  No hard floor and no sequence guard (the defaults): nothing zeroes a token or a response\n"
                '  (docs/triage.md, "Defaults: the rule and the evidence").'
            )
    arms = list(runs)
    lines += ["", f"{cfg['steps']} steps".ljust(22) + "".join(_arm_name(a).rjust(20) for a in arms)]
    rows = (
        ("reward first → last", lambda s: f"{s['reward_first']:+.3f} → {s['reward_last']:+.3f}"),
        ("mean |δ|", lambda s: f"{s['mean_abs_delta']:.4f}"),
        ("suppressed tokens", lambda s: _pct(s["suppressed_frac"])),
    )
    for label, fmt in rows:
        lines.append(f"  {label:<20}" + "".join(fmt(runs[a]).rjust(20) for a in arms))
    change = [abs(w - 1.0) for w in s1["token_weight"]]  # how far the step-1 weights moved from w = 1
    moved = (
        f"the step-1 weights differ from 1 by {sum(change) / len(change):.1%} on average (at most "
        f"{max(change):.1%})"
        if change
        else "no step-1 token was weighted"
    )
    lines += [
        "",
        "What this shows: the mismatch a low-precision sampler puts on every token, and which tokens the",
        "correction reweights and by how much. Not that it trains better: at this gap",
        f"{moved},",
        f"and {cfg['steps']} steps of a random tiny model are no test of a training gain (docs/trainer.md).",
    ]
    return "\n".join(lines)


def run(args: DemoConfig) -> int:
    with quiet():
        return _run(args)


def _run(args: DemoConfig) -> int:
    import torch

    from triage.trainers.report import training_steps, write_report

    start = time.perf_counter()
    output = Path(args.output)
    level = level_numerics(args.level)
    learner, sampler = describe_numerics(level)
    arms = [args.correction]
    if not args.no_baseline and args.correction != BASELINE:
        arms.append(BASELINE)
    print(f"triage demo: tiny Qwen3 (local, random init), synthetic arithmetic, runs: {', '.join(arms)}")
    print(f"  learner {learner}; sampler {sampler}")
    config = {
        "correction": args.correction,
        "tau": args.tau,
        "level": args.level,
        "numerics": level,
        "learner": learner,
        "sampler": sampler,
        "steps": args.steps,
        "prompts_per_step": args.prompts,
        "generations": args.generations,
        "max_completion_length": args.max_completion_length,
        "learning_rate": args.learning_rate,
        "seed": args.seed,
    }
    steps, batches, summaries, triage_config = {}, {}, {}, None
    for correction in arms:
        trainer = build_trainer(args, correction)
        trainer.train()
        if trainer.first_batch is None:
            raise RuntimeError(f"the {correction} run logged no training batch with sampler log-probs")
        triage_config = triage_config or trainer.triage_config
        batches[correction] = trainer.first_batch
        run_config = {**config, "correction": correction, "triage_config": trainer.triage_config.to_dict()}
        arm_report = write_report(
            trainer.state.log_history, output / correction, config=run_config, plots=not args.no_plots
        )
        steps[correction] = training_steps(trainer.state.log_history)
        summaries[correction] = arm_report["summary"]
        del trainer
    first = batches[args.correction]
    # None with one run; else whether every run's step 1 had the corrected run's tokens and δ
    same = None
    if len(batches) > 1:
        same = all(
            torch.equal(b["mask"], first["mask"]) and torch.equal(b["delta"], first["delta"])
            for b in batches.values()
        )
    step1 = step1_analysis(first, triage_config)
    report = {
        "config": {**config, "triage_config": triage_config.to_dict()},
        "same_samples": same,
        "step1": step1,
        "runs": summaries,
        "plots": [],
    }
    if not args.no_plots:
        plot_step1(step1, output / "step1.png", args.correction)
        plot_compare(steps, output / "compare.png")
        report["plots"] = ["step1.png", "compare.png"]
    text = format_report(report)
    (output / "summary.txt").write_text(text + "\n")
    (output / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print()
    print(text)
    files = ["summary.txt", "report.json", *report["plots"], *(f"{a}/" for a in arms)]
    print(f"\nwrote {', '.join(files)} to {output.resolve()} in {time.perf_counter() - start:.0f} s")
    return 0
