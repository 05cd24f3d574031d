"""Tiny Qwen3-architecture models and a byte-level BPE tokenizer built locally — no hub access.

Used by the demo, the tests and the local experiments. The tokenizer is a ChatML byte-level BPE trained
on a small built-in corpus (digits, arithmetic, the DAPO prompt words), so arithmetic answers tokenize
into short sequences and every byte is representable.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = [
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.",
    'Remember to put your answer on its own line after "Answer:".',
    "What is 12 + 35? Answer: 47",
    "Compute 7 * 8 - 3. Answer: 53",
    "Let x be such that 3x + 4 = 19. Find x. Answer: 5",
    "the sum of the digits is 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 + - * / = ( ) .",
    "user assistant system problem answer number integer find compute what is the value of",
]


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of a tiny Qwen3 model. The defaults make a ~100k-parameter model that runs on CPU."""

    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    vocab_size: int = 512
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = True


SMALL_SPEC = TinyModelSpec(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
)
"""A 0.84M-parameter shape: the model of ``triage diagnose --model tiny`` and of the ``local`` ablation."""


def build_tokenizer(vocab_size: int = 512, corpus: list[str] | None = None):
    """Train a byte-level BPE on a small corpus and wrap it as a ChatML ``PreTrainedTokenizerFast``.

    eos = ``<|im_end|>``, pad = ``<|endoftext|>``; ``chat_template`` is minimal ChatML.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((corpus or _CORPUS) * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(tokenizer, spec: TinyModelSpec = TinyModelSpec(), seed: int = 0, dtype=None):
    """A randomly initialised ``Qwen3ForCausalLM`` sized by ``spec`` for ``tokenizer``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    if dtype is not None:
        model = model.to(dtype)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def save_tiny_model(path: str | os.PathLike, spec: TinyModelSpec = TinyModelSpec(), seed: int = 0) -> Path:
    """Build and save a tiny model + tokenizer to ``path`` (a directory usable as ``model=path``)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.vocab_size)
    model = build_model(tokenizer, spec, seed=seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
