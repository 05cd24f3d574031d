"""Shared setup for tests/experiments: no network, Triton interpreter without CUDA, the AIME fixture."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
if "HF_DATASETS_CACHE" not in os.environ:  # keep the map/parquet caches of these tests out of ~/.cache
    import tempfile

    os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="triage-tests-datasets-")
try:  # set before anything imports triton (kernels are imported by some recipe validators)
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
AIME24 = REPO.parent / "shared" / "data" / "aime24" / "test.jsonl"


@pytest.fixture(scope="session")
def aime24_path() -> Path:
    if not AIME24.is_file():
        pytest.skip(f"AIME-2024 file absent: expected {AIME24} (the shared data folder beside the repo)")
    return AIME24


@pytest.fixture(scope="session")
def aime24_rows(aime24_path) -> list[dict]:
    return [json.loads(line) for line in aime24_path.read_text(encoding="utf-8").splitlines() if line.strip()]
