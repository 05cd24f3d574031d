"""Suite-wide setup: without a CUDA device, Triton kernels run under its interpreter; the AIME-2024 fixture.

TRITON_INTERPRET is read when a kernel is decorated (``@triton.jit`` returns an interpreted function only if
it is set then) and when its launcher is built, so it must be set before any test module (of any folder)
imports code that imports triton — hence here, at the root, at collection time. The kernel modules are
imported here too: a test that later sets ``TRITON_INTERPRET=0`` (to run the torch twins) must not be the
first importer, or its kernels would be decorated for a GPU that is not there and break every later test.
"""

import gc
import importlib
import json
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    for _module in (
        "triage.kernels.nvfp4.quantize_rows",
        "triage.kernels.nvfp4.dequantize_rows",
        "triage.kernels.nvfp4.quantize_columns",
        "triage.kernels.nvfp4.gemm_dense",
        "triage.kernels.nvfp4.gemm_decode",
        "triage.kernels.moe.grouped_triton",
    ):
        importlib.import_module(_module)


AIME24 = Path(__file__).resolve().parents[2] / "shared" / "data" / "aime24" / "test.jsonl"


@pytest.fixture(scope="session")
def aime24_path() -> Path:
    """The shared AIME-2024 file beside the repo (the test is skipped without it)."""
    if not AIME24.is_file():
        pytest.skip(f"AIME-2024 file absent: expected {AIME24} (the shared data folder beside the repo)")
    return AIME24


@pytest.fixture(scope="session")
def aime24_rows(aime24_path) -> list[dict]:
    return [json.loads(line) for line in aime24_path.read_text(encoding="utf-8").splitlines() if line.strip()]


# The trainers call ``gc.collect()`` at the start of every ``train()`` (accelerate's ``free_memory``), and a
# full collection walks every tracked object: with torch, transformers, TRL and the test modules loaded that
# is ~0.3 s a call on a 2-core CI box, for every short CPU run. Objects alive when a test module starts
# (modules, classes, session fixtures) are moved to the permanent generation after one collection, so later
# collections walk only what the tests create. Nothing a test creates is frozen before it runs: a cycle
# made by a test is collected as before.
_frozen_module = None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    global _frozen_module
    module = getattr(item, "module", None)
    if module is not _frozen_module:
        _frozen_module = module
        gc.collect()
        gc.freeze()


def pytest_sessionfinish(session):
    gc.unfreeze()
