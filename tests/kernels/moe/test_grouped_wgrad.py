"""Grouped ragged-K NVFP4 GEMM (the MoE weight gradient) and its padded token layout (Triton kernels; under
the interpreter without CUDA). Operands are drawn on the CPU and moved to DEV."""

import pytest
import torch

from triage.kernels.moe.grouped_gemm import (
    grouped_wgrad,
    grouped_wgrad_reference,
    pad_segments,
    padded_segments,
)
from triage.kernels.moe.grouped_triton import launch_grouped_wgrad
from triage.kernels.nvfp4.api import quantize
from triage.kernels.nvfp4.matmul import gemm_reference
from triage.kernels.nvfp4.recipe import QuantRecipe

DEV = "cuda" if torch.cuda.is_available() else "cpu"

# padded segment lengths (multiples of 16; the interpreter's BLOCK_K is 32, so 16 and 48 end mid-tile and
# segments start off the BLOCK_K grid) and an unused tail after the last segment
SEGMENTS = {
    "uneven+empty-middle": ([16, 0, 48, 32], 32),
    "empty-first-and-last": ([0, 32, 16, 0], 16),
    "one-takes-all": ([0, 0, 80, 0], 0),
    "all-empty": ([0, 0, 0], 48),
}
H = QuantRecipe(hadamard=True)


def _offsets(lengths):
    o = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    o[1:] = torch.tensor(lengths).cumsum(0)
    return o.to(DEV)


def _operands(lengths, tail, m=24, n=40, seed=0, recipe=H):
    """A [m, L], B [n, L] quantized along L; random values everywhere (also in the tail, which no segment
    reads): a kernel that reads past a segment's bounds sees non-zero data."""
    gen = torch.Generator().manual_seed(seed)
    L = sum(lengths) + tail
    a = torch.randn(m, L, generator=gen) * torch.logspace(-2, 2, L)  # very different magnitudes along L
    a, b = a.to(DEV), torch.randn(n, L, generator=gen).to(DEV)
    return quantize(a, recipe, backend="torch"), quantize(b, recipe, backend="torch"), _offsets(lengths)


def _loop(a, b, offsets):
    """Independent twin: slices of the fp32 dequantized operands, one fp64 matmul per non-empty expert."""
    av, bv = a.dequantize(torch.float64), b.dequantize(torch.float64)
    o = offsets.tolist()
    out = torch.zeros(len(o) - 1, av.shape[0], bv.shape[0], dtype=torch.float64, device=av.device)
    for e in range(len(o) - 1):
        if o[e + 1] > o[e]:
            out[e] = av[:, o[e] : o[e + 1]] @ bv[:, o[e] : o[e + 1]].T
    return out


def _close(y, ref, tol=1e-5):
    scale = ref.abs().max().clamp_min(1e-30)
    assert ((y.double() - ref).abs().max() / scale) < tol


@pytest.mark.parametrize("backend", ["triton", "triton_expanded"])
@pytest.mark.parametrize("case", list(SEGMENTS))
def test_wgrad_matches_per_expert_loop(backend, case):
    lengths, tail = SEGMENTS[case]
    a, b, offs = _operands(lengths, tail)
    ref = _loop(a, b, offs)
    _close(grouped_wgrad_reference(a, b, offs), ref)
    y = grouped_wgrad(a, b, offs, backend=backend)
    assert y.shape == (len(lengths), 24, 40) and y.dtype == torch.float32
    _close(y, ref)
    for e, n_e in enumerate(lengths):
        if n_e == 0:  # an expert without tokens: exactly zero
            assert torch.equal(y[e], torch.zeros_like(y[e])), e
        else:
            assert y[e].abs().max() > 0, e
    yb = grouped_wgrad(a, b, offs, backend=backend, out_dtype=torch.bfloat16)  # one rounding of y
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.float(), y, rtol=2**-8, atol=0)


def test_wgrad_grouped_mm_backend_within_one_bf16_rounding():
    a, b, offs = _operands(*SEGMENTS["uneven+empty-middle"])
    ref = _loop(a, b, offs)
    y = grouped_wgrad(a, b, offs, backend="grouped_mm")
    assert torch.equal(y[1], torch.zeros_like(y[1]))
    torch.testing.assert_close(y.double(), ref, rtol=2**-7, atol=2**-7 * ref.abs().max().item())


@pytest.mark.parametrize("packed", [True, False])
def test_launcher_writes_every_element_of_a_poisoned_output(packed):
    """M, N not tile multiples (24 x 40 on 16 x 16 tiles), per-row outer scales on both operands."""
    row = QuantRecipe(hadamard=True, scale="row")
    a, b, offs = _operands([16, 0, 48, 32], 32, recipe=row)
    g_a, g_b = a.global_scale.reshape(-1), b.global_scale.reshape(-1)
    out = torch.full((4, 24, 40), float("nan"), device=DEV)
    if packed:
        args = (a.data, a.scale, b.data, b.scale)
    else:
        args = (a.block_values().to(torch.bfloat16), None, b.block_values().to(torch.bfloat16), None)
    launch_grouped_wgrad(*args, offs, out, g_a, g_b)
    assert not out.isnan().any()
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    _close(out, _loop(a, b, offs))


