"""Supervised pre-training (SFT) of a small Qwen3-architecture model, from scratch, on the synthetic math task.

The RL ablation needs a policy that already solves a useful fraction of the problems: a random model never
writes a correct ``Answer: N``, every group gets equal rewards and GRPO has nothing to learn. This module
trains one with the small SFT loop of ``triage.trainers.tiny_sft`` (:func:`~triage.trainers.tiny_sft.sft_steps`;
the model is tiny, a loop over one pre-tokenised tensor is faster and simpler than a Trainer here):

* data: ``synthetic_math(n_train, difficulty, seed, held_out=n_eval)`` — the worked solutions of the rows
  (``extra_info.solution``, ending in ``Answer: N``) are the targets; the ``n_eval`` held-out problems
  (``split="eval"``) are never trained on and measure accuracy;
* tokenizer: the tiny ChatML byte-level BPE of ``triage.trainers.tiny``, trained on the prompt words only
  (:data:`TOKENIZER_CORPUS`), so numbers split into single digits as in Qwen's tokenizer;
* loss: next-token cross-entropy on the completion tokens only (the prompt is context):
  ``L = −(1/|C|) Σ_{t∈C} log p_θ(x_t | x_<t)``;
* AdamW, linear warm-up then cosine decay to ``min_lr_ratio``·lr; bf16 autocast on CUDA;
* accuracy: greedy decoding (:func:`greedy_accuracy`) scored with DAPO's rule (``dapo_score``), per level.

``train_sft`` saves the model, the tokenizer and ``sft.json`` (config, loss curve, accuracies) to its output
folder; ``ensure_sft_checkpoint`` skips the training when that folder already holds a checkpoint of the same
config.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from triage.trainers.tiny import TinyModelSpec

__all__ = [
    "TOKENIZER_CORPUS",
    "SFT_FILE",
    "SFTConfig",
    "build_sft_tokenizer",
    "tokenize_examples",
    "greedy_accuracy",
    "train_sft",
    "ensure_sft_checkpoint",
]

SFT_FILE = "sft.json"

TOKENIZER_CORPUS = [
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.",
    'Remember to put your answer on its own line after "Answer:".',
    "Compute Solve for x: Subtract from both sides: Answer: + - * / = ( ) . x",
    "user assistant system",
]
"""Corpus of the SFT tokenizer: the prompt and solution words, no digits (numbers tokenise digit by digit)."""


@dataclass(frozen=True)
class SFTConfig:
    """What :func:`train_sft` trains (every field goes into ``sft.json``; a changed field means a new run).

    Attributes:
        model: the Qwen3 shape (dimensions multiples of 16 for NVFP4); ``model.vocab_size`` sizes the tokenizer.
        difficulty: synthetic levels trained and evaluated (``triage.experiments.data.synthetic_math``).
        n_train: distinct training problems (drawn with replacement into batches).
        n_eval: held-out problems (``split="eval"``), excluded from training, for :func:`greedy_accuracy`.
        seed: data and initialisation seed.
        steps: optimizer steps; ``max_seconds`` stops earlier (a wall-clock cap, ``None``: none).
        batch_size: sequences per step.
        learning_rate, weight_decay, warmup_steps, min_lr_ratio: AdamW with warm-up + cosine decay.
        eval_every: steps between held-out evaluations (0: only at the end).
        target_accuracy: stop at the first evaluation whose held-out greedy accuracy reaches this (needs
            ``eval_every``; ``None``: train all steps). RL needs a policy that is right only part of the time
            (groups with mixed rewards, tokens with entropy); a fast learner of an easy task overshoots to 100 %.
        max_new_tokens: generation length for the evaluation.
    """

    model: TinyModelSpec = TinyModelSpec()
    difficulty: tuple[int, ...] = (1, 2, 3)
    n_train: int = 4096
    n_eval: int = 256
    seed: int = 0
    steps: int = 200
    max_seconds: float | None = None
    batch_size: int = 64
    learning_rate: float = 3e-3
    weight_decay: float = 0.01
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    eval_every: int = 0
    target_accuracy: float | None = None
    max_new_tokens: int = 48
    eval_batch_size: int = 256

    def __post_init__(self) -> None:
        for name in ("n_train", "n_eval", "steps", "batch_size", "max_new_tokens", "eval_batch_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"SFTConfig.{name} must be a positive int, got {getattr(self, name)!r}")
        if self.learning_rate <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("SFTConfig: learning_rate must be > 0 and min_lr_ratio in [0, 1]")
        if self.target_accuracy is not None and not (0 < self.target_accuracy <= 1 and self.eval_every > 0):
            raise ValueError(
                f"SFTConfig.target_accuracy must be in (0, 1] and needs eval_every > 0, got "
                f"{self.target_accuracy!r} with eval_every={self.eval_every}"
            )
        object.__setattr__(self, "difficulty", tuple(self.difficulty))

    def to_dict(self) -> dict[str, Any]:
        """The flat ``sft.json`` layout: the ``model`` fields beside the others. ``vocab_size``,
        ``max_position_embeddings``, ``tie_word_embeddings`` and ``target_accuracy`` are written only when
        they differ from their defaults, so the records of configs that leave them unset keep the layout
        (and the match of :func:`ensure_sft_checkpoint`) of checkpoints written before they were fields."""
        out = {**dataclasses.asdict(self.model), **dataclasses.asdict(self)}
        del out["model"]
        out["difficulty"] = list(self.difficulty)
        for name, default in _OPTIONAL.items():
            if out[name] == default:
                del out[name]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SFTConfig:
        """The inverse of :meth:`to_dict` (``sft.json``, ``study.json``); an unknown key is an error."""
        shape = {f.name for f in dataclasses.fields(TinyModelSpec)}
        own = {f.name for f in dataclasses.fields(cls)} - {"model"}
        unknown = sorted(set(data) - shape - own)
        if unknown:
            raise ValueError(f"SFTConfig: unknown fields {unknown} (expected some of {sorted(shape | own)})")
        model = TinyModelSpec(**{k: v for k, v in data.items() if k in shape})
        return cls(model=model, **{k: v for k, v in data.items() if k in own})


_OPTIONAL = {
    "vocab_size": TinyModelSpec.vocab_size,
    "max_position_embeddings": TinyModelSpec.max_position_embeddings,
    "tie_word_embeddings": TinyModelSpec.tie_word_embeddings,
    "target_accuracy": None,
}
"""Fields :meth:`SFTConfig.to_dict` leaves out at these values (absent from older ``sft.json`` files)."""


def build_sft_tokenizer(vocab_size: int = TinyModelSpec.vocab_size):
    """The tiny ChatML BPE tokenizer trained on :data:`TOKENIZER_CORPUS` (digits stay single tokens)."""
    from triage.trainers.tiny import build_tokenizer

    return build_tokenizer(vocab_size, corpus=TOKENIZER_CORPUS)


def prompt_ids(tokenizer, row: dict) -> list[int]:
    return tokenizer.apply_chat_template(
        row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def tokenize_examples(tokenizer, dataset) -> tuple[Any, Any, Any]:
    """(input_ids, attention_mask, labels) tensors, right-padded: prompt + solution + EOS, labels −100 on the
    prompt and the padding (the loss is on the completion only). A row without a solution is an error."""
    from triage.trainers.tiny_sft import pad_completions

    rows = []
    for i, row in enumerate(dataset):
        solution = row["extra_info"].get("solution")
        if not solution:
            raise ValueError(
                f"SFT row {i} ({row['extra_info'].get('index')}) has no worked solution to train on"
            )
        p = prompt_ids(tokenizer, row)
        c = tokenizer(solution, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((p, c))
    return pad_completions(rows, tokenizer.pad_token_id)


def greedy_accuracy(
    model, tokenizer, dataset, max_new_tokens: int = 48, batch_size: int = 256
) -> dict[str, Any]:
    """Greedy-decoding accuracy on ``dataset`` (DAPO's rule: +1 ⇔ correct), overall and per difficulty.

    Decodes with the HF sampler's KV-cache loop (``top_k=1``, ``decode="auto"``: CUDA-graph replay on a GPU) in
    the model's own numerics (an NVFP4 model runs its NVFP4 forward). Returns ``{"accuracy", "by_difficulty": {level: accuracy}, "n"}``.
    """
    import torch

    from triage.trainers.rewards import dapo_score
    from triage.trainers.sampling import SamplingParams, sample_with_kv_cache

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, top_k=1)
    correct: dict[int, list[float]] = {}
    was_training = model.training
    model.eval()
    try:
        rows = list(dataset)
        for start in range(0, len(rows), batch_size):
            batch = rows[start : start + batch_size]
            out = sample_with_kv_cache(
                model,
                [prompt_ids(tokenizer, r) for r in batch],
                params,
                [tokenizer.eos_token_id],
                pad_id=tokenizer.pad_token_id,
                decode="auto",
            )
            texts = tokenizer.batch_decode(out["completion_ids"], skip_special_tokens=True)
            for row, text in zip(batch, texts):
                level = int(row["extra_info"]["difficulty"] or 0)
                score = dapo_score(text, row["reward_model"]["ground_truth"])
                correct.setdefault(level, []).append(1.0 if score > 0 else 0.0)
    finally:
        model.train(was_training)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    total = [c for values in correct.values() for c in values]
    return {
        "accuracy": sum(total) / len(total) if total else None,
        "by_difficulty": {str(k): sum(v) / len(v) for k, v in sorted(correct.items())},
        "n": len(total),
    }


def train_sft(
    config: SFTConfig, output_dir: str | Path, log: Callable[[str], None] = print, device: str | None = None
) -> dict[str, Any]:
    """Train the model of ``config`` from scratch, save model + tokenizer + ``sft.json``; return that record."""
    import torch

    from triage.experiments.data import synthetic_math
    from triage.trainers.tiny import build_model
    from triage.trainers.tiny_sft import sft_steps

    output_dir = Path(output_dir)
    start = time.perf_counter()
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tokenizer = build_sft_tokenizer(config.model.vocab_size)
    model = build_model(tokenizer, config.model, seed=config.seed).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    train = synthetic_math(
        config.n_train, list(config.difficulty), config.seed, "train", held_out=config.n_eval
    )
    held_out = synthetic_math(config.n_eval, list(config.difficulty), config.seed, "eval")
    ids, mask, labels = (t.to(device) for t in tokenize_examples(tokenizer, train))
    log(
        f"SFT: Qwen3 {n_params / 1e6:.2f}M params, {len(train)} problems (levels {list(config.difficulty)}), "
        f"{config.steps} steps x {config.batch_size} on {device.type}"
        + (f", capped at {config.max_seconds:.0f} s" if config.max_seconds else "")
    )
    losses, evals = [], []
    step, stopped_by = 0, "steps"
    window = []
    for step, loss in sft_steps(
        model,
        ids,
        mask,
        labels,
        steps=config.steps,
        batch_size=config.batch_size,
        learning_rate=config.learning_rate,
        weight_decay=config.weight_decay,
        warmup_steps=config.warmup_steps,
        min_lr_ratio=config.min_lr_ratio,
        seed=config.seed,
    ):
        window.append(loss)
        last = step == config.steps
        over_time = config.max_seconds is not None and time.perf_counter() - start > config.max_seconds
        evaluate = bool(config.eval_every) and step % config.eval_every == 0 and not (last or over_time)
        if step % 50 == 0 or last or over_time or evaluate:  # an eval line reports the loss up to its step
            mean = float(torch.stack(window).float().mean())
            window = []
            if not math.isfinite(mean):
                raise FloatingPointError(f"SFT loss is {mean} at step {step}: lower SFTConfig.learning_rate")
            losses.append({"step": step, "loss": mean})
        if evaluate:
            acc = greedy_accuracy(model, tokenizer, held_out, config.max_new_tokens, config.eval_batch_size)
            evals.append({"step": step, **acc})
            log(
                f"  step {step}: loss {losses[-1]['loss']:.3f}, held-out greedy accuracy {acc['accuracy']:.1%} "
                f"{acc['by_difficulty']} ({time.perf_counter() - start:.0f} s)"
            )
        if over_time:
            stopped_by = "max_seconds"
            break
        if evaluate and config.target_accuracy is not None and acc["accuracy"] >= config.target_accuracy:
            stopped_by = "target_accuracy"
            break
    train_seconds = time.perf_counter() - start
    final = greedy_accuracy(model, tokenizer, held_out, config.max_new_tokens, config.eval_batch_size)
    evals.append({"step": step, **final})
    log(
        f"  SFT done: {step} steps, loss {losses[-1]['loss']:.3f}, held-out greedy accuracy "
        f"{final['accuracy']:.1%} by level {final['by_difficulty']} ({time.perf_counter() - start:.0f} s)"
    )
    record = {
        "config": config.to_dict(),
        "params": n_params,
        "steps_done": step,
        "stopped_by": stopped_by,
        "train_seconds": train_seconds,
        "seconds": time.perf_counter() - start,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "loss": losses,
        "eval": evals,
        "final": final,
    }
    output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    (output_dir / SFT_FILE).write_text(json.dumps(record, indent=1))
    return record


def ensure_sft_checkpoint(
    config: SFTConfig, output_dir: str | Path, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """The ``sft.json`` record of ``output_dir``: read it if the folder holds a checkpoint of ``config``,
    else train one (:func:`train_sft`). A checkpoint of a *different* config is an error (never overwritten)."""
    output_dir = Path(output_dir)
    path = output_dir / SFT_FILE
    if path.is_file() and (output_dir / "config.json").is_file():
        record = json.loads(path.read_text())
        ran, now = record.get("config") or {}, config.to_dict()
        if ran != now:
            changed = sorted(k for k in ran.keys() | now.keys() if ran.get(k) != now.get(k))
            raise ValueError(
                f"{output_dir} holds an SFT checkpoint of another config (differs in {changed}); "
                "delete it or use another --output"
            )
        log(
            f"SFT: reusing the checkpoint in {output_dir} (held-out greedy accuracy "
            f"{record['final']['accuracy']:.1%} by level {record['final']['by_difficulty']})"
        )
        return record
    return train_sft(config, output_dir, log)


def sft_summary(record: dict[str, Any]) -> dict[str, Any]:
    """The lines of an SFT record that ``results.json`` keeps."""
    return {
        k: record.get(k) for k in ("params", "steps_done", "stopped_by", "train_seconds", "device", "final")
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m triage.experiments.sft --scale local --output DIR [KEY=VALUE ...]``: the SFT of an ablation
    scale alone, with ``SFTConfig`` fields overridden (YAML values), e.g. ``steps=3000 eval_every=250``.
    Not ``trl.TrlParser``: the defaults are the chosen scale's (a layer), and the model shape is a nested
    ``TinyModelSpec`` whose fields are overridden by the same ``KEY=VALUE``."""
    import argparse

    import yaml

    from triage.experiments.ablate import SCALES

    parser = argparse.ArgumentParser(prog="python -m triage.experiments.sft", description=main.__doc__)
    parser.add_argument("--scale", choices=sorted(SCALES), default="local")
    parser.add_argument("--output", required=True, help="checkpoint folder (model, tokenizer, sft.json)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="SFTConfig fields")
    args = parser.parse_args(argv)
    fields = SCALES[args.scale].sft.to_dict()
    # every field, also those to_dict leaves out (an unset target_accuracy), and the model's fields
    names = sorted(
        {f.name for f in dataclasses.fields(SFTConfig) if f.name != "model"}
        | {f.name for f in dataclasses.fields(TinyModelSpec)}
    )
    for text in args.overrides:
        key, sep, value = text.partition("=")
        if not sep or key not in names:
            parser.error(f"{text!r}: expected KEY=VALUE with KEY one of {names}")
        fields[key] = yaml.safe_load(value)
    train_sft(SFTConfig.from_dict(fields), args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
