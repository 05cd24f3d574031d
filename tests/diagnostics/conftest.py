"""Fixtures for the diagnostics tests: a trained-ish tiny model and a sampled batch (session-scoped).

Tiny CPU ops are dominated by thread hand-off on a shared 2-core box, so these tests run single-threaded
(restored afterwards). Triton, if anything imports it, runs in the interpreter without CUDA.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest  # noqa: E402

from triage.trainers.diagnostics.tiny_model import TinyDiagnoseConfig, sample_batch, train_tiny_model  # noqa: E402

TINY = TinyDiagnoseConfig(train_steps=60, train_batch=16, sequences=32, max_new_tokens=16)


@pytest.fixture(scope="session", autouse=True)
def _single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def trained(_single_thread):
    """(model, tokenizer): the tiny preset model after a short deterministic training run (fp32)."""
    return train_tiny_model(TINY)


@pytest.fixture(scope="session")
def batch(trained):
    model, tokenizer = trained
    return sample_batch(model, tokenizer, TINY.sequences, TINY.max_new_tokens, seed=1)
