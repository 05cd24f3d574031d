"""Run Triton kernels through the interpreter when no CUDA device is present (must precede triton import)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
