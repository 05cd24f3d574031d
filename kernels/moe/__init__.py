"""Mixture-of-experts NVFP4: the grouped expert GEMM and the Qwen3-MoE expert conversion."""

from .grouped_gemm import (
    check_offsets,
    dequantize64,
    expand_experts,
    grouped_gemm,
    grouped_gemm_reference,
    grouped_mm,
    offsets_from_expert_ids,
)

__all__ = [
    "check_offsets",
    "dequantize64",
    "expand_experts",
    "grouped_gemm",
    "grouped_gemm_reference",
    "grouped_mm",
    "offsets_from_expert_ids",
]
