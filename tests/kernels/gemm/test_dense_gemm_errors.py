"""Bad input to the GEMMs: clear errors naming the operand."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _dense_operands import device, random_nvfp4

from triage.kernels.nvfp4.matmul import gemm, gemm_w4a16


def test_public_names_resolve():
    """``triage.kernels.nvfp4.gemm`` is the GEMM function (no module shadows it), and every exported name of
    ``triage.kernels``, ``triage.kernels.nvfp4`` and ``triage.kernels.moe`` resolves."""
    import triage.kernels
    from triage.kernels import moe, nvfp4

    assert nvfp4.gemm is gemm and nvfp4.gemm_w4a16 is gemm_w4a16 and callable(nvfp4.expand)
    assert "grouped_gemm" in moe.__all__ and "LARGE_BACKEND" not in moe.__all__  # read on grouped_gemm
    for package in (triage.kernels, nvfp4, moe):
        for name in package.__all__:
            assert getattr(package, name) is not None, f"{package.__name__}.{name}"


@pytest.fixture
def ab():
    gen = torch.Generator().manual_seed(0)
    return random_nvfp4((4, 32), gen=gen), random_nvfp4((6, 32), gen=gen)


def test_k_mismatch(ab):
    a, _ = ab
    b = random_nvfp4((6, 48), gen=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="K=32.*K=48"):
        gemm(a, b)


def test_k_not_multiple_of_16_unpadded(ab):
    a, b = ab
    bad = dataclasses.replace(a, shape=torch.Size((4, 30)))
    with pytest.raises(ValueError, match="K=30 is not a multiple of 16"):
        gemm(bad, b)


def test_bad_data_and_scale_shapes(ab):
    a, b = ab
    with pytest.raises(ValueError, match=r"a\.data must be uint8"):
        gemm(dataclasses.replace(a, data=a.data[:, :8]), b)
    with pytest.raises(ValueError, match=r"b\.scale must be float8_e4m3fn"):
        gemm(a, dataclasses.replace(b, scale=b.scale.float()))


def test_not_an_nvfp4_tensor(ab):
    a, _ = ab
    with pytest.raises(TypeError, match="b must be an NVFP4Tensor"):
        gemm(a, torch.zeros(6, 32))


def test_weight_must_be_2d(ab):
    a, _ = ab
    b3 = random_nvfp4((2, 6, 32), gen=torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match="must be 2-D"):
        gemm(a, b3)


def test_hadamard_on_one_side_only(ab):
    a, b = ab
    bh = dataclasses.replace(b, recipe=dataclasses.replace(b.recipe, hadamard=True))
    with pytest.raises(ValueError, match="Hadamard"):
        gemm(a, bh)
    x = torch.zeros(4, 32, dtype=torch.bfloat16, device=device())
    with pytest.raises(ValueError, match="Hadamard"):
        gemm_w4a16(x, bh)


def test_wrong_device(ab):
    a, b = ab
    b_meta = dataclasses.replace(b, data=b.data.to("meta"), scale=b.scale.to("meta"))
    with pytest.raises(ValueError, match="a is on .* but b is on meta"):
        gemm(a, b_meta)
    with pytest.raises(ValueError, match="bias is on meta"):
        gemm(a, b, bias=torch.zeros(6, device="meta"))


def test_outer_scale_shapes(ab):
    a, b = ab
    with pytest.raises(ValueError, match=r"a\.global_scale has shape \(3,\)"):
        gemm(dataclasses.replace(a, global_scale=torch.ones(3, device=device())), b)
    expert = dataclasses.replace(b, recipe=dataclasses.replace(b.recipe, scale="expert"))
    with pytest.raises(ValueError, match="per-expert"):
        gemm(a, expert)


def test_bias_out_and_dtype_checks(ab):
    a, b = ab
    with pytest.raises(ValueError, match=r"bias must have shape \(6,\)"):
        gemm(a, b, bias=torch.zeros(5, device=device()))
    with pytest.raises(ValueError, match="out_dtype"):
        gemm(a, b, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="out must be"):
        gemm(a, b, out=torch.empty(4, 5, device=device()), backend="reference")
    with pytest.raises(ValueError, match="backend"):
        gemm(a, b, backend="cutlass")


def test_w4a16_input_checks(ab):
    _, w = ab
    with pytest.raises(ValueError, match=r"x must be a tensor \[\.\.\., 32\]"):
        gemm_w4a16(torch.zeros(3, 16, dtype=torch.bfloat16, device=device()), w)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        gemm_w4a16(torch.zeros(3, 32, device=device()), w)


def test_unpack_mult_counts_packed_flags_and_refuses_anything_else():
    from triage.kernels.nvfp4.device import UNPACK_FACTOR, unpack_mult

    assert unpack_mult(True, False) == UNPACK_FACTOR and unpack_mult(True, True) == UNPACK_FACTOR**2
    assert unpack_mult(False, False) == 1.0
    with pytest.raises(TypeError, match="one bool per operand"):  # a scale tensor, not a flag
        unpack_mult(torch.zeros(1), None)
