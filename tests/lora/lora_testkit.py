"""Shared by the LoRA tests (imported by name: this folder is on sys.path under pytest)."""

#: Torch reference kernels for whole-model tests (the interpreter is exercised by the layer tests).
FAST = dict(gemm_backend="reference", quant_backend="torch")
