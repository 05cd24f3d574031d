"""NVFP4 formats, recipes, reference quantizers, GEMMs and Triton kernels (``triage.kernels.nvfp4``).

Public contract: ``quantize(x, recipe) -> NVFP4Tensor``, ``dequantize(t)``, ``QuantRecipe``, ``NVFP4Tensor``,
the format helpers and the GEMMs ``gemm(a, b)`` (W4A4), ``gemm_w4a16(x, w)`` and ``expand(t)`` with their
torch twins. See docs/nvfp4.md and docs/kernels.md. Importing this package does not import triton.
"""

from .api import dequantize, quantize
from .export import (
    ExportResult,
    dequantized_state_dict,
    detect_layout,
    export_nvfp4_checkpoint,
    load_activation_recipes,
    load_nvfp4_checkpoint,
    read_nvfp4_checkpoint,
)
from .format import (
    BLOCK,
    E2M1_MAX,
    E2M1_VALUES,
    E4M3_MAX,
    e2m1_codes,
    e2m1_decode,
    e4m3_decode,
    e4m3_encode,
    pack_nibbles,
    swizzle_scales,
    unpack_nibbles,
    unswizzle_scales,
)
from .hadamard import TE_SIGNS, hadamard16, hadamard16_matrix, inverse_hadamard16
from .matmul import expand, gemm, gemm_reference, gemm_w4a16, gemm_w4a16_reference
from .recipe import PROFILES, QuantRecipe
from .reference import dequantize_reference, quantize_reference
from .tensor import NVFP4Tensor

__all__ = [
    "BLOCK",
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "ExportResult",
    "PROFILES",
    "TE_SIGNS",
    "NVFP4Tensor",
    "QuantRecipe",
    "dequantize",
    "dequantize_reference",
    "dequantized_state_dict",
    "detect_layout",
    "e2m1_codes",
    "e2m1_decode",
    "e4m3_decode",
    "e4m3_encode",
    "expand",
    "export_nvfp4_checkpoint",
    "gemm",
    "gemm_reference",
    "gemm_w4a16",
    "gemm_w4a16_reference",
    "hadamard16",
    "hadamard16_matrix",
    "inverse_hadamard16",
    "load_activation_recipes",
    "load_nvfp4_checkpoint",
    "read_nvfp4_checkpoint",
    "pack_nibbles",
    "quantize",
    "quantize_reference",
    "swizzle_scales",
    "unpack_nibbles",
    "unswizzle_scales",
]
