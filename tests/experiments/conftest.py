"""Shared setup for tests/experiments: no network, Triton interpreter without CUDA (the AIME fixtures are
suite-wide, in tests/conftest.py)."""

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

