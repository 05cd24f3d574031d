"""Shared by the LoRA tests (imported by name: this folder is on sys.path under pytest)."""

#: Torch reference kernels for whole-model tests (the interpreter is exercised by the layer tests).
FAST = dict(gemm_backend="reference", quant_backend="torch")


def freeze(compute: str = "w4a4", **frozen):
    """The ``NVFP4Config`` that freezes a model's ``NVFP4Linear`` layers only (plain layers and experts stay),
    computing ``compute`` on the torch reference kernels."""
    from triage.kernels import NVFP4Config, NVFP4FrozenConfig

    return NVFP4Config(linear=None, moe=None, frozen=NVFP4FrozenConfig(compute=compute, **FAST, **frozen))
