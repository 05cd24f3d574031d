"""Shared setup for tests/experiments: no network, Triton interpreter without CUDA (the AIME fixtures are
suite-wide, in tests/conftest.py)."""

from __future__ import annotations

import os

import pytest

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


@pytest.fixture(scope="module")
def torch_twins():
    """For the rest of the module: the kernels' torch twins, not the interpreter (``TRITON_INTERPRET=0``; child
    processes inherit the environment), on one intra-op thread: the matrices are tiny, and on a shared 2-core
    machine two spinning threads per op made the runs several times slower."""
    import torch

    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "0")
    mp.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        mp.undo()
