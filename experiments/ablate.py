"""``triage ablate``: mismatch corrections (vanilla GRPO, TIS, IcePop, OPSM, TRIAGE) at several learner/sampler
mismatch levels and seeds, from one SFT checkpoint — a dose-response study, run as resumable processes and
aggregated over seeds.

    triage ablate --scale smoke|local --output DIR [--levels a,b] [--arms a,b] [--seeds 0,1,2] [--steps N]
                  [--parallel N] [--resume] [--time-budget S] [--save-models 100,200] [--set KEY=VALUE ...]
                  [--mini]
    triage ablate --study study.yaml --output DIR [any flag above, overriding the file]

What one call does:

1. **SFT** (:mod:`triage.experiments.sft`), once, in this process: a small Qwen3-architecture model trained
   from scratch on the synthetic DAPO-format task, saved to ``DIR/sft``; skipped when that folder already
   holds a checkpoint of the same config. Every run starts from it.
2. **Runs**: one per (level, arm, seed), seed-major (every level and arm of seed 0 first). A run trains the
   recipe ``tiny/<arm>/<level>`` (:mod:`triage.experiments.recipes`: the arm is the correction, the level the
   learner/sampler numerics) sized by the scale; its seed sets ``seed`` (TRL's prompt order and the model's
   RNG), ``data_seed`` and the HF sampler's generator seed. Within one seed every run sees the same prompts
   in the same order. A finished run writes ``DIR/runs/<level>/<arm>/seed<k>.json`` and its log
   ``seed<k>.log`` beside it. ``--parallel 1`` (default) runs them one after another in this process;
   ``--parallel N`` runs up to N child processes (``python -m triage ablate --output DIR --run
   LEVEL/ARM/SEED``, reading the config from ``DIR/study.json``; they inherit the environment, so the
   device too, and get ``OMP_NUM_THREADS`` = cores / N unless it is set). A crashed run leaves its traceback
   in its log and is named in the summary; the other runs go on.
3. **Results**: ``DIR/results.json`` (per level and arm: seeds, mean/std/min/max over seeds of every summary
   number, per-step mean/min/max series), ``DIR/results.md`` (the table) and ``DIR/ablation-<level>.png``
   (:mod:`triage.experiments.plots`), rewritten after every finished run from all finished runs in ``DIR``.

``--resume`` skips the runs already finished in ``DIR`` and continues a run cut short from its checkpoint.
``--time-budget S`` stops a started run cleanly before a step that would end past S seconds after the call
began: the run saves a checkpoint of that step (``DIR/runs/<level>/<arm>/seed<k>/checkpoint-<step>``, one per
run, TRL's own) and its series so far (``seed<k>.partial.json``); under ``--resume`` it continues from there
(:func:`run_one`), the step axis and the held-out schedule unbroken, and writes ``seed<k>.json`` once it
reaches the scale's steps. A call starts no run expected to run fewer than ``eval_every`` steps (or its
remaining steps, if fewer) before S. Runs of another scale (other sizes, steps or overrides) in ``DIR`` are an
error, never mixed into the results.

``--save-models 100,200`` (study key ``save_models``): every run saves its learner and tokenizer after those
optimizer steps as a local HF folder, ``DIR/runs/<level>/<arm>/seed<k>/model-step<step>/`` (loadable with
``AutoModelForCausalLM.from_pretrained``; fp32 masters for an NVFP4 learner), listed in the run's JSON under
``models``. It does not change what a run computes: not part of the scale's fingerprint, and a study may
resume with other steps. Finished runs keep these folders (they are not checkpoints).

Scales (:data:`SCALES`): ``smoke`` runs for a few steps on CPU with a tiny model (CI); ``local`` and
``testbed`` (the mismatch testbed: longer completions, 300 steps) are sized for one H200. ``--mini`` shrinks a scale to smoke size, to check the whole pipeline on a CPU (its numbers mean
nothing). Held-out accuracy is greedy decoding by the *learner* (the trained policy, in its numerics) on
problems that neither SFT nor RL ever trains on, measured before the first step and every ``eval_every`` steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from triage.experiments.sft import SFTConfig
from triage.trainers.report import CLASSES
from triage.trainers.tiny import SMALL_SPEC, TinyModelSpec

__all__ = [
    "StudyScale",
    "SCALES",
    "SERIES_KEYS",
    "SUMMARY_KEYS",
    "BAND_SERIES",
    "STUDY_KEYS",
    "RunKey",
    "Study",
    "mini",
    "run_recipe",
    "run_series",
    "run_summary",
    "seed_stats",
    "load_runs",
    "load_study_file",
    "aggregate",
    "markdown_table",
    "write_results",
    "run_one",
    "run_study",
]

RESULTS_FILE, TABLE_FILE, STUDY_FILE, RUNS_DIR, SFT_DIR = (
    "results.json",
    "results.md",
    "study.json",
    "runs",
    "sft",
)
PARTIAL_SUFFIX = ".partial.json"  # a run the time budget cut short: its steps so far, never aggregated
RUN_STATE_FILE = "run_state.json"  # in a run's checkpoint: what it continues (written last: a complete save)
EXIT_CUT_SHORT = 3  # a child's exit status when the time budget stopped its run (checkpointed, not finished)
KILL_GRACE = 60.0  # seconds past the budget after which a child that has not stopped is killed
# a run's saved learner after a step (``save_models``): ``seed<k>/model-step<step>/``
MODEL_PREFIX = "model-step"

#: results.json series name → the key the trainer logs it under (TRL's or the ``triage/...`` metrics).
SERIES_KEYS = {
    "reward": "reward",
    "reward_std": "reward_std",
    "dapo_accuracy": "rewards/dapo_accuracy/mean",
    "entropy": "entropy",
    "completion_length": "completions/mean_length",
    "grad_norm": "grad_norm",
    "mean_abs_delta": "triage/mean_abs_delta",
    "suppressed_frac": "triage/suppressed_frac",
    "guarded_frac": "triage/guarded_frac",
    "kl_k3": "triage/kl_k3",
    # the per-response mean δ that OPSM thresholds (calibrate opsm_threshold on it)
    "seq_mean_delta_p1": "triage/seq_mean_delta_p1",
    "seq_mean_delta_p50": "triage/seq_mean_delta_p50",
    # mean |p_learner − p_sampler|: the scale of a probability-space τ (tau_space="prob")
    "mean_abs_dprob": "triage/mean_abs_dprob",
    **{f"share/{c}": f"triage/{c}/share" for c in CLASSES},
    # each class's share of the policy gradient's size, Σ|w·A|·(1 − p_learner) (triage.metrics)
    **{f"grad_share/{c}": f"triage/{c}/grad_share" for c in CLASSES},
}
#: the run-summary numbers aggregated over seeds (:func:`run_summary`), besides the class shares.
SUMMARY_KEYS = (
    "reward_first",
    "reward_last",
    "accuracy_first",
    "accuracy_last",
    "held_out_first",
    "held_out_last",
    "held_out_best",
    "entropy_last",
    "mean_abs_delta_step1",
    "mean_abs_delta",
    "grad_norm_last",
    "grad_norm_max",
    "suppressed_frac",
    "guarded_last",
)
#: the per-step series aggregated over seeds (mean, min, max at every step) in results.json and the figures.
BAND_SERIES = ("reward", "accuracy", "entropy", "mean_abs_delta", "suppressed_frac", "grad_norm", "kl_k3")


@dataclass(frozen=True)
class StudyScale:
    """Sizes of the runs of one study (every level, arm and seed shares them).

    Attributes:
        name: scale name.
        sft: the SFT model and schedule (:class:`~triage.experiments.sft.SFTConfig`).
        steps: optimizer steps per run; one generation batch per step (``prompts × generations`` completions,
            all used in one update, so the sampler ran exactly the weights the learner scores: δ is mismatch only).
        prompts, generations: prompts per step and completions per prompt (the GRPO group).
        max_completion_length: completion tokens at most (the soft overlong penalty starts 16 before).
        learning_rate, warmup_steps: RL optimizer (AdamW as in the ``tiny`` recipe, constant after warm-up).
        eval_every: steps between held-out evaluations (plus one before the first step and one after the last).
        n_eval: held-out problems evaluated (the first ``n_eval`` of SFT's held-out set).
        arm_seconds: a-priori seconds per run on the scale's target device (the time-budget estimate, as
            ``arm_seconds / steps`` per step, until a run in the folder has finished or been cut short).
        overrides: further recipe overrides (``KEY: value``, dotted keys allowed) applied to every run.
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
                    f"scale {self.name}: {name} must be a positive int, got {getattr(self, name)!r}"
                )
        if self.generations < 2:
            raise ValueError(f"scale {self.name}: generations must be >= 2 (GRPO compares a group)")
        if self.n_eval > self.sft.n_eval:
            raise ValueError(
                f"scale {self.name}: n_eval {self.n_eval} > the SFT held-out set ({self.sft.n_eval})"
            )

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["sft"] = self.sft.to_dict()
        out["overrides"] = dict(self.overrides)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StudyScale:
        """The inverse of :meth:`to_dict` (``DIR/study.json``)."""
        return cls(
            **{
                **data,
                "sft": SFTConfig.from_dict(data["sft"]),
                "overrides": dict(data.get("overrides") or {}),
            }
        )

    def fingerprint(self) -> str:
        """Hash of everything that shapes a run's numbers (not ``arm_seconds``): runs of one fingerprint are
        comparable and may be aggregated together."""
        data = {k: v for k, v in self.to_dict().items() if k != "arm_seconds"}
        return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


