"""Fixtures for the LoRA-on-NVFP4 tests: a tiny local Qwen3 converted to NVFP4, no hub, CPU.

Triton kernels run in the interpreter when there is no GPU (set before anything imports triton).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from lora_testkit import FAST  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer():
    from triage.trainers.tiny import build_tokenizer

    return build_tokenizer()


@pytest.fixture
def nvfp4_model(tokenizer):
    """A tiny Qwen3 (fp32) with its Linear layers converted to NVFP4Linear (torch reference backends)."""
    from triage.kernels import NVFP4Config, NVFP4LinearConfig, convert
    from triage.trainers.tiny import build_model

    model = build_model(tokenizer, seed=0)
    return convert(model, NVFP4Config(linear=NVFP4LinearConfig(**FAST)))
