"""Fixtures for the sampler-source tests: tiny local model, fake SGLang/vLLM servers on 127.0.0.1, fake trainer."""

from __future__ import annotations

import os

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest  # noqa: E402
from sampling_fakes import FakeEngineServer, make_fake_trainer  # noqa: E402

from triage.trainers.tiny import TinyModelSpec, build_model, build_tokenizer, save_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    return build_model(tokenizer, TinyModelSpec(), seed=0).eval()


@pytest.fixture(scope="session")
def sampling_model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("sampling-tiny") / "model"))


@pytest.fixture
def fake_server():
    with FakeEngineServer() as server:
        yield server


@pytest.fixture
def fake_trainer(tokenizer, tiny_model):
    return make_fake_trainer(tokenizer, tiny_model)