def test_nan_block_only_poisons_its_expert_row():
    """A NaN block scale (byte 0x7F) at the first 16 columns of expert 2's segment, which shares a BLOCK_K
    tile with the end of expert 0's (the masked neighbour must not read it): NaN in dW[2]'s row only, as
    the dense GEMM confines a NaN block to its row."""
    a, b, offs = _operands([16, 0, 48, 32], 32, recipe=QuantRecipe(profile="torchao"))
    scale = a.scale.view(torch.uint8).clone()
    scale[5, 1] = 0x7F  # row 5, columns 16..31 = the first block of expert 2 (columns 16..63)
    a.scale = scale.view(torch.float8_e4m3fn)
    ref = _loop(a, b, offs)
    assert ref[2, 5].isnan().all() and not ref[[0, 1, 3]].isnan().any()
    for backend in ("triton", "triton_expanded"):
        y = grouped_wgrad(a, b, offs, backend=backend)
        nan = y.isnan()
        assert nan[2, 5].all() and nan.sum() == 40, backend
        keep = ~ref.isnan()
        _close(y[keep], ref[keep])


def test_wgrad_checks_its_inputs():
    a, b, offs = _operands([16, 32], 0)
    with pytest.raises(ValueError, match="multiples of 16"):
        grouped_wgrad(a, b, torch.tensor([0, 8, 48], device=DEV))
    with pytest.raises(ValueError, match="past the token dim"):
        grouped_wgrad(a, b, torch.tensor([0, 16, 64], device=DEV))
    with pytest.raises(ValueError, match="decrease"):
        grouped_wgrad(a, b, torch.tensor([0, 32, 16], device=DEV))
    with pytest.raises(ValueError, match="Hadamard"):
        grouped_wgrad(a, quantize(torch.randn(40, 48, device=DEV)), offs)
    with pytest.raises(ValueError, match="token dims differ"):
        grouped_wgrad(a, quantize(torch.randn(40, 32, device=DEV), H), offs)


COUNTS = [5, 0, 17, 3, 0, 16, 1]  # not multiples of 16, empty first-in-the-middle and last, exact 16


def test_padded_segments_layout():
    offsets = _offsets(COUNTS)
    T, E = sum(COUNTS), len(COUNTS)
    padded, dest, length = padded_segments(offsets, T)
    starts, pos = [0], 0
    for c in COUNTS:
        pos += -(-c // 16) * 16
        starts.append(pos)
    assert padded.tolist() == starts
    assert length % 16 == 0 and length >= T + 15 * E and length >= starts[-1]
    expect = [starts[e] + i for e, c in enumerate(COUNTS) for i in range(c)]
    assert dest.tolist() == expect
    rows = torch.arange(1, T + 1, dtype=torch.float32, device=DEV)[:, None].repeat(1, 3)
    p = pad_segments(rows, dest, length)
    assert p.shape == (length, 3)
    assert torch.equal(p[dest], rows) and p.sum() == rows.sum()  # zeros everywhere else
    gather = torch.randperm(T, device=DEV)
    assert torch.equal(pad_segments(rows, dest, length, gather)[dest], rows[gather])


def test_padded_layout_blocks_equal_per_expert_quantization():
    """The claim behind the grouped wgrad: without an outer scale (scale="none"), quantizing the padded
    [C, L] layout once gives, on each expert's columns, the same bytes as quantizing that expert's rows
    alone (zero-padded to 16); and the grouped wgrad equals the old loop of dense per-expert GEMMs."""
    gen = torch.Generator().manual_seed(3)
    recipe = QuantRecipe(hadamard=True, pad=True, scale="none")
    offsets = _offsets(COUNTS)
    T = sum(COUNTS)
    dy, x = torch.randn(T, 24, generator=gen).to(DEV), torch.randn(T, 32, generator=gen).to(DEV)
    padded, dest, length = padded_segments(offsets, T)
    dyq = quantize(pad_segments(dy, dest, length).t().contiguous(), recipe)
    xq = quantize(pad_segments(x, dest, length).t().contiguous(), recipe)
    dw = grouped_wgrad(dyq, xq, padded, backend="triton")
    o, p = offsets.tolist(), padded.tolist()
    for e in range(len(COUNTS)):
        if o[e + 1] == o[e]:
            assert torch.equal(dw[e], torch.zeros_like(dw[e]))
            continue
        qe = quantize(dy[o[e] : o[e + 1]].t().contiguous(), recipe)
        xe = quantize(x[o[e] : o[e + 1]].t().contiguous(), recipe)
        assert torch.equal(qe.data, dyq.data[:, p[e] // 2 : p[e + 1] // 2])
        assert torch.equal(
            qe.scale.view(torch.uint8), dyq.scale.view(torch.uint8)[:, p[e] // 16 : p[e + 1] // 16]
        )
        _close(dw[e], gemm_reference(qe, xe, out_dtype=torch.float64))
