"""Models and token batches for ``triage diagnose``: a trained-ish tiny model (CPU), or a local model.

A randomly initialised model has near-uniform next-token distributions, where every engine difference is
averaged away and δ says little. ``--model tiny`` (:class:`TinyDiagnoseConfig`) therefore trains the tiny
Qwen3 for a few hundred deterministic AdamW steps of the library's small SFT loop
(:func:`triage.trainers.tiny_sft.sft_steps`) on its synthetic arithmetic task at level 2
(``Compute a + b.`` → ``a + b = c.`` / ``Answer: c`` with two-digit ``+``/``-`` or a times-table ``*``, the
problem alone as the prompt): the answer copies
the question (attention) before it computes, which gives peaked distributions on the format tokens and
uncertain ones on the digits — the mix RL sees — in a dozen-token completion.

The tokens every path scores are sampled once (temperature 1, fixed seed) from the fp32 master with the
built-in KV-cache sampler (:func:`triage.trainers.sampling.hf.sample_with_kv_cache`), on prompts of the
task's ``eval`` split (never trained on).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from triage.trainers.tiny import SMALL_SPEC, TinyModelSpec

from .paths import TokenBatch

__all__ = ["TinyDiagnoseConfig", "sample_batch", "train_tiny_model"]


@dataclass(frozen=True)
class TinyDiagnoseConfig:
    """What ``triage diagnose --model tiny`` trains and scores.

    Attributes:
        model: the tiny Qwen3 shape.
        difficulty: level of :func:`~triage.trainers.tiny_sft.arithmetic_problem` trained on and prompted.
        train_steps, train_batch, lr: the SFT (``train_steps × train_batch`` distinct problems, constant lr,
            no weight decay); ``train_steps=0`` keeps the random initialisation.
        sequences, max_new_tokens: the scored batch (:func:`sample_batch`).
        seed: initialisation, data and sampling seed.
    """

    model: TinyModelSpec = SMALL_SPEC
    difficulty: int = 2
    train_steps: int = 120
    train_batch: int = 16
    lr: float = 1e-2
    sequences: int = 64
    max_new_tokens: int = 24
    seed: int = 0


def _prompt_ids(tokenizer, problem: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": problem}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(v) for v in ids]


def train_tiny_model(config: TinyDiagnoseConfig = TinyDiagnoseConfig()):
    """(model, tokenizer): a tiny Qwen3 trained on the arithmetic task of ``config`` (fp32, deterministic,
    eval mode, no gradients)."""
    from triage.trainers.tiny import build_model, build_tokenizer
    from triage.trainers.tiny_sft import arithmetic_problem, pad_completions, sft_steps

    tokenizer = build_tokenizer(config.model.vocab_size)
    model = build_model(tokenizer, config.model, seed=config.seed)
    if config.train_steps:
        problems = [
            arithmetic_problem(config.difficulty, config.seed, i)
            for i in range(config.train_steps * config.train_batch)
        ]
        rows = [
            (
                _prompt_ids(tokenizer, p.problem),
                tokenizer(p.solution, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id],
            )
            for p in problems
        ]
        ids, mask, labels = pad_completions(rows, tokenizer.pad_token_id)
        for _ in sft_steps(
            model,
            ids,
            mask,
            labels,
            steps=config.train_steps,
            batch_size=config.train_batch,
            learning_rate=config.lr,
            seed=config.seed,
        ):
            pass
    model.eval().requires_grad_(False)
    return model, tokenizer


@torch.no_grad()
def sample_batch(
    model: nn.Module,
    tokenizer,
    sequences: int,
    max_new_tokens: int,
    seed: int = 0,
    difficulty: int = TinyDiagnoseConfig.difficulty,
) -> TokenBatch:
    """Sample one completion (temperature 1) per prompt of the arithmetic task's ``eval`` split at
    ``difficulty`` from ``model`` and batch them."""
    from triage.trainers.sampling.base import SamplingParams
    from triage.trainers.sampling.hf import sample_with_kv_cache
    from triage.trainers.tiny_sft import arithmetic_problem

    prompts = [
        _prompt_ids(tokenizer, arithmetic_problem(difficulty, seed, i, "eval").problem)
        for i in range(sequences)
    ]
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens)
    # pads are masked out, so a tokenizer without a pad token (Llama, Mistral) pads with its EOS id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = sample_with_kv_cache(
        model.eval(), prompts, params, [tokenizer.eos_token_id], generator=generator, pad_id=pad
    )
    return TokenBatch.from_lists(prompts, out["completion_ids"], pad)
