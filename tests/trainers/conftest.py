"""Fixtures for the TRL-integration tests: a tiny local Qwen3, a synthetic prompt set, deterministic rollouts.

Everything is local (no hub) and small enough for 2-step CPU runs.
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
from trainer_testkit import arithmetic_dataset  # noqa: E402

from triage.trainers.tiny import save_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture
def dataset():
    return arithmetic_dataset()
