"""Models and token batches for ``triage diagnose``: a trained-ish tiny model (CPU), or a local model.

A randomly initialised model has near-uniform next-token distributions, where every engine difference is
averaged away and δ says little. The tiny preset therefore trains the tiny Qwen3 for a few hundred
deterministic AdamW steps on a synthetic arithmetic chat task (``What is a + b?`` → ``Answer: c``), which
gives peaked distributions on the format tokens and uncertain ones on the digits — the mix RL sees.

The tokens every path scores are sampled once (temperature 1, fixed seed) from the fp32 master with the
built-in KV-cache sampler (:func:`triage.trainers.sampling.hf.sample_with_kv_cache`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import nn

from triage.trainers.tiny import TinyModelSpec

from .paths import TokenBatch

__all__ = ["TinyPreset", "arithmetic_chats", "sample_batch", "train_tiny_model"]


@dataclass(frozen=True)
class TinyPreset:
    """The tiny preset: model shape (a tiny Qwen3), training and the scored batch."""

    model: TinyModelSpec = TinyModelSpec(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    )
    train_steps: int = 120
    train_batch: int = 16
    lr: float = 3e-3
    sequences: int = 64
    max_new_tokens: int = 24
    seed: int = 0


def arithmetic_chats(n: int, seed: int) -> list[tuple[str, str]]:
    """``n`` (question, answer) pairs: ``What is a + b?`` / ``a + b = c. Answer: c`` (also -, *): the
    answer copies the question (attention) before it computes, so completions are a dozen tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        op = rng.choice("+-*")
        value = a + b if op == "+" else a - b if op == "-" else a * b
        out.append((f"What is {a} {op} {b}?", f"{a} {op} {b} = {value}. Answer: {value}"))
    return out


def _chat_ids(tokenizer, question: str, answer: str | None) -> list[int]:
    messages = [{"role": "user", "content": question}]
    if answer is None:
        return _as_ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    messages.append({"role": "assistant", "content": answer})
    return _as_ids(tokenizer.apply_chat_template(messages, tokenize=True))


def _as_ids(value) -> list[int]:
    if isinstance(value, dict) or hasattr(value, "keys"):
        value = value["input_ids"]
    return [int(v) for v in value]


def train_tiny_model(preset: TinyPreset = TinyPreset()):
    """(model, tokenizer): a tiny Qwen3 trained on :func:`arithmetic_chats` (fp32, deterministic, eval)."""
    from triage.trainers.tiny import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    model = build_model(tokenizer, preset.model, seed=preset.seed)
    if preset.train_steps:
        _train(model, tokenizer, preset)
    model.eval().requires_grad_(False)
    return model, tokenizer


def _train(model: nn.Module, tokenizer, preset: TinyPreset) -> None:
    torch.manual_seed(preset.seed)
    chats = arithmetic_chats(preset.train_steps * preset.train_batch, seed=preset.seed + 1)
    pad = tokenizer.pad_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=preset.lr, weight_decay=0.0)
    model.train()
    for step in range(preset.train_steps):
        rows = [
            _as_ids(_chat_ids(tokenizer, q, a))
            for q, a in chats[step * preset.train_batch : (step + 1) * preset.train_batch]
        ]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        labels = ids.masked_fill(mask == 0, -100)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.train(False)


@torch.no_grad()
def sample_batch(
    model: nn.Module, tokenizer, sequences: int, max_new_tokens: int, seed: int = 0
) -> TokenBatch:
    """Sample one completion per arithmetic prompt from ``model`` (temperature 1) and batch them."""
    from triage.trainers.sampling.base import SamplingParams
    from triage.trainers.sampling.hf import sample_with_kv_cache

    prompts = [_as_ids(_chat_ids(tokenizer, q, None)) for q, _ in arithmetic_chats(sequences, seed=seed + 7)]
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens)
    # pads are masked out, so a tokenizer without a pad token (Llama, Mistral) pads with its EOS id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = sample_with_kv_cache(
        model.eval(), prompts, params, [tokenizer.eos_token_id], generator=generator, pad_id=pad
    )
    return TokenBatch.from_lists(prompts, out["completion_ids"], pad)
