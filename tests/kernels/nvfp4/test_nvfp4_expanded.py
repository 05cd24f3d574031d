"""``quantize(..., emit_expanded=)`` and the expand / dequantize kernels: exact ``q·s`` values, bit for bit.

The quantize kernel writes the expansion in the same pass as the bytes; it must equal ``expand`` of the same
NVFP4 tensor (and ``block_values()``) exactly, for every profile, recipe and output dtype, on adversarial
input (zero blocks, NaN/Inf, huge, subnormal, midpoints), odd shapes, padding and non-contiguous input.
"""

import warnings

import pytest
import torch

from triage.kernels.nvfp4 import PROFILES, QuantRecipe, quantize
from triage.kernels.nvfp4.dequantize_rows import expand_triton
from triage.kernels.nvfp4.fuzz import adversarial
from triage.kernels.nvfp4.matmul import expand, host_decode_scale

DEV = "cuda" if torch.cuda.is_available() else "cpu"
warnings.filterwarnings("ignore", category=RuntimeWarning)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def same_values(u: torch.Tensor, v: torch.Tensor) -> bool:
    """Identical bits, except that a NaN only has to be a NaN (its sign/payload is not specified)."""
    nan = torch.isnan(u)
    return torch.equal(nan, torch.isnan(v)) and torch.equal(bits(u)[~nan], bits(v)[~nan])


def torch_expand(t, dtype):
    return t.block_values().to(dtype)  # exact q·s in fp32, exactly representable in bf16/fp16


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"scale": "row", "rounding": "stochastic"},
        {"block": "16x16", "scale": "expert"},
        {"hadamard": True},
    ],
    ids=lambda v: "-".join(f"{k}={v[k]}" for k in v) or "default",
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_emit_expanded_is_expand_of_the_same_bytes(profile, variant, dtype):
    x = adversarial(48, 96, seed=11, device=DEV).reshape(3, 16, 96)
    recipe = QuantRecipe(profile=profile, **variant)
    t = quantize(x, recipe, backend="triton", emit_expanded=dtype, seed=3)
    ref = quantize(x, recipe, backend="torch", seed=3)
    assert torch.equal(t.data, ref.data) and torch.equal(
        t.scale.view(torch.uint8), ref.scale.view(torch.uint8)
    )
    assert t.expanded.dtype == dtype and t.expanded.shape == (3, 16, 96)
    want = torch_expand(ref, dtype)
    assert same_values(t.expanded, want), "emit_expanded differs from block_values()"
    assert expand(t, dtype) is t.expanded  # the GEMM picks the cached expansion up
    assert same_values(expand(ref, dtype), want)  # the expand kernel agrees


def test_emit_expanded_padding_noncontiguous_and_reference_backend():
    x = torch.randn(37, 50, device=DEV) * 5
    t = quantize(x, QuantRecipe(pad=True), backend="triton", emit_expanded=torch.bfloat16)
    assert t.expanded.shape == (37, 64)
    assert torch.equal(t.expanded[:, 50:].float(), torch.zeros(37, 14, device=DEV))
    assert same_values(t.expanded, torch_expand(t, torch.bfloat16))
    y = torch.randn(64, 48, device=DEV, dtype=torch.bfloat16).t()  # [48, 64] non-contiguous
    t = quantize(y, QuantRecipe(block="16x16"), backend="triton", emit_expanded=torch.float16)
    r = quantize(y, QuantRecipe(block="16x16"), backend="torch", emit_expanded=torch.float16)
    assert same_values(t.expanded, r.expanded)
    with pytest.raises(ValueError, match="emit_expanded"):
        quantize(x, QuantRecipe(pad=True), emit_expanded=torch.float32)


def test_expand_kernel_strided_rows_zero_nan_scales_and_fp32():
    x = adversarial(40, 160, seed=4, device=DEV)
    t = quantize(x, QuantRecipe(profile="modelopt"), backend="torch")  # NaN blocks -> scale byte 0x7F
    assert (t.scale.view(torch.uint8) == 0x7F).any()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        got = expand_triton(t.data[::2], t.scale[::2], 160, dtype)  # strided rows
        assert same_values(got, t.block_values()[::2].to(dtype))


@pytest.mark.parametrize("profile", PROFILES)
def test_given_outer_scale_matches_device_and_needs_no_read(profile):
    """Static / checkpoint / none recipes: the host decode scale (no device read) is the kernel's."""
    x = torch.randn(32, 64, device=DEV)
    for recipe in (
        QuantRecipe(profile=profile, scale_source="static", static_amax=7.25),
        QuantRecipe(profile=profile, scale_source="checkpoint", checkpoint_scale=0.0123),
        QuantRecipe(profile=profile, scale="none"),
    ):
        t = quantize(x, recipe, backend="triton")
        assert host_decode_scale(t) == float(t.global_scale)
        assert torch.equal(t.global_scale, quantize(x, recipe, backend="torch").global_scale)