SCALES: dict[str, StudyScale] = {
    # two steps per run on CPU with a 0.1M-parameter model (CI): checks the pipeline, not the method
    "smoke": StudyScale(
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
    # one H200: SFT of a 0.84M-parameter Qwen3, then runs of 40 steps x 256 completions. Calibration (CPU,
    # fp32, the same shape with a 3000-step cosine): held-out greedy accuracy 42 % at step 500, 62 % at 750,
    # 77 % at 1000 (docs/results.md §4); 600 fully decayed steps aim at ~60 %, leaving the RL room to improve.
    "local": StudyScale(
        name="local",
        sft=SFTConfig(
            model=SMALL_SPEC,
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
    # 11-13 two-digit numbers (135-175-token worked solutions) until half the held-out problems are solved
    # (trained on, it reaches 100 %: no reward variance, no entropy), then 300 RL steps x 16 prompts x 8
    # completions of up to 256 tokens. Long completions let small per-token gaps compound.
    "testbed": StudyScale(
        name="testbed",
        sft=SFTConfig(
            model=TinyModelSpec(
                hidden_size=448,
                intermediate_size=1536,
                num_hidden_layers=4,
                num_attention_heads=7,
                num_key_value_heads=1,
                head_dim=64,
            ),
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


def mini(scale: StudyScale) -> StudyScale:
    """``scale`` shrunk to smoke size (model, SFT, steps, batch) — for checking the pipeline on a CPU."""
    smoke = SCALES["smoke"]
    return dataclasses.replace(
        scale,
        name=f"{scale.name}-mini",
        sft=dataclasses.replace(
            smoke.sft,
            difficulty=scale.sft.difficulty,
            max_seconds=60.0,
            eval_every=0,
            n_eval=smoke.sft.n_eval,
        ),
        steps=min(scale.steps, 3),
        prompts=smoke.prompts,
        generations=smoke.generations,
        max_completion_length=smoke.max_completion_length,
        eval_every=2,
        n_eval=smoke.n_eval,
        arm_seconds=smoke.arm_seconds * 2,
    )


# ---------------------------------------------------------------------------------------------------------
# the study: which runs


@dataclass(frozen=True, order=True)
class RunKey:
    """One run of a study: a mismatch level, a correction arm and a seed (``"LEVEL/ARM/SEED"`` as text)."""

    level: str
    arm: str
    seed: int

    @classmethod
    def parse(cls, text: str) -> RunKey:
        parts = text.split("/")
        if len(parts) != 3 or not parts[2].isdigit():
            raise ValueError(f"a run is LEVEL/ARM/SEED (e.g. realistic/grpo-none/0), got {text!r}")
        return cls(parts[0], parts[1], int(parts[2]))

    def __str__(self) -> str:
        return f"{self.level}/{self.arm}/{self.seed}"

    def path(self, output_dir: str | Path, suffix: str = "") -> Path:
        """``DIR/runs/<level>/<arm>/seed<k><suffix>``: ``.json`` (the finished run), ``.log``, or the trainer's
        output folder (no suffix)."""
        return Path(output_dir) / RUNS_DIR / self.level / self.arm / f"seed{self.seed}{suffix}"


def _names(value: Any, what: str) -> tuple:
    """A list, or a comma-separated string, of names (``what`` for the error)."""
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{what} must be a non-empty list (or comma-separated names), got {value!r}")
    return tuple(value)


def _seeds(value: Any) -> tuple[int, ...]:
    """Distinct non-negative int seeds from a list, one int, or a comma-separated string."""
    items = _names(str(value) if isinstance(value, int) else value, "seeds")
    seeds = tuple(int(s) if isinstance(s, int) or str(s).strip().isdigit() else -1 for s in items)
    if any(s < 0 or isinstance(t, bool) for s, t in zip(seeds, items)) or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must be distinct non-negative ints, got {value!r}")
    return seeds


def _save_steps(value: Any) -> tuple[int, ...]:
    """The ``save_models`` steps, sorted: distinct positive ints from a list, one int, or a comma-separated
    string; ``None`` or an empty list is none."""
    if value is None:
        return ()
    items = value
    if isinstance(value, str):
        items = [v.strip() for v in value.split(",") if v.strip()]
    elif isinstance(value, int) and not isinstance(value, bool):
        items = [value]
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"save_models must be a list of optimizer steps, got {value!r}")

    def step(item: Any) -> int:
        if isinstance(item, int) and not isinstance(item, bool):
            return item
        return int(item) if isinstance(item, str) and item.strip().isdigit() else -1

    steps = [step(s) for s in items]
    if any(s < 1 for s in steps) or len(set(steps)) != len(steps):
        raise ValueError(f"save_models must be distinct positive ints (optimizer steps), got {value!r}")
    return tuple(sorted(steps))


#: the run seed owns these recipe keys (dotted); a scale override of one is an error (use ``seeds``).
_SEED_KEYS = ("seed", "data_seed", "sampler_kwargs.seed")


@dataclass(frozen=True)
class Study:
    """What one ``triage ablate`` call runs: ``levels × arms × seeds`` runs of ``scale``.

    Attributes:
        scale: the sizes every run shares (:class:`StudyScale`, with its recipe overrides).
        levels: mismatch levels (``experiments/recipes/levels``), default ``realistic`` (the ``tiny`` preset).
        arms: correction arms (``experiments/recipes/arms``), default the six of ``recipes.ARMS``.
        seeds: run seeds, default ``(0,)``.
        parallel: runs at once; 1 runs them in this process, more in child processes.
        time_budget: seconds from the start of the call after which no run may end (``None``: no limit).
        save_models: optimizer steps after which every run saves its learner to
            ``DIR/runs/<level>/<arm>/seed<k>/model-step<step>/`` (:func:`run_one`); default none. What a run
            computes does not depend on it: it is no part of the scale's fingerprint, and a study may resume
            with other steps.
    """

    scale: StudyScale
    levels: tuple[str, ...] = ("realistic",)
    arms: tuple[str, ...] | None = None
    seeds: tuple[int, ...] = (0,)
    parallel: int = 1
    time_budget: float | None = None
    save_models: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        from triage.experiments.recipes import ALL_ARMS, ARMS, LEVELS, parse_overrides

        object.__setattr__(self, "levels", _names(self.levels, "levels"))
        object.__setattr__(self, "arms", _names(self.arms or ARMS, "arms"))
        object.__setattr__(self, "seeds", _seeds(self.seeds))
        object.__setattr__(self, "save_models", _save_steps(self.save_models))
        for what, names, known in (("levels", self.levels, LEVELS), ("arms", self.arms, ALL_ARMS)):
            unknown = [n for n in names if n not in known]
            if unknown:
                raise ValueError(f"unknown {what} {unknown}; {what}: {', '.join(known)}")
        if not isinstance(self.parallel, int) or isinstance(self.parallel, bool) or self.parallel < 1:
            raise ValueError(f"parallel must be a positive int, got {self.parallel!r}")
        if self.time_budget is not None and not self.time_budget >= 0:
            raise ValueError(f"time_budget must be >= 0 seconds, got {self.time_budget!r}")
        nested = parse_overrides(self.scale.overrides)
        for key in _SEED_KEYS:
            head, _, tail = key.partition(".")
            if head in nested and (not tail or tail in (nested[head] or {})):
                raise ValueError(f"override {key!r}: the run seed sets it; choose the seeds with --seeds")

    def runs(self) -> list[RunKey]:
        """Every run, seed-major: all levels and arms of the first seed, then the next seed, ..."""
        return [RunKey(lv, arm, seed) for seed in self.seeds for lv in self.levels for arm in self.arms]

    def to_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale.to_dict(),
            "fingerprint": self.scale.fingerprint(),
            "levels": list(self.levels),
            "arms": list(self.arms),
            "seeds": list(self.seeds),
            "parallel": self.parallel,
            "time_budget": self.time_budget,
            "save_models": list(self.save_models),
        }


#: the keys of a study file (``triage ablate --study FILE``); every one is optional but ``scale``.
STUDY_KEYS = (
    "scale",
    "mini",
    "levels",
    "arms",
    "seeds",
    "steps",
    "parallel",
    "time_budget",
    "save_models",
    "overrides",
)


def _check_scale_key(spec: Mapping[str, Any], path: Path) -> None:
    """A study file or ``study.json`` that names the scale with the key ``preset`` is an error naming the file
    and the key to use (``scale``); nothing else in such a file differs, so renaming the key is enough (the
    fingerprints do not depend on it)."""
    if "preset" in spec:
        raise ValueError(f"{path}: a study names its scale with the key 'scale', not 'preset'; rename it")


def load_study_file(path: str | Path) -> dict[str, Any]:
    """A study file's mapping, checked for unknown keys (``ValueError`` naming the file and the key)."""
    from triage.experiments.recipes import load_yaml

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"study file not found: {path}")
    spec = load_yaml(path)
    _check_scale_key(spec, path)
    unknown = [k for k in spec if k not in STUDY_KEYS]
    if unknown:
        raise ValueError(f"{path}: unknown study keys {unknown}; keys: {', '.join(STUDY_KEYS)}")
    if spec.get("scale") is not None and spec["scale"] not in SCALES:
        raise ValueError(f"{path}: scale {spec['scale']!r} is not one of {', '.join(sorted(SCALES))}")
    if not isinstance(spec.get("overrides") or {}, Mapping):
        raise ValueError(f"{path}: overrides must be a mapping of recipe keys, got {spec['overrides']!r}")
    return spec


# ---------------------------------------------------------------------------------------------------------
# recipes


def run_recipe(
    scale: StudyScale, key: RunKey, model_dir: str | Path, output_dir: str | Path, cpu: bool
) -> dict:
    """The flat recipe ``tiny/<arm>/<level>`` sized by ``scale``, seeded by ``key.seed``: within one seed every
    run has the same data, order and geometry; only the correction (arm) and the numerics (level) differ."""
    from triage.experiments.recipes import load_recipe, merge, parse_overrides

    batch = scale.prompts * scale.generations
    sft = scale.sft
    overrides: dict[str, Any] = {
        "model_name_or_path": str(model_dir),
        "output_dir": str(output_dir),
        # the prompts: the SFT training distribution minus its held-out problems, enough for every step
        "dataset": {
            "source": "synthetic",
            "n": scale.steps * scale.prompts,
            "difficulty": list(sft.difficulty),
            "seed": sft.seed,
            "held_out": sft.n_eval,
        },
        "eval_dataset": None,  # held-out accuracy is measured by HeldOutAccuracy (greedy, learner)
        "eval_strategy": "no",
        "max_steps": scale.steps,
        "num_generations": scale.generations,
        "generation_batch_size": batch,
        "per_device_train_batch_size": batch,
        "gradient_accumulation_steps": 1,
        "max_completion_length": scale.max_completion_length,
        # DAPO's soft overlong penalty over the last quarter of the length budget (the tiny recipe: 16 of 64)
        "reward_funcs": [
            "dapo_accuracy",
            {"soft_overlong": {"cache_length": max(1, scale.max_completion_length // 4)}},
        ],
        "learning_rate": scale.learning_rate,
        "warmup_steps": scale.warmup_steps,
        "logging_steps": 1,
        # no scheduled checkpoints: the time budget saves one when it stops a run, replacing the previous one
        "save_strategy": "no",
        "save_total_limit": 1,
        "disable_tqdm": True,
        # the run seed: TRL's prompt order (RepeatSampler) and RNG, the Trainer's data_seed, the sampler's RNG
        "seed": key.seed,
        "data_seed": key.seed,
        "sampler_kwargs": {"seed": key.seed},  # merged into the level's sampler keys
        **({"use_cpu": True, "bf16": False} if cpu else {}),
    }
    return load_recipe(
        f"tiny/{key.arm}/{key.level}", merge(parse_overrides(overrides), parse_overrides(scale.overrides))
    )


# ---------------------------------------------------------------------------------------------------------
# results of one run


def run_series(log_history: Iterable[Mapping[str, Any]]) -> dict[str, list]:
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


def run_summary(series: Mapping[str, list], held_out: Mapping[str, list], window: int = 5) -> dict[str, Any]:
    """Run-level numbers of one run: reward and train accuracy over the first and the last ``window`` steps,
    held-out accuracy before, after and best, mean |δ| at step 1 and over the run, grad norm (last window and
    max), suppressed fraction, entropy (last window), class shares (token-mean over the run)."""
    n = len(series.get("step", []))
    w = max(1, min(window, n))

    def first(name):
        return _mean(series.get(name, [])[:w])

    def last(name):
        return _mean(series.get(name, [])[-w:])

    acc = held_out.get("accuracy", [])
    measured = [a for a in acc if a is not None]
    grad = [g for g in series.get("grad_norm", []) if g is not None]
    step1 = [d for s, d in zip(series.get("step", []), series.get("mean_abs_delta", [])) if s == 1]
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
        "mean_abs_delta_step1": step1[0] if step1 else None,
        "mean_abs_delta": _mean(series.get("mean_abs_delta", [])),
        "grad_norm_last": last("grad_norm"),
        "grad_norm_max": max(grad) if grad else None,
        "suppressed_frac": _mean(series.get("suppressed_frac", [])),
        "guarded_last": last("guarded_frac"),
        "class_share": {c: _mean(series.get(f"share/{c}", [])) for c in CLASSES},
    }


def load_runs(output_dir: str | Path, fingerprint: str | None = None) -> dict[RunKey, dict]:
    """Every finished run in ``output_dir/runs`` (sorted by level, arm, seed in recipe order). With
    ``fingerprint``, a run of another scale is an error naming its file."""
    from triage.experiments.recipes import ALL_ARMS, LEVELS

    found = {}
    for path in sorted((Path(output_dir) / RUNS_DIR).glob("*/*/seed*.json")):
        if path.name.endswith(PARTIAL_SUFFIX):  # cut short by a time budget: not finished
            continue
        entry = json.loads(path.read_text())
        if fingerprint is not None and entry.get("fingerprint") != fingerprint:
            raise ValueError(
                f"{path} was produced by another study scale (fingerprint {entry.get('fingerprint')} != "
                f"{fingerprint}); use another --output or delete it"
            )
        found[RunKey(entry["level"], entry["arm"], int(entry["seed"]))] = entry

    def order(key: RunKey):
        rank = {name: i for i, name in enumerate(LEVELS + ALL_ARMS)}
        return rank.get(key.level, len(rank)), key.level, rank.get(key.arm, len(rank)), key.arm, key.seed

    return {k: found[k] for k in sorted(found, key=order)}


# ---------------------------------------------------------------------------------------------------------
# aggregation over seeds


def seed_stats(values: Iterable[float | None]) -> dict[str, Any]:
    """``{"n", "mean", "std", "min", "max"}`` of the measured values (``None`` skipped); ``std`` is the sample
    standard deviation over seeds, sqrt(Σ (x − mean)² / (n − 1)), ``None`` below two values."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return {"n": 0, "mean": None, "std": None, "min": None, "max": None}
    return {
        "n": len(xs),
        "mean": statistics.fmean(xs),
        "std": statistics.stdev(xs) if len(xs) > 1 else None,
        "min": min(xs),
        "max": max(xs),
    }


def _band(runs: Sequence[Mapping[str, Any]], section: str, name: str) -> dict[str, list]:
    """Per step (the union of the runs' steps): mean, min and max over the runs that measured it."""
    by_step: dict[int, list[float]] = {}
    for run in runs:
        part = run.get(section) or {}
        for step, value in zip(part.get("step", []), part.get(name, [])):
            by_step.setdefault(int(step), [])
            if value is not None:
                by_step[int(step)].append(float(value))
    steps = sorted(by_step)
    stats = [seed_stats(by_step[s]) for s in steps]
    return {"step": steps, **{k: [st[k] for st in stats] for k in ("mean", "min", "max")}}


def _group(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The results.json entry of one (level, arm): its runs aggregated over seeds."""
    summaries = [r.get("summary") or {} for r in runs]
    return {
        "n": len(runs),
        "seeds": [r["seed"] for r in runs],
        "correction": runs[0].get("correction"),
        "description": runs[0].get("description"),
        "seconds": seed_stats(r.get("seconds") for r in runs),
        # the runs continued from a checkpoint (time budget), with the steps they were resumed after
        "resumed": [{"seed": r["seed"], "at": r["resumed_at"]} for r in runs if r.get("resumed_at")],
        # the learners the runs saved (save_models): folders relative to the study folder
        "models": [{"seed": r["seed"], "paths": r["models"]} for r in runs if r.get("models")],
        "summary": {k: seed_stats(s.get(k) for s in summaries) for k in SUMMARY_KEYS},
        "class_share": {
            c: seed_stats((s.get("class_share") or {}).get(c) for s in summaries) for c in CLASSES
        },
        "series": {name: _band(runs, "series", name) for name in BAND_SERIES},
        "held_out": _band(runs, "held_out", "accuracy"),
    }


def aggregate(
    runs: Mapping[RunKey, Mapping[str, Any]],
    scale: Mapping[str, Any],
    sft: Mapping[str, Any] | None,
    study: Mapping[str, Any] | None = None,
) -> dict:
    """The ``results.json`` dict: the scale, the SFT summary, the requested study (levels, arms, seeds) and,
    per level and arm with at least one finished run, :func:`_group` of its runs (``groups[level][arm]``)."""
    grouped: dict[str, dict[str, list]] = {}
    for key, entry in runs.items():
        grouped.setdefault(key.level, {}).setdefault(key.arm, []).append(entry)
    return {
        "scale": scale.get("name"),
        "config": dict(scale),
        "sft": sft,
        "study": {k: study[k] for k in ("levels", "arms", "seeds")} if study else None,
        "groups": {lv: {arm: _group(r) for arm, r in arms.items()} for lv, arms in grouped.items()},
    }


def _fmt(value: Any, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _pm(stats: Mapping[str, Any] | None, spec: str) -> str:
    """``mean ± std`` (just the mean for one seed; a dash when nothing was measured)."""
    stats = stats or {}
    if stats.get("mean") is None:
        return "–"
    if stats.get("std") is None:
        return format(stats["mean"], spec)
    return f"{format(stats['mean'], spec)} ± {format(stats['std'], spec)}"


def markdown_table(results: Mapping[str, Any]) -> str:
    """One row per (level, arm): seeds, held-out accuracy (start → end, best), train reward (first 5 → last 5
    steps), entropy (last 5), mean |δ| at step 1 and over the run, grad norm (last 5), the amplify-down share,
    suppressed fraction, the share of responses the TRIAGE sequence guard scaled down (last 5), wall time.
    Every cell is the mean ± sample std over seeds (the mean alone for one seed)."""
    lines = [
        "| level | arm | n | held-out acc. (start → end) | held-out best | reward (first 5 → last 5) "
        "| entropy (last 5) | mean \\|δ\\| step 1 | mean \\|δ\\| | grad norm (last 5) | amplify-down "
        "| suppressed | guarded (last 5) | s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for level, arms in (results.get("groups") or {}).items():
        for arm, group in arms.items():
            s = group.get("summary") or {}
            lines.append(
                f"| {level} | {arm} | {group.get('n')} "
                f"| {_pm(s.get('held_out_first'), '.1%')} → {_pm(s.get('held_out_last'), '.1%')} "
                f"| {_pm(s.get('held_out_best'), '.1%')} "
                f"| {_pm(s.get('reward_first'), '.3f')} → {_pm(s.get('reward_last'), '.3f')} "
                f"| {_pm(s.get('entropy_last'), '.3f')} | {_pm(s.get('mean_abs_delta_step1'), '.4f')} "
                f"| {_pm(s.get('mean_abs_delta'), '.4f')} | {_pm(s.get('grad_norm_last'), '.3f')} "
                f"| {_pm((group.get('class_share') or {}).get('amplify_down'), '.2%')} "
                f"| {_pm(s.get('suppressed_frac'), '.2%')} | {_pm(s.get('guarded_last'), '.1%')} "
                f"| {_pm(group.get('seconds'), '.0f')} |"
            )
    return "\n".join(lines) + "\n"


def plot_file(level: str) -> str:
    """The figure of one level: ``ablation-<level>.png``."""
    return f"ablation-{level}.png"


def write_results(output_dir: str | Path, results: Mapping[str, Any], plots: bool = True) -> list[str]:
    """Write ``results.json``, ``results.md`` (and one ``ablation-<level>.png`` per level) to ``output_dir``;
    returns the file names."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / RESULTS_FILE).write_text(json.dumps(results, indent=1, default=str) + "\n")
    sft = results.get("sft") or {}
    final = sft.get("final") or {}
    header = [
        f"# triage ablate --scale {results.get('scale')}",
        "",
        f"SFT checkpoint: {sft.get('params', '?')} parameters, {sft.get('steps_done', '?')} steps, held-out greedy "
        f"accuracy {_fmt(final.get('accuracy'), '.1%')} (by level {final.get('by_difficulty')}).",
        "",
        "n = finished seeds; each cell is the mean ± sample std over seeds (min and max in results.json).",
        "",
    ]
    resumed = [
        f"{level}/{arm}/{r['seed']} after step {', '.join(map(str, r['at']))}"
        for level, arms in (results.get("groups") or {}).items()
        for arm, group in arms.items()
        for r in group.get("resumed") or []
    ]
    footer = ["", "Resumed from a checkpoint: " + "; ".join(resumed) + ".", ""] if resumed else []
    (output_dir / TABLE_FILE).write_text("\n".join(header) + markdown_table(results) + "\n".join(footer))
    files = [RESULTS_FILE, TABLE_FILE]
    if plots:
        from triage.experiments.plots import plot_level

        for level in results.get("groups") or {}:
            plot_level(results, level, output_dir / plot_file(level))
            files.append(plot_file(level))
    return files


# ---------------------------------------------------------------------------------------------------------
# running one run


def _on_schedule(step: int, scale: StudyScale) -> bool:
    """Whether the held-out accuracy is measured after ``step`` (0: before the first step)."""
    return step % scale.eval_every == 0 or step >= scale.steps


def _ends_past(deadline: float, began: float, now: float) -> bool:
    """Whether a step begun at ``began`` and ended at ``now`` would, repeated, end past ``deadline``."""
    return now + (now - began) > deadline


def _run_callback(
    trainer,
    tokenizer,
    dataset,
    scale: StudyScale,
    log: Callable[[str], None],
    deadline: float | None,
    held_out: Mapping[str, list] | None,
    checkpointed: Callable[[Path, dict], None],
    save_models: Sequence[int] = (),
    models_dir: Path | None = None,
):
    """A ``TrainerCallback`` that records the learner's greedy held-out accuracy into ``callback.record``
    (before step 1, every ``eval_every`` steps and after the last: :func:`_on_schedule`; a resumed run starts
    from the checkpoint's ``held_out`` and does not measure step 0 again), prints each step, and, with
    ``deadline`` (``time.time()`` seconds), stops training after a step when the next one would end past it (a
    step is expected to take as long as the last one). Then ``callback.stopped_by`` is ``"time_budget"`` (else
    ``"steps"``) and the trainer saves a checkpoint of that step (TRL's: model, optimizer, scheduler, RNG and
    sampler states), after which ``checkpointed(folder, record)`` stores the run's own state beside it and the
    held-out accuracy is measured once more, off schedule unless the step is on it, for the partial file only:
    the checkpoint holds the state the uninterrupted run has after that step (the greedy decoding draws from
    torch's global RNG, which the checkpoint saved before it). After a step in ``save_models`` it saves the
    learner to ``models_dir/model-step<step>`` (:func:`_save_learner`; before that step's held-out measurement
    and checkpoint: the weights the optimizer step left)."""
    from transformers import TrainerCallback

    from triage.experiments.sft import greedy_accuracy

    class RunCallback(TrainerCallback):
        def __init__(self):
            self.record: dict[str, list] = {
                k: list((held_out or {}).get(k, [])) for k in ("step", "accuracy", "by_difficulty")
            }
            self.start, self.stopped_by = time.time(), "steps"

        def _evaluate(self, step: int) -> None:
            import torch

            model = trainer.accelerator.unwrap_model(trainer.model)
            with torch.no_grad(), trainer.accelerator.autocast():
                acc = greedy_accuracy(
                    model, tokenizer, dataset, scale.sft.max_new_tokens, scale.sft.eval_batch_size
                )
            self.record["step"].append(step)
            self.record["accuracy"].append(acc["accuracy"])
            self.record["by_difficulty"].append(acc["by_difficulty"])

        def on_train_begin(self, args, state, control, **kwargs):
            if state.global_step == 0:  # a resumed run has its step-0 measurement from the checkpoint
                self._evaluate(0)

        def on_step_begin(self, args, state, control, **kwargs):
            self.began = time.time()

        def on_step_end(self, args, state, control, **kwargs):
            step, now = state.global_step, time.time()
            if deadline is not None and step < scale.steps and _ends_past(deadline, self.began, now):
                control.should_training_stop = control.should_save = True
                self.stopped_by = "time_budget"
            if step in save_models and models_dir is not None:
                folder = models_dir / f"{MODEL_PREFIX}{step}"
                what = "saved to" if _save_learner(trainer, folder) else "kept, already there:"
                log(f"    step {step:>3}/{scale.steps}: model {what} {folder}")
            if _on_schedule(step, scale):
                self._evaluate(step)

        def on_save(self, args, state, control, **kwargs):  # after the trainer's checkpoint of this step
            from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

            step = state.global_step
            checkpointed(Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}", self.record)
            if not _on_schedule(step, scale):
                self._evaluate(step)
                log(
                    f"    step {step:>3}/{scale.steps}: held-out {self.record['accuracy'][-1]:.1%} (off schedule)"
                )

        def on_log(self, args, state, control, logs=None, **kwargs):  # after on_step_end of the same step
            if not logs or "reward" not in logs:
                return
            step = state.global_step
            held = self.record["accuracy"][-1] if self.record["step"][-1] == step else None
            log(
                f"    step {step:>3}/{scale.steps}: reward {logs['reward']:+.3f}, mean |δ| "
                f"{logs.get('triage/mean_abs_delta', float('nan')):.4f}"
                + (f", held-out {held:.1%}" if held is not None else "")
                + f" ({time.time() - self.start:.0f} s)"
            )

    return RunCallback()


def _write_json(path: Path, entry: Mapping[str, Any]) -> None:
    """Write whole, then rename: a reader never sees half a file (a run is finished once its JSON exists)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(entry, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def _checkpoint(run_dir: Path) -> Path | None:
    """The run's checkpoint: the newest ``checkpoint-<step>`` in its output folder whose save completed (its
    :data:`RUN_STATE_FILE`, written last, is there); ``None`` if there is none."""
    from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(str(run_dir)) if run_dir.is_dir() else None
    return Path(last) if last is not None and (Path(last) / RUN_STATE_FILE).is_file() else None


def _drop_checkpoints(run_dir: Path) -> None:
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    for folder in run_dir.glob(f"{PREFIX_CHECKPOINT_DIR}-*") if run_dir.is_dir() else ():
        shutil.rmtree(folder)


def _model_folders(run_dir: Path) -> list[Path]:
    """The run's saved models, ``model-step<step>`` folders (complete: not ``.tmp``), by step."""
    found = []
    for folder in run_dir.glob(f"{MODEL_PREFIX}*") if run_dir.is_dir() else ():
        step = folder.name[len(MODEL_PREFIX) :]
        if folder.is_dir() and step.isdigit():
            found.append((int(step), folder))
    return [folder for _, folder in sorted(found)]


def _drop_models(run_dir: Path) -> None:
    """Remove the run's saved models, complete or not (a run that starts again from step 0)."""
    for folder in run_dir.glob(f"{MODEL_PREFIX}*") if run_dir.is_dir() else ():
        if folder.is_dir():
            shutil.rmtree(folder)


def _save_learner(trainer, folder: Path) -> bool:
    """The trainer's model and tokenizer as a local HF folder (``trainer.save_model``: the unwrapped model's
    ``save_pretrained`` with its weights as the trainer holds them, fp32 masters of an NVFP4 learner whose
    ``NVFP4Linear`` keeps ``nn.Linear``'s state_dict, and the processing class), written to
    ``<folder>.tmp`` and renamed: a folder named ``model-step<k>`` is complete. A folder already there (an
    earlier attempt of a resumed run) is left as it is: returns ``False``."""
    if folder.is_dir():
        return False
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    trainer.save_model(str(tmp))
    os.replace(tmp, folder)
    return True


def _resume_state(checkpoint: Path, scale: StudyScale, key: RunKey, recipe: Mapping[str, Any]) -> dict:
    """The run state saved in ``checkpoint``, checked against the run that would continue it: the same run
    (level/arm/seed), scale fingerprint and recipe (but for where the folder lies), else ``ValueError``
    naming the checkpoint and the field."""
    state = json.loads((checkpoint / RUN_STATE_FILE).read_text())
    for name, value in (("run", str(key)), ("fingerprint", scale.fingerprint())):
        if state.get(name) != value:
            raise ValueError(
                f"{checkpoint} is not a checkpoint of this run: its {name} is {state.get(name)!r}, this run's "
                f"{value!r}; delete it or run without --resume"
            )
    changed = _recipe_changes(recipe, state.get("recipe") or {})
    if changed:
        raise ValueError(
            f"{checkpoint} was trained with another recipe than {key.arm}/{key.level} gives now (differs in "
            f"{changed}); delete it or run without --resume"
        )
    return state


def run_one(
    scale: StudyScale,
    key: RunKey,
    output_dir: str | Path,
    deadline: float | None = None,
    log: Callable[[str], None] = print,
    resume: bool = False,
    save_models: Sequence[int] = (),
) -> dict[str, Any] | None:
    """Train one run from the SFT checkpoint in ``output_dir/sft``; write and return its entry
    (``DIR/runs/<level>/<arm>/seed<k>.json``).

    With ``deadline`` (``time.time()`` seconds), a run that would end past it stops after a step and saves a
    checkpoint of that step in its output folder ``seed<k>/checkpoint-<step>`` (the trainer's own:
    ``Trainer._save_checkpoint``, TRL's ``GRPOTrainer`` with the triage states; ``save_total_limit: 1``
    keeps one), with :data:`RUN_STATE_FILE` beside it (the run, fingerprint, recipe, held-out record,
    seconds, start and resume steps). It is not finished: nothing is returned and its entry goes to
    ``seed<k>.partial.json`` (``"complete": false``, the steps it ran), which results never read.

    With ``resume`` and such a checkpoint, the run continues from it (``trainer.train(resume_from_checkpoint
    =...)``): the checkpoint must be of this run, scale fingerprint and recipe (else ``ValueError`` naming the
    field). The step numbers continue (the series comes from the restored ``log_history``), held-out
    accuracy keeps its ``eval_every`` schedule, ``seconds`` adds up the calls, and ``resumed_at`` lists the
    steps the run was resumed after. Without a checkpoint (or without ``resume``) the run starts from step 0
    and says so; its earlier ``seed<k>.json``, partial file, checkpoints and saved models are removed first. A
    finished run removes its checkpoint.

    **Saved models.** After each optimizer step in ``save_models`` the run saves its learner (the weights as
    the trainer holds them: fp32 masters for an NVFP4 learner) and tokenizer as a local HF folder,
    ``seed<k>/model-step<step>/`` (:func:`_save_learner`: written under ``.tmp`` and renamed, so a folder of
    that name is complete; one already there is kept). They are not checkpoints: a finished run keeps them.
    The entry's ``models`` lists every such folder of the run (also those of its earlier calls), relative to
    ``output_dir``. A step past the run's steps saves nothing.

    **What a resumed run shares with the uninterrupted one.** Restored: the model's weights, AdamW's moments
    and step, the learning-rate schedule, the Python/NumPy/torch RNG states, the data order (TRL's
    ``RepeatSampler`` is seeded; the trainer skips the consumed batches), the HF sampler's own
    ``torch.Generator`` state (``sampler_state_<rank>.json``) and TRIAGE's adaptive τ. Rebuilt, from those:
    the sampler's weight copy, its KV cache and CUDA graphs, NVFP4 weight caches. The checkpoint is taken
    before the off-schedule held-out measurement of the cut step, whose greedy decode draws from torch's
    global RNG. On CPU (deterministic kernels) the resumed per-step series is therefore bit-identical to the
    uninterrupted run's (a test checks it); on a GPU, kernels that are not deterministic (atomics, CUDA-graph
    vs eager decode) may make them differ in the last bits. Not restored: the per-module call counter that
    seeds the stochastic rounding of an NVFP4 learner's gradients (``backward: nvfp4-backward``, no shipped
    level) restarts, so those rounding draws differ after a resume."""
    import torch
    from transformers import AutoTokenizer
    from transformers.trainer_callback import PrinterCallback

    from triage.experiments.data import synthetic_math
    from triage.experiments.train import build_trainer

    output_dir = Path(output_dir)
    started, start = time.time(), time.perf_counter()
    cpu = not torch.cuda.is_available()
    model_dir, run_dir = output_dir / SFT_DIR, key.path(output_dir)
    recipe = run_recipe(scale, key, model_dir, run_dir, cpu=cpu)
    checkpoint = _checkpoint(run_dir) if resume else None
    state = _resume_state(checkpoint, scale, key, recipe) if checkpoint is not None else {}
    # a run that starts again replaces its old result: until it finishes it has none, so a re-run that is cut
    # short or crashes leaves no earlier seed<k>.json in the results (nor an earlier attempt's partial file)
    key.path(output_dir, ".json").unlink(missing_ok=True)
    if checkpoint is None:
        key.path(output_dir, PARTIAL_SUFFIX).unlink(missing_ok=True)
        _drop_checkpoints(run_dir)
        _drop_models(run_dir)
        if resume:
            log(f"    {key}: no checkpoint in {run_dir}: starting from step 0")
    else:
        log(f"    {key}: resuming from {checkpoint} (step {state['step']}/{scale.steps})")
    resumed_at = list(state.get("resumed_at", [])) + ([state["step"]] if checkpoint is not None else [])
    started = state.get("started", started)

    def seconds() -> float:
        return state.get("seconds", 0.0) + time.perf_counter() - start

    def checkpointed(folder: Path, held_out: Mapping[str, list]) -> None:
        run_state = {
            "run": str(key),
            "fingerprint": scale.fingerprint(),
            "step": _checkpoint_step(folder),
            "started": started,
            "seconds": seconds(),
            "resumed_at": resumed_at,
            "held_out": held_out,
            "recipe": recipe,
        }
        _write_json(folder / RUN_STATE_FILE, run_state)

    trainer = build_trainer(recipe, recipe["output_dir"])
    trainer.remove_callback(PrinterCallback)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    held_out = synthetic_math(scale.n_eval, list(scale.sft.difficulty), scale.sft.seed, "eval")
    callback = _run_callback(
        trainer,
        tokenizer,
        held_out,
        scale,
        log,
        deadline,
        state.get("held_out"),
        checkpointed,
        save_models=tuple(save_models),
        models_dir=run_dir,
    )
    trainer.add_callback(callback)
    trainer.train(resume_from_checkpoint=None if checkpoint is None else str(checkpoint))
    series = run_series(trainer.state.log_history)
    held = callback.record
    summary = run_summary(series, held)
    sft_record = json.loads((model_dir / "sft.json").read_text())
    complete = callback.stopped_by == "steps"
    entry = {
        "level": key.level,
        "arm": key.arm,
        "seed": key.seed,
        "description": recipe.get("description"),
        "correction": recipe.get("correction"),
        "fingerprint": scale.fingerprint(),
        "params": sft_record.get("params"),
        "mean_abs_delta_step1": summary["mean_abs_delta_step1"],
        "seconds": seconds(),
        "started": started,
        "finished": time.time(),
        "device": "cpu" if cpu else torch.cuda.get_device_name(),
        "complete": complete,
        "stopped_by": callback.stopped_by,
        "resumed_at": resumed_at,
        "models": [f.relative_to(output_dir).as_posix() for f in _model_folders(run_dir)],
        "series": series,
        "held_out": held,
        "summary": summary,
        "recipe": recipe,
    }
    del trainer
    if not cpu:
        torch.cuda.empty_cache()
    if not complete:
        _write_json(key.path(output_dir, PARTIAL_SUFFIX), entry)
        log(
            f"    {key}: stopped by the time budget after step {summary['steps']}/{scale.steps}; not finished "
            "(checkpoint saved: --resume continues it)"
        )
        return None
    _write_json(key.path(output_dir, ".json"), entry)
    key.path(output_dir, PARTIAL_SUFFIX).unlink(missing_ok=True)
    _drop_checkpoints(run_dir)
    return entry


# ---------------------------------------------------------------------------------------------------------
# running a study


def _run_here(
    scale: StudyScale,
    key: RunKey,
    output_dir: Path,
    deadline: float | None,
    log: Callable[[str], None],
    resume: bool,
    save_models: Sequence[int] = (),
) -> str:
    """:func:`run_one` in this process, its lines (and a crash's traceback) also written to its log file;
    returns ``"done"``, ``"cut short"`` or ``"failed"``."""
    path = key.path(output_dir, ".log")
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a" if resume else "w", encoding="utf-8") as fh:

        def tee(line: str) -> None:
            log(line)
            fh.write(line + "\n")
            fh.flush()

        try:
            entry = run_one(scale, key, output_dir, deadline, tee, resume=resume, save_models=save_models)
        except Exception:
            fh.write(traceback.format_exc())
            return "failed"
    return "done" if entry is not None else "cut short"


def _spawn(
    key: RunKey, output_dir: Path, deadline: float | None, threads: int, resume: bool
) -> subprocess.Popen:
    """``python -m triage ablate --output DIR --run KEY [--resume]`` as a child process writing to the run's
    log (appending under ``resume``: a resumed run's log keeps the lines of its earlier calls)."""
    path = key.path(output_dir, ".log")
    path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "triage",
        "--debug",
        "ablate",
        "--output",
        str(output_dir),
        "--run",
        str(key),
    ]
    if deadline is not None:
        cmd += ["--deadline", repr(deadline)]
    if resume:
        cmd.append("--resume")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", str(threads))
    with path.open("a" if resume else "w", encoding="utf-8") as fh:  # the child holds its own handle
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)


def _last_error(log_path: Path) -> str:
    """The last non-empty line of a log (a traceback's exception line)."""
    lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(empty log)"


def _recipe_changes(now: Mapping[str, Any], ran: Mapping[str, Any]) -> list[str]:
    """The top-level recipe keys in which ``ran`` (as a run's JSON holds it) differs from ``now``, but for
    where the folder lies: the SFT checkpoint's and the run's output paths."""
    where = ("model_name_or_path", "output_dir")
    now = json.loads(json.dumps(now, default=str))  # as the run's JSON holds it
    return sorted(k for k in now.keys() | ran.keys() if k not in where and now.get(k) != ran.get(k))


def _check_recipes(study: Study, output_dir: Path, done: Mapping[RunKey, Mapping[str, Any]]) -> None:
    """A finished run that ``study`` asks for must have run the recipe it would run now (else an edited
    level or arm file would mix stale runs into the results): ``ValueError`` naming the file and the keys.
    Where the folder lies is no part of a recipe: the two paths inside it (the SFT checkpoint, the run's
    output folder) are not compared, so a study folder moved or copied elsewhere resumes."""
    import torch

    cpu = not torch.cuda.is_available()
    for key in study.runs():
        if key not in done:
            continue
        now = run_recipe(study.scale, key, output_dir / SFT_DIR, key.path(output_dir), cpu=cpu)
        changed = _recipe_changes(now, done[key].get("recipe") or {})
        if changed:
            raise ValueError(
                f"{key.path(output_dir, '.json')} ran another recipe than {key.arm}/{key.level} gives now "
                f"(differs in {changed}); delete it or use another --output"
            )


def _checkpoint_step(checkpoint: Path) -> int:
    """The optimizer step of a ``checkpoint-<step>`` folder."""
    return int(checkpoint.name.rsplit("-", 1)[1])


def _seconds_per_step(output_dir: Path, scale: StudyScale) -> float:
    """Seconds per optimizer step of the runs of ``scale`` in ``output_dir``, finished or cut short (their
    seconds over their steps; a resumed run's seconds add up its calls), else ``arm_seconds / steps``."""
    fingerprint = scale.fingerprint()
    entries = list(load_runs(output_dir, fingerprint).values())
    for path in (output_dir / RUNS_DIR).glob(f"*/*/seed*{PARTIAL_SUFFIX}"):
        entry = json.loads(path.read_text())
        if entry.get("fingerprint") == fingerprint:
            entries.append(entry)
    steps = sum(e["summary"]["steps"] for e in entries)
    return sum(e["seconds"] for e in entries) / steps if steps else scale.arm_seconds / scale.steps


def run_study(
    study: Study,
    output_dir: str | Path,
    resume: bool = False,
    plots: bool = True,
    log: Callable[[str], None] = print,
) -> tuple[dict[str, Any], dict[RunKey, str]]:
    """SFT (unless its checkpoint exists), then every run of ``study`` not finished yet (all of them without
    ``resume``; with it, a run cut short continues from its checkpoint), up to ``study.parallel`` at once.
    Returns the ``results.json`` dict and each requested run's status: ``done``, ``skipped`` (finished before,
    ``resume``), ``cut short`` (checkpointed), ``not started`` (time budget), ``failed`` (its log holds the
    traceback).

    With a time budget a run is started only if at least ``min(eval_every, its steps left)`` of its steps
    are expected to end before the deadline: a run cut short loses no step, so it need not fit the budget.
    The expected seconds per step are those of the runs in ``DIR`` (finished or cut short: their seconds
    over their steps), else the scale's ``arm_seconds / steps``."""
    from triage.experiments.sft import ensure_sft_checkpoint, sft_summary

    start = time.time()
    deadline = None if study.time_budget is None else start + study.time_budget
    output_dir = Path(output_dir)
    scale, fingerprint = study.scale, study.scale.fingerprint()
    done = load_runs(output_dir, fingerprint)  # errors early on runs of another config
    if resume:
        _check_recipes(study, output_dir, done)
    status = {k: "skipped" for k in study.runs() if resume and k in done}
    todo = [k for k in study.runs() if k not in status]
    sft_dir = output_dir / SFT_DIR
    log(
        f"triage ablate --scale {scale.name}: {len(todo)} run(s) to run ({len(study.levels)} level(s) × "
        f"{len(study.arms)} arm(s) × {len(study.seeds)} seed(s)"
        + (f", {len(status)} already done" if status else "")
        + f"), {study.parallel} at a time; SFT {'cached' if (sft_dir / 'sft.json').is_file() else 'first'}"
    )
    past = [s for s in study.save_models if s > scale.steps]
    if past:
        log(f"save_models: step(s) {past} past the {scale.steps} steps of a run: nothing saved there")
    sft = sft_summary(ensure_sft_checkpoint(scale.sft, sft_dir, log))
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / STUDY_FILE).write_text(json.dumps(study.to_dict(), indent=1) + "\n")  # what children read

    def finished(key: RunKey, outcome: str) -> None:
        runs = load_runs(output_dir, fingerprint)
        if outcome == "done" and key not in runs:  # exited cleanly without its JSON: not finished
            outcome = "failed"
        status[key] = outcome
        if outcome == "done":
            s = runs[key]["summary"]
            log(
                f"  {key} done in {runs[key]['seconds']:.0f} s: held-out {_fmt(s['held_out_first'], '.1%')} → "
                f"{_fmt(s['held_out_last'], '.1%')}, reward {_fmt(s['reward_first'], '.3f')} → "
                f"{_fmt(s['reward_last'], '.3f')}, mean |δ| {_fmt(s['mean_abs_delta'], '.4f')}"
            )
            write_results(output_dir, aggregate(runs, scale.to_dict(), sft, study.to_dict()), plots=plots)
        elif outcome == "failed":
            log_path = key.path(output_dir, ".log")
            log(f"  {key} FAILED: {_last_error(log_path)} (traceback in {log_path})")
        else:
            log(f"  {key} {outcome}")

    threads = max(1, (os.cpu_count() or 1) // study.parallel)
    pending, running = list(todo), {}
    while pending or running:
        while pending and len(running) < study.parallel:
            key = pending[0]
            checkpoint = _checkpoint(key.path(output_dir)) if resume else None
            left = scale.steps - (0 if checkpoint is None else _checkpoint_step(checkpoint))
            need = _seconds_per_step(output_dir, scale) * min(scale.eval_every, left)
            if deadline is not None and time.time() + need > deadline:
                log(
                    f"time budget: {time.time() - start:.0f} s used of {study.time_budget:.0f} s, "
                    f"{min(scale.eval_every, left)} step(s) of {key} take ~{need:.0f} s; {len(pending)} run(s) "
                    "not started. Continue with --resume."
                )
                status.update({k: "not started" for k in pending})
                pending = []
                break
            pending.pop(0)
            log(f"[{len(todo) - len(pending)}/{len(todo)}] {key}")
            if study.parallel == 1:
                finished(key, _run_here(scale, key, output_dir, deadline, log, resume, study.save_models))
            else:
                running[key] = _spawn(key, output_dir, deadline, threads, resume)
        for key, proc in list(running.items()):
            code = proc.poll()
            if code is None and deadline is not None and time.time() > deadline + KILL_GRACE:
                log(f"  {key}: still running {KILL_GRACE:.0f} s past the time budget; killed")
                proc.kill()
                code = proc.wait()
            if code is not None:
                del running[key]
                finished(key, {0: "done", EXIT_CUT_SHORT: "cut short"}.get(code, "failed"))
        if running:
            time.sleep(0.2)
    runs = load_runs(output_dir, fingerprint)
    results = aggregate(runs, scale.to_dict(), sft, study.to_dict())
    if runs:
        write_results(output_dir, results, plots=plots)
    return results, status


# ---------------------------------------------------------------------------------------------------------
# CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """argparse, not ``trl.TrlParser``: the study is layered (a scale ← a study file ← these flags, and
    ``--set`` recipe overrides), which no one dataclass's fields express."""
    parser.add_argument(
        "--scale", choices=sorted(SCALES), default=None, help="smoke (CPU, CI), local or testbed (one GPU)"
    )
    parser.add_argument(
        "--study", default=None, help="a study YAML (scale, levels, arms, seeds, ...); flags win"
    )
    parser.add_argument(
        "--output",
        required=True,
        help="folder for sft/, runs/, study.json, results.json, results.md, figures",
    )
    parser.add_argument("--levels", default=None, help="comma-separated mismatch levels (default: realistic)")
    parser.add_argument("--arms", default=None, help="comma-separated subset of the arms (default: the six)")
    parser.add_argument("--seeds", default=None, help="comma-separated run seeds (default: 0)")
    parser.add_argument(
        "--parallel", type=int, default=None, help="runs at once (default 1: in this process)"
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="skip the runs already finished in --output; continue those cut short from their checkpoints",
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="override the scale's optimizer steps per run"
    )
    parser.add_argument(
        "--mini", action="store_true", help="shrink the scale to smoke size (check the pipeline on CPU)"
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds: start no run that would end past this, stop started ones in time (then --resume)",
    )
    parser.add_argument(
        "--save-models",
        default=None,
        metavar="STEPS",
        help="comma-separated optimizer steps after which every run saves its learner and tokenizer to "
        "runs/<level>/<arm>/seed<k>/model-step<step>/ (an HF folder), e.g. --save-models 100,200",
    )
    parser.add_argument(
        "--set",
        action="extend",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="recipe overrides for every run (YAML values, dotted keys), e.g. --set learning_rate=1e-4",
    )
    parser.add_argument("--no-plots", action="store_true", help="skip the figures")
    parser.add_argument(
        "--run",
        default=None,
        metavar="LEVEL/ARM/SEED",
        help="run one run of DIR/study.json (what --parallel starts)",
    )
    parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)  # with --run


def resolve_study(args: argparse.Namespace) -> Study:
    """The :class:`Study` of the command line: the study file (``--study``), then the flags over it."""
    spec = load_study_file(args.study) if args.study else {}
    name = args.scale or spec.get("scale")
    if name is None:
        raise ValueError("give --scale or a --study file that names a scale")
    scale = SCALES[name]
    if args.mini or spec.get("mini"):
        scale = mini(scale)
    steps = args.steps if args.steps is not None else spec.get("steps")
    if steps is not None:
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be a positive int, got {steps!r}")
        scale = dataclasses.replace(scale, steps=steps)
    overrides = {**scale.overrides, **(spec.get("overrides") or {})}
    if args.set:
        from triage.experiments.recipes import parse_overrides, parse_value

        parse_overrides(args.set)  # malformed KEY=VALUE is an error now, not after the SFT
        pairs = (text.split("=", 1) for text in args.set)
        overrides.update({k.strip(): parse_value(v) for k, v in pairs})
    scale = dataclasses.replace(scale, overrides=overrides)

    def pick(flag: Any, key: str, default: Any) -> Any:
        return flag if flag is not None else spec.get(key, default)

    return Study(
        scale=scale,
        levels=pick(args.levels, "levels", ("realistic",)),
        arms=pick(args.arms, "arms", None),
        seeds=pick(args.seeds, "seeds", (0,)),
        parallel=pick(args.parallel, "parallel", 1),
        time_budget=pick(args.time_budget, "time_budget", None),
        save_models=pick(args.save_models, "save_models", ()),
    )


def _run_child(args: argparse.Namespace) -> int:
    """``--run LEVEL/ARM/SEED``: one run of the study in ``--output`` (``DIR/study.json``: the scale and
    ``save_models``), in this process (with ``--resume``: from its checkpoint, if it has one)."""
    path = Path(args.output) / STUDY_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: --run runs one run of a study that triage ablate started")
    study = json.loads(path.read_text())
    _check_scale_key(study, path)
    scale = StudyScale.from_dict(study["scale"])
    save_models = _save_steps(study.get("save_models"))  # a study.json of before the key: none
    entry = run_one(
        scale, RunKey.parse(args.run), args.output, args.deadline, resume=args.resume, save_models=save_models
    )
    return 0 if entry is not None else EXIT_CUT_SHORT


def run(args: argparse.Namespace) -> int:
    from triage.experiments.demo import quiet

    if args.run is not None:
        with quiet():
            return _run_child(args)
    study = resolve_study(args)
    with quiet():
        results, status = run_study(study, args.output, resume=args.resume, plots=not args.no_plots)
    print()
    print(markdown_table(results), end="")
    counts = {s: sum(1 for v in status.values() if v == s) for s in dict.fromkeys(status.values())}
    print("\nruns: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    failed = [k for k, s in status.items() if s == "failed"]
    for key in failed:
        print(f"  failed: {key} (traceback in {key.path(args.output, '.log')})")
    print(f"results in {Path(args.output).resolve()}")
    return 1 if failed else 0
