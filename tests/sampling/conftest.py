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

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
from sampling_fakes import FakeEngineServer  # noqa: E402
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
    server = FakeEngineServer()
    server.start()
    yield server
    server.stop()


def make_fake_trainer(tokenizer, model, max_completion_length=6, temperature=1.0, **args):
    """The attributes of a TRL ``GRPOTrainer`` that the sources read, without TRL."""
    values = dict(
        max_completion_length=max_completion_length,
        temperature=temperature,
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        chat_template_kwargs=None,
    )
    values.update(args)
    return SimpleNamespace(
        processing_class=tokenizer,
        args=SimpleNamespace(**values),
        eos_token_ids=[tokenizer.eos_token_id],
        state=SimpleNamespace(global_step=0),
        model=model,
        accelerator=None,
    )


@pytest.fixture
def fake_trainer(tokenizer, tiny_model):
    return make_fake_trainer(tokenizer, tiny_model)
