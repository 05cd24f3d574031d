"""``triage ablate``: TRIAGE vs vanilla GRPO (and TIS, IcePop, OPSM) from one SFT checkpoint, same seeds and data.

    triage ablate --preset smoke|local --output DIR [--arms a,b,...] [--resume] [--mini] [--steps N]

What one run does:

1. **SFT** (:mod:`triage.experiments.sft`): a small Qwen3-architecture model trained from scratch on the
   synthetic DAPO-format task, saved to ``DIR/sft``; skipped when that folder already holds a checkpoint of
   the same config.
2. **Every arm** (``experiments/recipes/arms``: grpo-none, tis, icepop, opsm, triage, triage-mask) starts from
   that checkpoint with the ``tiny`` recipe preset: an NVFP4 learner with one tensor-wide activation amax
   (``quant_recipe.scale: tensor``) against an NVFP4 sampler copy with per-token activation scales
   (``scale: row``) and an fp8 (e4m3) KV cache — a realistic learner/sampler mismatch. Every arm gets the
   same seeds, the same prompts in the same order and the same geometry; only the correction differs.
   Each finished arm is written at once to ``DIR/arms/<arm>.json``.
3. **Results**: ``DIR/results.json`` (one entry per arm with its metric series over steps: reward, train
   accuracy, held-out greedy accuracy, entropy, mean |δ|, token class shares, suppressed fraction),
   ``DIR/ablation.png`` (one combined figure, :mod:`triage.experiments.plots`) and ``DIR/results.md`` (a
   markdown table). They are rewritten after every arm from all finished arms in ``DIR``.

``--arms`` runs a subset; ``--resume`` skips the arms already finished in ``DIR``, so the preset can run in
pieces (``--time-budget`` stops cleanly before an arm that would not fit). Arm files of another preset
config in ``DIR`` are an error, never mixed into the results.

Presets (:data:`PRESETS`): ``smoke`` runs every arm for a few steps on CPU with a tiny model (CI);
``local`` is sized for one H200 (SFT ~2 min, six arms ~45 s each). ``--mini`` shrinks a preset to smoke
size, to check the whole pipeline on a CPU (its numbers mean nothing).

Held-out accuracy is greedy decoding by the *learner* (the trained policy, NVFP4 numerics) on problems that
neither SFT nor RL ever trains on, measured before the first step and every ``eval_every`` steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from triage.experiments.sft import SFTConfig
from triage.trainers.report import CLASSES

__all__ = [
    "AblationPreset",
    "PRESETS",
    "SERIES_KEYS",
    "mini",
    "arm_recipe",
    "arm_series",
    "arm_summary",
    "load_arm_results",
    "aggregate",
    "markdown_table",
    "write_results",
    "run_arm",
    "run_ablation",
]

RESULTS_FILE, TABLE_FILE, PLOT_FILE, ARMS_DIR, SFT_DIR = (
    "results.json",
    "results.md",
    "ablation.png",
    "arms",
    "sft",
)

#: results.json series name → the key the trainer logs it under (TRL's or the ``triage/...`` metrics).
SERIES_KEYS = {
    "reward": "reward",
    "reward_std": "reward_std",
    "dapo_accuracy": "rewards/dapo_accuracy/mean",
    "entropy": "entropy",
    "completion_length": "completions/mean_length",
    "mean_abs_delta": "triage/mean_abs_delta",
    "suppressed_frac": "triage/suppressed_frac",
    "guarded_frac": "triage/guarded_frac",
    "kl_k3": "triage/kl_k3",
    **{f"share/{c}": f"triage/{c}/share" for c in CLASSES},
}


@dataclass(frozen=True)
class AblationPreset:
    """Sizes of one ablation run (all arms share them).

    Attributes:
        name: preset name.
        sft: the SFT model and schedule (:class:`~triage.experiments.sft.SFTConfig`).
        steps: optimizer steps per arm; one generation batch per step (``prompts × generations`` completions,
            all used in one update, so the sampler ran exactly the weights the learner scores: δ is mismatch only).
        prompts, generations: prompts per step and completions per prompt (the GRPO group).
        max_completion_length: completion tokens at most (the soft overlong penalty starts 16 before).
        learning_rate, warmup_steps: RL optimizer (AdamW as in the ``tiny`` recipe, constant after warm-up).
        eval_every: steps between held-out evaluations (plus one before the first step and one after the last).
        n_eval: held-out problems evaluated (the first ``n_eval`` of SFT's held-out set).
        arm_seconds: a-priori seconds per arm on the preset's target device (only for the printed estimate).
        overrides: further recipe overrides (``KEY: value``, dotted keys allowed) applied to every arm.
    """

    name: str
    sft: SFTConfig
    steps: int
    prompts: int
    generations: int
    max_completion_length: int
    learning_rate: float
    warmup_steps: int = 0
    eval_every: int = 5
    n_eval: int = 256
    arm_seconds: float = 60.0
    overrides: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("steps", "prompts", "max_completion_length", "n_eval"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(
                    f"preset {self.name}: {name} must be a positive int, got {getattr(self, name)!r}"
                )
        if self.generations < 2:
            raise ValueError(f"preset {self.name}: generations must be >= 2 (GRPO compares a group)")
        if self.n_eval > self.sft.n_eval:
            raise ValueError(
                f"preset {self.name}: n_eval {self.n_eval} > the SFT held-out set ({self.sft.n_eval})"
            )

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["sft"] = self.sft.to_dict()
        out["overrides"] = dict(self.overrides)
        return out

    def fingerprint(self) -> str:
        """Hash of everything that shapes an arm's numbers (not ``arm_seconds``): arms of one fingerprint are
        comparable and may be aggregated together."""
        data = {k: v for k, v in self.to_dict().items() if k != "arm_seconds"}
        return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


PRESETS: dict[str, AblationPreset] = {
    # every arm for two steps on CPU with a 0.1M-parameter model (CI): checks the pipeline, not the method
    "smoke": AblationPreset(
        name="smoke",
        sft=SFTConfig(steps=20, batch_size=16, n_train=128, n_eval=8, difficulty=(1,), max_new_tokens=16),
        steps=2,
        prompts=2,
        generations=2,
        max_completion_length=16,
        learning_rate=1e-4,
        eval_every=2,
        n_eval=8,
        arm_seconds=5.0,
    ),
    # one H200: SFT of a 0.84M-parameter Qwen3, then 6 arms x 40 steps x 256 completions. Calibration (CPU,
    # fp32, the same shape with a 3000-step cosine): held-out greedy accuracy 42 % at step 500, 62 % at 750,
    # 77 % at 1000 (docs/results.md §4); 600 fully decayed steps aim at ~60 %, leaving the RL room to improve.
    "local": AblationPreset(
        name="local",
        sft=SFTConfig(
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            difficulty=(1, 2, 3),
            n_train=8192,
            n_eval=256,
            steps=600,
            max_seconds=120.0,
            batch_size=64,
            learning_rate=2e-3,
            warmup_steps=100,
            eval_every=200,
            max_new_tokens=48,
        ),
        steps=40,
        prompts=32,
        generations=8,
        max_completion_length=64,
        learning_rate=1e-4,
        warmup_steps=2,
        eval_every=5,
        n_eval=256,
        arm_seconds=45.0,
    ),
    # the mismatch testbed (one H200): a 10.3M-parameter Qwen3 (4 layers, hidden 448) SFT'd on running sums of
    # 11-13 two-digit numbers (139-173-token worked solutions) until half the held-out problems are solved
    # (trained on, it reaches 100 %: no reward variance, no entropy), then 300 RL steps x 16 prompts x 8
    # completions of up to 256 tokens. Long completions let small per-token gaps compound.
    "testbed": AblationPreset(
        name="testbed",
        sft=SFTConfig(
            hidden_size=448,
            intermediate_size=1536,
            num_hidden_layers=4,
            num_attention_heads=7,
            num_key_value_heads=1,
            head_dim=64,
            difficulty=(6,),
            n_train=16384,
            n_eval=256,
            steps=3000,
            max_seconds=150.0,
            batch_size=64,
            learning_rate=1e-3,
            warmup_steps=100,
            eval_every=50,
            target_accuracy=0.5,
            max_new_tokens=192,
            eval_batch_size=256,
        ),
        steps=300,
        prompts=16,
        generations=8,
        max_completion_length=256,
        learning_rate=5e-5,
        warmup_steps=10,
        eval_every=25,
        n_eval=128,
        arm_seconds=300.0,
    ),
}


def mini(preset: AblationPreset) -> AblationPreset:
    """``preset`` shrunk to smoke size (model, SFT, steps, batch) — for checking the pipeline on a CPU."""
    smoke = PRESETS["smoke"]
    return dataclasses.replace(
        preset,
        name=f"{preset.name}-mini",
        sft=dataclasses.replace(
            smoke.sft,
            difficulty=preset.sft.difficulty,
            max_seconds=60.0,
            eval_every=0,
            n_eval=smoke.sft.n_eval,
        ),
        steps=min(preset.steps, 3),
        prompts=smoke.prompts,
        generations=smoke.generations,
        max_completion_length=smoke.max_completion_length,
        eval_every=2,
        n_eval=smoke.n_eval,
        arm_seconds=smoke.arm_seconds * 2,
    )


# ---------------------------------------------------------------------------------------------------------
# recipes


def arm_recipe(
    preset: AblationPreset, arm: str, model_dir: str | Path, output_dir: str | Path, cpu: bool
) -> dict:
    """The flat ``tiny/<arm>`` recipe sized by ``preset``: the same data, seeds and geometry for every arm."""
    from triage.experiments.recipes import load_recipe

    batch = preset.prompts * preset.generations
    sft = preset.sft
    overrides: dict[str, Any] = {
        "model_name_or_path": str(model_dir),
        "output_dir": str(output_dir),
        # the prompts: the SFT training distribution minus its held-out problems, enough for every step
        "dataset": {
            "source": "synthetic",
            "n": preset.steps * preset.prompts,
            "difficulty": list(sft.difficulty),
            "seed": sft.seed,
            "held_out": sft.n_eval,
        },
        "eval_dataset": None,  # held-out accuracy is measured by HeldOutAccuracy (greedy, learner)
        "eval_strategy": "no",
        "max_steps": preset.steps,
        "num_generations": preset.generations,
        "generation_batch_size": batch,
        "per_device_train_batch_size": batch,
        "gradient_accumulation_steps": 1,
        "max_completion_length": preset.max_completion_length,
        # DAPO's soft overlong penalty over the last quarter of the length budget (the tiny recipe: 16 of 64)
        "reward_funcs": [
            "dapo_accuracy",
            {"soft_overlong": {"cache_length": max(1, preset.max_completion_length // 4)}},
        ],
        "learning_rate": preset.learning_rate,
        "warmup_steps": preset.warmup_steps,
        "logging_steps": 1,
        "save_strategy": "no",
        "disable_tqdm": True,
        "sampler_kwargs": {"seed": sft.seed},  # merged into the preset's sampler keys: a fixed sampler RNG
        **({"use_cpu": True, "bf16": False} if cpu else {}),
    }
    return load_recipe(f"tiny/{arm}", {**overrides, **dict(preset.overrides)})


# ---------------------------------------------------------------------------------------------------------
# results


def arm_series(log_history: Iterable[Mapping[str, Any]]) -> dict[str, list]:
    """Per-step series from the trainer's ``log_history``: ``{"step": [...], name: [...]}`` for every
    :data:`SERIES_KEYS` name (``None`` where a step did not log it) plus ``accuracy`` = (DAPO ±1 mean + 1)/2."""
    records = [e for e in log_history if "loss" in e and "train_runtime" not in e and "step" in e]
    series: dict[str, list] = {"step": [int(e["step"]) for e in records]}
    for name, key in SERIES_KEYS.items():
        series[name] = [_finite_or_none(e.get(key)) for e in records]
    series["accuracy"] = [None if v is None else (v + 1) / 2 for v in series["dapo_accuracy"]]
    return series


def _finite_or_none(value: Any) -> float | None:
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _mean(values: Iterable[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def arm_summary(series: Mapping[str, list], held_out: Mapping[str, list], window: int = 5) -> dict[str, Any]:
    """Run-level numbers of one arm: reward and train accuracy over the first and the last ``window`` steps,
    held-out accuracy before and after, mean |δ|, suppressed fraction, entropy (last window), class shares
    (token-mean over the run)."""
    n = len(series.get("step", []))
    w = max(1, min(window, n))

    def first(name):
        return _mean(series.get(name, [])[:w])

    def last(name):
        return _mean(series.get(name, [])[-w:])

    acc = held_out.get("accuracy", [])
    measured = [a for a in acc if a is not None]
    return {
        "steps": n,
        "reward_first": first("reward"),
        "reward_last": last("reward"),
        "accuracy_first": first("accuracy"),
        "accuracy_last": last("accuracy"),
        "held_out_first": acc[0] if acc else None,
        "held_out_last": acc[-1] if acc else None,
        "held_out_best": max(measured) if measured else None,
        "entropy_last": last("entropy"),
        "mean_abs_delta": _mean(series.get("mean_abs_delta", [])),
        "suppressed_frac": _mean(series.get("suppressed_frac", [])),
        "guarded_last": last("guarded_frac"),
        "class_share": {c: _mean(series.get(f"share/{c}", [])) for c in CLASSES},
    }


def load_arm_results(output_dir: str | Path, fingerprint: str | None = None) -> dict[str, dict]:
    """Every finished arm in ``output_dir/arms`` (in recipe ARMS order). With ``fingerprint``, an arm of
    another preset config is an error naming its file."""
    from triage.experiments.recipes import ALL_ARMS

    folder = Path(output_dir) / ARMS_DIR
    found = {}
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        entry = json.loads(path.read_text())
        if fingerprint is not None and entry.get("fingerprint") != fingerprint:
            raise ValueError(
                f"{path} was produced by another preset config (fingerprint {entry.get('fingerprint')} != "
                f"{fingerprint}); use another --output or delete it"
            )
        found[entry["arm"]] = entry
    order = {a: i for i, a in enumerate(ALL_ARMS)}
    return dict(sorted(found.items(), key=lambda kv: order.get(kv[0], len(order))))


def aggregate(
    arms: Mapping[str, Mapping[str, Any]], preset: Mapping[str, Any], sft: Mapping[str, Any] | None
) -> dict:
    """The ``results.json`` dict: the preset, the SFT summary, and one entry per arm."""
    return {"preset": preset.get("name"), "config": dict(preset), "sft": sft, "arms": dict(arms)}


def _fmt(value: Any, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def markdown_table(results: Mapping[str, Any]) -> str:
    """One row per arm: held-out accuracy (before → after), train reward and accuracy (first → last 5 steps),
    entropy, mean |δ|, the amplifying-class shares, suppressed fraction, the share of responses the TRIAGE
    sequence guard scaled down over the last 5 steps, wall time."""
    lines = [
        "| arm | correction | held-out acc. (start → end) | reward (first 5 → last 5) | train acc. | entropy (last 5) "
        "| mean \\|δ\\| | amplify-down | amplify-up | suppressed | guarded (last 5) | s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, arm in (results.get("arms") or {}).items():
        s = arm.get("summary") or {}
        shares = s.get("class_share") or {}
        lines.append(
            f"| {name} | {arm.get('correction', '?')} "
            f"| {_fmt(s.get('held_out_first'), '.1%')} → {_fmt(s.get('held_out_last'), '.1%')} "
            f"| {_fmt(s.get('reward_first'), '.3f')} → {_fmt(s.get('reward_last'), '.3f')} "
            f"| {_fmt(s.get('accuracy_first'), '.1%')} → {_fmt(s.get('accuracy_last'), '.1%')} "
            f"| {_fmt(s.get('entropy_last'), '.3f')} | {_fmt(s.get('mean_abs_delta'), '.4f')} "
            f"| {_fmt(shares.get('amplify_down'), '.2%')} | {_fmt(shares.get('amplify_up'), '.2%')} "
            f"| {_fmt(s.get('suppressed_frac'), '.2%')} | {_fmt(s.get('guarded_last'), '.1%')} "
            f"| {_fmt(arm.get('seconds'), '.0f')} |"
        )
    return "\n".join(lines) + "\n"


def write_results(output_dir: str | Path, results: Mapping[str, Any], plots: bool = True) -> list[str]:
    """Write ``results.json``, ``results.md`` (and ``ablation.png``) to ``output_dir``; returns the file names."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / RESULTS_FILE).write_text(json.dumps(results, indent=1, default=str) + "\n")
    sft = results.get("sft") or {}
    final = sft.get("final") or {}
    header = [
        f"# triage ablate --preset {results.get('preset')}",
        "",
        f"SFT checkpoint: {sft.get('params', '?')} parameters, {sft.get('steps_done', '?')} steps, held-out greedy "
        f"accuracy {_fmt(final.get('accuracy'), '.1%')} (by level {final.get('by_difficulty')}).",
        "",
    ]
    (output_dir / TABLE_FILE).write_text("\n".join(header) + markdown_table(results))
    files = [RESULTS_FILE, TABLE_FILE]
    if plots and results.get("arms"):
        from triage.experiments.plots import plot_ablation

        plot_ablation(results, output_dir / PLOT_FILE)
        files.append(PLOT_FILE)
    return files


# ---------------------------------------------------------------------------------------------------------
# running


def _held_out_callback(
    trainer,
    tokenizer,
    dataset,
    preset: AblationPreset,
    log: Callable[[str], None],
    deadline: float | None = None,
):
    """A ``TrainerCallback`` that records the learner's greedy held-out accuracy (before step 1, every
    ``eval_every`` steps, after the last) into ``callback.record``, and stops training at ``deadline``
    (``time.perf_counter()`` seconds; ``callback.stopped_by`` says which stop ended the run)."""
    from transformers import TrainerCallback

    from triage.experiments.sft import greedy_accuracy

    class HeldOutAccuracy(TrainerCallback):
        def __init__(self):
            self.record: dict[str, list] = {"step": [], "accuracy": [], "by_difficulty": []}
            self.start, self.stopped_by = time.perf_counter(), "steps"

        def _evaluate(self, step: int) -> None:
            import torch

            model = trainer.accelerator.unwrap_model(trainer.model)
            with torch.no_grad(), trainer.accelerator.autocast():
                acc = greedy_accuracy(
                    model, tokenizer, dataset, preset.sft.max_new_tokens, preset.sft.eval_batch_size
                )
            self.record["step"].append(step)
            self.record["accuracy"].append(acc["accuracy"])
            self.record["by_difficulty"].append(acc["by_difficulty"])

        def on_train_begin(self, args, state, control, **kwargs):
            self._evaluate(0)

        def on_step_end(self, args, state, control, **kwargs):
            step = state.global_step
            if step % preset.eval_every == 0 or step >= preset.steps or control.should_training_stop:
                self._evaluate(step)

        def on_log(self, args, state, control, logs=None, **kwargs):  # after on_step_end of the same step
            if not logs or "reward" not in logs:
                return
            step = state.global_step
            held = self.record["accuracy"][-1] if self.record["step"][-1] == step else None
            log(
                f"    step {step:>3}/{preset.steps}: reward {logs['reward']:+.3f}, mean |δ| "
                f"{logs.get('triage/mean_abs_delta', float('nan')):.4f}"
                + (f", held-out {held:.1%}" if held is not None else "")
                + f" ({time.perf_counter() - self.start:.0f} s)"
            )

        def on_step_begin(self, args, state, control, **kwargs):
            if deadline is not None and time.perf_counter() > deadline:
                control.should_training_stop = True  # the step in flight is the last one
                self.stopped_by = "time_budget"

    return HeldOutAccuracy()


def run_arm(
    preset: AblationPreset,
    arm: str,
    output_dir: str | Path,
    model_dir: str | Path,
    log: Callable[[str], None] = print,
    deadline: float | None = None,
) -> dict[str, Any]:
    """Train one arm from the SFT checkpoint; write and return its entry (``DIR/arms/<arm>.json``).

    ``deadline`` (``time.perf_counter()`` seconds): the arm stops cleanly after the step in flight; its entry
    says ``"complete": false`` and ``"stopped_by": "time_budget"`` (its series end at the last step run)."""
    import torch
    from transformers import AutoTokenizer
    from transformers.trainer_callback import PrinterCallback

    from triage.experiments.data import synthetic_math
    from triage.experiments.train import build_trainer

    output_dir = Path(output_dir)
    start = time.perf_counter()
    cpu = not torch.cuda.is_available()
    recipe = arm_recipe(preset, arm, model_dir, output_dir / ARMS_DIR / arm, cpu=cpu)
    trainer = build_trainer(recipe, recipe["output_dir"])
    trainer.remove_callback(PrinterCallback)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    held_out = synthetic_math(preset.n_eval, list(preset.sft.difficulty), preset.sft.seed, "eval")
    callback = _held_out_callback(trainer, tokenizer, held_out, preset, log, deadline)
    trainer.add_callback(callback)
    trainer.train()
    series = arm_series(trainer.state.log_history)
    held = callback.record
    entry = {
        "arm": arm,
        "description": recipe.get("description"),
        "correction": recipe.get("correction"),
        "fingerprint": preset.fingerprint(),
        "seconds": time.perf_counter() - start,
        "device": "cpu" if cpu else torch.cuda.get_device_name(),
        "complete": len(series["step"]) == preset.steps,
        "stopped_by": callback.stopped_by,
        "series": series,
        "held_out": held,
        "summary": arm_summary(series, held),
        "recipe": recipe,
    }
    path = output_dir / ARMS_DIR / f"{arm}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(entry, indent=1, default=str) + "\n")
    del trainer
    if not cpu:
        torch.cuda.empty_cache()
    return entry


def run_ablation(
    preset: AblationPreset,
    output_dir: str | Path,
    arms: Sequence[str] | None = None,
    resume: bool = False,
    time_budget: float | None = None,
    plots: bool = True,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """SFT (unless its checkpoint exists), then each requested arm; returns the ``results.json`` dict."""
    from triage.experiments.recipes import ALL_ARMS, ARMS
    from triage.experiments.sft import ensure_sft_checkpoint, sft_summary

    start = time.perf_counter()
    output_dir = Path(output_dir)
    arms = list(arms or ARMS)
    unknown = [a for a in arms if a not in ALL_ARMS]
    if unknown:
        raise ValueError(f"unknown arms {unknown}; arms: {', '.join(ALL_ARMS)}")
    fingerprint = preset.fingerprint()
    done = load_arm_results(output_dir, fingerprint)  # errors early on arms of another config
    todo = [a for a in arms if not (resume and a in done and done[a].get("complete", True))]
    skipped = [a for a in arms if a not in todo]
    sft_dir = output_dir / SFT_DIR
    sft_cached = (sft_dir / "sft.json").is_file()
    sft_estimate = 0.0 if sft_cached else (preset.sft.max_seconds or 0.0) + 10.0
    log(
        f"triage ablate --preset {preset.name}: {len(todo)} arm(s) to run ({', '.join(todo) or 'none'})"
        + (f", {len(skipped)} already done ({', '.join(skipped)})" if skipped else "")
        + f"; estimate ~{sft_estimate + preset.arm_seconds * len(todo):.0f} s "
        f"(SFT {'cached' if sft_cached else f'~{sft_estimate:.0f} s'}, ~{preset.arm_seconds:.0f} s per arm on the "
        "preset's target device)"
    )
    sft = ensure_sft_checkpoint(preset.sft, sft_dir, log)
    times = []
    for i, arm in enumerate(todo):
        elapsed = time.perf_counter() - start
        per_arm = _mean(times) or preset.arm_seconds
        if time_budget is not None and elapsed + per_arm > time_budget:
            log(
                f"time budget: {elapsed:.0f} s used, an arm takes ~{per_arm:.0f} s, budget {time_budget:.0f} s; "
                f"stopping before {arm}. Continue with the same command plus --resume."
            )
            break
        log(f"[{i + 1}/{len(todo)}] arm {arm}")
        deadline = None if time_budget is None else start + time_budget
        entry = run_arm(preset, arm, output_dir, sft_dir, log, deadline=deadline)
        times.append(entry["seconds"])
        done = load_arm_results(output_dir, fingerprint)
        write_results(output_dir, aggregate(done, preset.to_dict(), sft_summary(sft)), plots=plots)
        s = entry["summary"]
        remaining = (len(todo) - i - 1) * _mean(times)
        log(
            f"    {arm} done in {entry['seconds']:.0f} s: held-out {_fmt(s['held_out_first'], '.1%')} → "
            f"{_fmt(s['held_out_last'], '.1%')}, reward {_fmt(s['reward_first'], '.3f')} → "
            f"{_fmt(s['reward_last'], '.3f')}, mean |δ| {_fmt(s['mean_abs_delta'], '.4f')}"
            + (f"; ~{remaining:.0f} s left" if remaining else "")
        )
    done = load_arm_results(output_dir, fingerprint)
    results = aggregate(done, preset.to_dict(), sft_summary(sft))
    if done:
        write_results(output_dir, results, plots=plots)
    return results


# ---------------------------------------------------------------------------------------------------------
# CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), required=True, help="smoke (CPU, CI) or local (one GPU)"
    )
    parser.add_argument(
        "--output", required=True, help="folder for sft/, arms/, results.json, results.md, ablation.png"
    )
    parser.add_argument("--arms", default=None, help="comma-separated subset of the arms (default: all six)")
    parser.add_argument("--resume", action="store_true", help="skip the arms already finished in --output")
    parser.add_argument(
        "--steps", type=int, default=None, help="override the preset's optimizer steps per arm"
    )
    parser.add_argument(
        "--mini", action="store_true", help="shrink the preset to smoke size (check the pipeline on CPU)"
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds: do not start an arm that would end past this, and stop a running arm there (its entry "
        "says complete: false); continue later with --resume",
    )
    parser.add_argument(
        "--set",
        action="extend",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="recipe overrides for every arm (YAML values, dotted keys), e.g. --set learning_rate=1e-4",
    )
    parser.add_argument("--no-plots", action="store_true", help="skip ablation.png")


def resolve_preset(args: argparse.Namespace) -> AblationPreset:
    preset = PRESETS[args.preset]
    if args.mini:
        preset = mini(preset)
    if args.steps is not None:
        if args.steps < 1:
            raise ValueError("--steps must be >= 1")
        preset = dataclasses.replace(preset, steps=args.steps)
    if args.set:
        from triage.experiments.recipes import parse_overrides, parse_value

        parse_overrides(args.set)  # malformed KEY=VALUE is an error now, not after the SFT
        pairs = (text.split("=", 1) for text in args.set)
        overrides = {**preset.overrides, **{k.strip(): parse_value(v) for k, v in pairs}}
        preset = dataclasses.replace(preset, overrides=overrides)
    return preset


def run(args: argparse.Namespace) -> int:
    from triage.experiments.demo import _quiet

    preset = resolve_preset(args)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()] if args.arms else None
    with _quiet():
        results = run_ablation(
            preset,
            args.output,
            arms=arms,
            resume=args.resume,
            time_budget=args.time_budget,
            plots=not args.no_plots,
        )
    print()
    print(markdown_table(results), end="")
    print(
        f"\nwrote {', '.join([RESULTS_FILE, TABLE_FILE] + ([] if args.no_plots else [PLOT_FILE]))} to "
        f"{Path(args.output).resolve()}"
    )
    return 0
