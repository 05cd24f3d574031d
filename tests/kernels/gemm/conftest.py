"""GEMM tests run the Triton kernels in the interpreter when there is no GPU (set before triton loads)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
