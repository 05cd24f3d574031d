"""``triage train --config recipe.yaml``: train with ``TriageGRPOTrainer`` from a recipe, single- or multi-process.

A recipe is TRL's YAML convention — a flat mapping of ``GRPOConfig`` field names (here ``TriageGRPOConfig``:
TRL's fields plus the TRIAGE fields) — plus a few sections (``triage.experiments.recipes``)::

    model_name_or_path: Qwen/Qwen3-4B-Base     # or a local folder, or "tiny" (built locally, no hub)
    dataset: {source: synthetic, n: 512, difficulty: [1, 2]}   # triage.experiments.data spec
    eval_dataset: {...}                                         # optional
    reward_funcs: [dapo_accuracy, {soft_overlong: {cache_length: 16}}]   # triage.trainers.rewards names
    correction: triage                                          # TRIAGE fields ...
    tau: 0.05
    learning_rate: 1.0e-6                                       # ... and any GRPOConfig field
    sampler: hf                                                 # or use_vllm: true, ...

``load_recipe`` layers ``base.yaml`` ← ``preset:`` ← ``arm:`` ← the file ← (``--cpu``: ``recipes/cpu.yaml``) ←
``KEY=VALUE`` overrides given after the options (``triage train --config r.yaml max_steps=5 dataset.n=64``),
validates every key, and the trainer runs under ``accelerate launch``::

    accelerate launch --config_file experiments/accelerate/ddp.yaml -m triage train --config recipe.yaml

At the end the model is saved to ``output_dir`` and the main process writes ``report.json`` and the plots
(``triage.trainers.report``) there.

The flags are argparse's, not ``trl.TrlParser``'s: TrlParser reads one flat ``--config`` file into a
dataclass's defaults, whereas a recipe is the layered ``base ← preset ← arm ← level ← file`` with sections that
are no ``TriageGRPOConfig`` field (model, datasets, rewards, launch), which ``load_recipe`` resolves.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

TINY_MODEL = "tiny"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="recipe YAML, or PRESET/ARM (e.g. tiny/triage)")
    parser.add_argument(
        "--output_dir", "--output-dir", default=None, help="overrides the recipe's output_dir"
    )
    parser.add_argument(
        "--resume_from_checkpoint",
        "--resume-from-checkpoint",
        default=None,
        help="a checkpoint folder, or 'latest' for the newest checkpoint in output_dir",
    )
    parser.add_argument("--no-report", action="store_true", help="skip report.json and the plots")
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="layer experiments/recipes/cpu.yaml over the recipe: a laptop smoke run of the tiny preset "
        "(the tiny model built locally, CPU, fp32, 8 steps, a small eval)",
    )
    parser.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        help="torch CPU threads (default: 1 with --cpu, torch's otherwise)",
    )
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides (YAML values)")


def _positive_int(text: str) -> int:
    """argparse type of ``--threads``: an integer >= 1 (torch refuses fewer threads)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _check_model_path(name: str) -> None:
    """A ``model_name_or_path`` that cannot be a hub model id (``huggingface_hub``'s rule: ``./runs/x``,
    ``a/b/c``, an absolute path) names a local folder: a missing one is a ``FileNotFoundError`` naming it,
    instead of a hub lookup error."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if name == TINY_MODEL or Path(name).exists():
        return
    try:
        validate_repo_id(name)
    except HFValidationError:
        raise FileNotFoundError(
            f"model_name_or_path {name!r}: no such folder (and not a hub model id). The tiny preset expects the "
            "SFT checkpoint of `triage ablate --scale local --output runs/ablate`; for a laptop smoke run with "
            "a locally built tiny model, add --cpu"
        ) from None


def _model_path(name: str, output_dir: Path) -> str:
    """``"tiny"`` → a tiny Qwen3 + tokenizer saved under ``output_dir/tiny-model`` (main process first)."""
    if name != TINY_MODEL:
        return name
    from accelerate import PartialState

    from triage.trainers.tiny import save_tiny_model

    path = output_dir / "tiny-model"
    with PartialState().main_process_first():
        if not (path / "config.json").is_file():
            save_tiny_model(path)
    return str(path)


def build_trainer(recipe: dict, output_dir: str | os.PathLike):
    """``TriageGRPOTrainer`` for a validated flat recipe (model, datasets, rewards, config)."""
    from triage.experiments.data import load_from_spec
    from triage.experiments.recipes import build_config, split_recipe
    from triage.trainers.grpo_trainer import TriageGRPOTrainer
    from triage.trainers.rewards import build_reward_funcs

    _, sections = split_recipe(recipe)
    output_dir = Path(output_dir)
    _check_model_path(sections["model_name_or_path"])  # first: on a laptop this error says --cpu
    args = build_config(recipe, output_dir=str(output_dir))
    train_dataset = load_from_spec(sections["dataset"])
    eval_dataset = load_from_spec(sections["eval_dataset"]) if sections.get("eval_dataset") else None
    rewards = build_reward_funcs(sections["reward_funcs"], args.max_completion_length)
    return TriageGRPOTrainer(
        model=_model_path(sections["model_name_or_path"], output_dir),
        reward_funcs=rewards,
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
    )


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from triage.experiments.recipes import dump_recipe, load_recipe
    from triage.trainers.report import format_summary, write_report

    recipe = load_recipe(args.config, args.overrides, cpu=args.cpu)
    threads = args.threads if args.threads is not None else (1 if args.cpu else None)
    if threads is not None:  # the tiny model's ops are too small to gain from threads; they only contend
        import torch

        torch.set_num_threads(threads)
    output_dir = Path(
        args.output_dir or recipe.get("output_dir") or Path("runs") / Path(str(args.config)).stem
    )
    recipe["output_dir"] = str(output_dir)
    trainer = build_trainer(recipe, output_dir)
    if trainer.accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "recipe.yaml").write_text(dump_recipe(recipe))
    resume = args.resume_from_checkpoint
    if resume == "latest":
        resume = True
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(str(output_dir))
    if trainer.accelerator.is_main_process and not args.no_report:
        report = write_report(trainer.state.log_history, output_dir, config=recipe)
        print(format_summary(report))
        print(f"model, recipe.yaml and report.json written to {output_dir.resolve()}")
    accelerator = trainer.accelerator
    accelerator.wait_for_everyone()
    # Release the DDP-wrapped model before destroying the process group: a DDP reducer freed after
    # destroy_process_group can hang in its gloo destructor (seen in ~1 of 3 CPU runs), and one freed at
    # interpreter exit with the group alive can abort the process. free_memory() drops accelerate's own
    # references and gc-collects the trainer's reference cycles.
    del trainer
    accelerator.free_memory()
    accelerator.end_training()  # finish trackers, destroy the process group (clean multi-process exit)
    return 0
