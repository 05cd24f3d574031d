"""Mixture-of-experts NVFP4: the grouped expert GEMM (and its ragged-K weight-gradient twin) and the
Qwen3-MoE expert conversion."""

from .grouped_gemm import (
    check_offsets,
    dequantize64,
    expand_experts,
    grouped_gemm,
    grouped_gemm_reference,
    grouped_mm,
    grouped_wgrad,
    grouped_wgrad_reference,
    offsets_from_expert_ids,
    pad_segments,
    padded_segments,
)

__all__ = [
    "check_offsets",
    "dequantize64",
    "expand_experts",
    "grouped_gemm",
    "grouped_gemm_reference",
    "grouped_mm",
    "grouped_wgrad",
    "grouped_wgrad_reference",
    "offsets_from_expert_ids",
    "pad_segments",
    "padded_segments",
]
