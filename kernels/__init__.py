"""NVFP4 numerics and Triton kernels, imported as ``triage.kernels``.

Depends on torch and triton only; never on ``triage.trainers``. Importing this package is cheap: the
names below load their modules (and triton) on first use.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "NVFP4Linear": "triage.kernels.linear",
    "NVFP4LinearConfig": "triage.kernels.linear",
    "convert_to_nvfp4": "triage.kernels.linear",
    "convert_from_nvfp4": "triage.kernels.linear",
    "grouped_gemm": "triage.kernels.moe",
    "grouped_gemm_reference": "triage.kernels.moe",
    "offsets_from_expert_ids": "triage.kernels.moe",
    "convert_moe_experts": "triage.kernels.moe.experts",
    "convert_moe_experts_from_nvfp4": "triage.kernels.moe.experts",
    "NVFP4MoeExperts": "triage.kernels.moe.experts",
    "MoEQuantConfig": "triage.kernels.moe.experts",
    "FrozenNVFP4Linear": "triage.kernels.frozen_linear",
    "NVFP4BaseConfig": "triage.kernels.frozen_linear",
    "freeze_nvfp4_base": "triage.kernels.frozen_linear",
    "DEFAULT_SKIP": "triage.kernels.skip",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'triage.kernels' has no attribute {name!r}")
