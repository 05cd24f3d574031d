"""``triage demo``: a few TRIAGE GRPO steps on a tiny local model, on any machine (CPU is fine, no hub).

What it runs:

* a tiny Qwen3-architecture model and a ChatML BPE tokenizer built locally (``triage.trainers.tiny``);
* synthetic DAPO-format arithmetic prompts (``triage.experiments.data.synthetic_math``);
* rewards: DAPO's ±1 ``math_dapo`` accuracy plus a dense shaping reward, the share of digits in the response
  (a randomly initialised model never writes a correct ``Answer: N``, so accuracy alone gives every group
  equal rewards, zero advantages and nothing to learn or to show);
* the built-in HF sampler with per-token log-probs, running a **bf16 copy** of the learner (the learner
  stays fp32): the engine mismatch TRIAGE corrects. ``--sampler-precision nvfp4`` makes the copy NVFP4.

It prints a progress bar and a summary (reward, mean |δ|, token-class shares), and writes ``report.json``
and PNG plots to ``--output`` (see ``triage.trainers.report``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
import warnings
from pathlib import Path

from triage import CORRECTIONS

DEFAULTS = dict(steps=12, prompts=4, generations=4, max_completion_length=24, learning_rate=3e-3)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", default="./triage-demo", help="folder for report.json and the plots")
    parser.add_argument("--steps", type=int, default=DEFAULTS["steps"], help="optimizer steps")
    parser.add_argument("--prompts", type=int, default=DEFAULTS["prompts"], help="prompts per step")
    parser.add_argument(
        "--generations", type=int, default=DEFAULTS["generations"], help="completions per prompt"
    )
    parser.add_argument("--max-completion-length", type=int, default=DEFAULTS["max_completion_length"])
    parser.add_argument("--learning-rate", type=float, default=DEFAULTS["learning_rate"])
    parser.add_argument("--correction", choices=CORRECTIONS, default="triage", help="mismatch correction")
    parser.add_argument(
        "--tau",
        default="0.001",
        help="tolerance band |δ| ≤ τ in nats, or 'auto' (default 0.001: the bf16-vs-fp32 gap of the tiny model "
        "is ~1e-3 nats; real engines differ by 1e-2 and more)",
    )
    parser.add_argument(
        "--sampler-precision",
        choices=("bf16", "nvfp4"),
        default=None,
        help="numerics of the sampler's copy of the model; default bf16 on CPU (the learner is fp32 there) and "
        "nvfp4 on GPU (the learner is bf16 there)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-plots", action="store_true", help="write report.json only")


def digit_share(completions, **_) -> list[float]:
    """Dense shaping reward: the share of characters of the response that are digits (0..1)."""
    from triage.trainers.rewards import completion_text

    out = []
    for i, completion in enumerate(completions):
        text = completion_text(completion, i)
        out.append(sum(ch.isdigit() for ch in text) / len(text) if text else 0.0)
    return out


@contextlib.contextmanager
def _quiet():
    """Silence library warnings and progress bars for the demo's run (restored afterwards)."""
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


def _progress_callback(total: int):
    from tqdm.auto import tqdm
    from transformers import TrainerCallback

    class DemoProgress(TrainerCallback):
        """One bar for the run; the postfix shows the last step's reward and mean |δ|."""

        def on_train_begin(self, args, state, control, **kwargs):
            self.bar = tqdm(total=total, desc="TRIAGE GRPO", unit="step", dynamic_ncols=True)

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


def build_trainer(args: argparse.Namespace):
    """The demo's ``TriageGRPOTrainer`` (tiny model, synthetic data, HF sampler on a low-precision copy)."""
    import torch

    from triage.experiments.data import synthetic_math
    from triage.trainers.config import TriageGRPOConfig
    from triage.trainers.grpo_trainer import TriageGRPOTrainer
    from triage.trainers.rewards import build_reward_funcs
    from triage.trainers.tiny import TinyModelSpec, build_model, build_tokenizer

    for name in ("steps", "prompts", "max_completion_length"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.generations < 2:
        raise ValueError("--generations must be >= 2 (GRPO compares completions of the same prompt)")
    output = Path(args.output)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, TinyModelSpec(), seed=args.seed)
    dataset = synthetic_math(args.steps * args.prompts, difficulty=1, seed=args.seed)
    use_cpu = not torch.cuda.is_available()
    sampler_kwargs = {"seed": args.seed, "precision": args.sampler_precision}
    if args.sampler_precision == "nvfp4":
        sampler_kwargs["quant_recipe"] = {"scale": "row"}  # per-token activation scales (vs the bf16 learner)
    config = TriageGRPOConfig(
        output_dir=str(output / "trainer"),
        use_cpu=use_cpu,
        bf16=not use_cpu,
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
        correction=args.correction,
        tau=args.tau,
        sampler="hf",
        sampler_kwargs=sampler_kwargs,
    )
    rewards = build_reward_funcs(["dapo_accuracy"], args.max_completion_length) + [digit_share]
    trainer = TriageGRPOTrainer(
        model=model,
        reward_funcs=rewards,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # the raw log dicts; the demo prints a summary instead
    trainer.add_callback(_progress_callback(args.steps))
    return trainer


def run(args: argparse.Namespace) -> int:
    with _quiet():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    import torch

    from triage.trainers.report import format_summary, write_report

    if args.sampler_precision is None:
        args.sampler_precision = "nvfp4" if torch.cuda.is_available() else "bf16"

    start = time.perf_counter()
    print(
        f"triage demo: tiny Qwen3 (local, random init), synthetic arithmetic, correction={args.correction}, "
        f"sampler = {args.sampler_precision} copy of the learner"
    )
    trainer = build_trainer(args)
    trainer.train()
    config = {
        "correction": args.correction,
        "tau": args.tau,
        "sampler_precision": args.sampler_precision,
        "steps": args.steps,
        "prompts_per_step": args.prompts,
        "generations": args.generations,
        "max_completion_length": args.max_completion_length,
        "learning_rate": args.learning_rate,
        "seed": args.seed,
        "triage_config": trainer.triage_config.to_dict(),
    }
    report = write_report(trainer.state.log_history, args.output, config=config, plots=not args.no_plots)
    print()
    print(format_summary(report))
    files = ["report.json", *report["plots"]]
    print(
        f"\nwrote {', '.join(files)} to {Path(args.output).resolve()} in {time.perf_counter() - start:.0f} s"
    )
    return 0
