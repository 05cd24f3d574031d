"""Mixture-of-experts NVFP4: the grouped expert GEMM (and its ragged-K weight-gradient twin) and the
Qwen3-MoE expert conversion."""

from .grouped_gemm import *  # noqa: F403  (the names of grouped_gemm.__all__)
from .grouped_gemm import __all__  # noqa: F401
