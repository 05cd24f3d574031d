"""Grouped NVFP4 GEMM (Triton kernel; under the interpreter without CUDA) against a loop of per-expert fp64
matmuls. Operands are drawn on the CPU (the same values everywhere) and moved to DEV: the Triton backends
need CUDA tensors unless the interpreter runs."""

import contextlib
import dataclasses

import pytest
import torch

from triage.kernels.moe import (
    check_offsets,
    dequantize64,
    grouped_gemm,
    grouped_gemm_reference,
    grouped_mm,
    offsets_from_expert_ids,
)
from triage.kernels.moe.experts import NVFP4MoEConfig, grouped_nvfp4_linear
from triage.kernels.nvfp4.api import quantize
from triage.kernels.nvfp4.matmul import gemm_reference
from triage.kernels.nvfp4.recipe import QuantRecipe

DEV = "cuda" if torch.cuda.is_available() else "cpu"

COUNTS = {
    "uneven+empty": [5, 0, 17, 3],
    "one-takes-all": [0, 0, 25, 0],
    "all-empty-but-last": [0, 0, 0, 9],
    "tile-multiples": [16, 32, 0, 16],
}


def _offsets(counts):
    o = torch.zeros(len(counts) + 1, dtype=torch.int64)
    o[1:] = torch.tensor(counts).cumsum(0)
    return o.to(DEV)


def _on(values):
    """``torch.tensor(values)`` on DEV (offsets, gather rows)."""
    return torch.tensor(values, device=DEV)


ACT, WREC = QuantRecipe(), QuantRecipe(scale="expert")


def _operands(counts, n=24, k=48, seed=0, act=ACT, wrec=WREC, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(counts)
    x = (torch.randn(t, k, generator=gen) * scale).to(DEV, torch.bfloat16)
    w = torch.randn(len(counts), n, k, generator=gen).to(DEV, torch.bfloat16)
    w[1] *= 1e-3  # experts with very different outer scales
    return quantize(x, act, backend="torch"), quantize(w, wrec, backend="torch"), _offsets(counts)


@pytest.mark.parametrize("backend", ["triton", "triton_expanded"])
@pytest.mark.parametrize("case", list(COUNTS))
def test_matches_per_expert_loop(backend, case):
    a, w, offs = _operands(COUNTS[case])
    ref = grouped_gemm_reference(a, w, offs, out_dtype=torch.float32)
    y = grouped_gemm(a, w, offs, out_dtype=torch.float32, backend=backend)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    yb = grouped_gemm(a, w, offs, backend=backend)  # bf16: one rounding of the same fp32 value
    # (the interpreter truncates fp32 -> bf16 where the GPU rounds: allow one bf16 ulp)
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.float(), y, rtol=2**-7, atol=0)


@pytest.mark.parametrize(
    "act,wrec",
    [
        (QuantRecipe(scale="row"), QuantRecipe(scale="row")),
        (QuantRecipe(), QuantRecipe(block="16x16", scale="expert")),
        (QuantRecipe(), QuantRecipe(scale="tensor")),
    ],
)
def test_outer_scale_layouts(act, wrec):
    a, w, offs = _operands(COUNTS["uneven+empty"], act=act, wrec=wrec, seed=1)
    ref = grouped_gemm_reference(a, w, offs, out_dtype=torch.float32)
    y = grouped_gemm(a, w, offs, out_dtype=torch.float32, backend="triton")
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_reference_is_a_loop_of_dequantized_matmuls():
    a, w, offs = _operands([3, 0, 4], seed=2)
    ref = grouped_gemm_reference(a, w, offs, out_dtype=torch.float32)
    xa, wv = dequantize64(a), dequantize64(w)
    expect = torch.cat([xa[:3] @ wv[0].T, xa[3:] @ wv[2].T]).float()
    torch.testing.assert_close(ref, expect, rtol=0, atol=0)
    torch.testing.assert_close(dequantize64(w).float(), w.dequantize(torch.float32), rtol=1e-6, atol=0)


def test_grouped_mm_backend_within_one_bf16_rounding():
    a, w, offs = _operands(COUNTS["uneven+empty"], seed=3)
    ref = grouped_gemm_reference(a, w, offs, out_dtype=torch.float32)
    y = grouped_gemm(a, w, offs, out_dtype=torch.float32, backend="grouped_mm")
    torch.testing.assert_close(y, ref, rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("scale", [0.0, 1e-30, 3e4])
def test_zero_subnormal_and_huge_activations(scale):
    a, w, offs = _operands([4, 7, 0, 6], seed=4, scale=scale, k=32)
    ref = grouped_gemm_reference(a, w, offs, out_dtype=torch.float32)
    y = grouped_gemm(a, w, offs, out_dtype=torch.float32, backend="triton")
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    if scale == 0.0:
        assert (y == 0).all()


def test_odd_n_and_k_not_multiple_of_tile():
    a, w, offs = _operands([1, 2, 3], n=5, k=80, seed=5)
    ref = grouped_gemm_reference(a, w, offs, out_dtype=torch.float32)
    y = grouped_gemm(a, w, offs, out_dtype=torch.float32, backend="triton")
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_grouped_mm_helper_both_forms_with_empty_experts():
    gen = torch.Generator().manual_seed(6)
    offs = _offsets([3, 0, 5, 0])
    a = torch.randn(8, 12, generator=gen).to(DEV)
    b = torch.randn(4, 7, 12, generator=gen).to(DEV)
    y = grouped_mm(a, b, offs)
    torch.testing.assert_close(y, torch.cat([a[:3] @ b[0].T, a[3:] @ b[2].T]))
    y2 = grouped_mm(a, b.transpose(1, 2).contiguous(), offs, trans_b=True)
    torch.testing.assert_close(y2, y)
    dy = torch.randn(8, 7, generator=gen).to(DEV)
    dw = grouped_mm(dy.t(), a, offs)
    assert dw.shape == (4, 7, 12)
    torch.testing.assert_close(dw[0], dy[:3].T @ a[:3])
    torch.testing.assert_close(dw[2], dy[3:].T @ a[3:])
    assert (dw[1] == 0).all() and (dw[3] == 0).all()


def test_offsets_from_expert_ids_sorts_and_counts():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]])
    order, offs = offsets_from_expert_ids(ids, 5)
    assert offs.tolist() == [0, 2, 2, 5, 6, 6]
    assert ids.reshape(-1)[order].tolist() == [0, 0, 2, 2, 2, 3]


@pytest.mark.parametrize("bad", [-1, 4, 99])
def test_expert_id_out_of_range_names_position(bad):
    ids = torch.tensor([[2, 0], [1, 3], [0, 2]])
    ids[2, 1] = bad
    with pytest.raises(ValueError, match=rf"expert_ids\[2, 1\] = {bad} is outside \[0, 4\)"):
        offsets_from_expert_ids(ids, 4)


def test_bad_offsets_are_rejected():
    a, w, _ = _operands([2, 2, 2, 2])
    with pytest.raises(ValueError, match="does not match the token count 8"):
        grouped_gemm(a, w, _offsets([2, 2, 2, 1]), backend="triton")
    with pytest.raises(ValueError, match="decrease at expert 1"):
        grouped_gemm(a, w, _on([0, 5, 4, 6, 8]), backend="triton")
    with pytest.raises(ValueError, match="expected num_experts \\+ 1 = 5"):
        grouped_gemm(a, w, _on([0, 4, 8]), backend="triton")
    with pytest.raises(ValueError, match="offsets\\[0\\] = 1"):
        check_offsets(_on([1, 2, 4, 6, 8]), 8, 4)
    with pytest.raises(TypeError, match="integer"):
        check_offsets(_on([0.0, 8.0]), 8, 1)
    a2, _, _ = _operands([2, 2, 2, 2], k=32)
    with pytest.raises(ValueError, match="reduction dims differ"):
        grouped_gemm(a2, w, _offsets([2, 2, 2, 2]))


@pytest.mark.parametrize("mode", ["dequantized", "bf16-backward"])
def test_grouped_linear_gradients(mode):
    """Straight-through gradients: dx = dy·Ŵ[e] (scattered back to tokens), dW[e] = dy[e]ᵀ·x̂[e]."""
    gen = torch.Generator().manual_seed(7)
    tokens, e, n, k = 6, 3, 8, 32
    x = torch.randn(tokens, k, generator=gen).to(DEV).requires_grad_(True)
    w = torch.randn(e, n, k, generator=gen).to(DEV).requires_grad_(True)
    gather = _on([0, 3, 1, 1, 5, 2, 4, 0, 2])  # routed rows, sorted by expert
    offs = _offsets([4, 0, 5])
    cfg = NVFP4MoEConfig(backward=mode, gemm_backend="triton")
    y = grouped_nvfp4_linear(x, w, offs, cfg, gather)
    dy = torch.randn(y.shape, generator=gen).to(DEV)
    y.backward(dy)
    if mode == "dequantized":
        xs = quantize(x.detach(), cfg.activation, backend="torch").dequantize(torch.float64)
        ws = quantize(w.detach(), cfg.weight, backend="torch").dequantize(torch.float64)
    else:
        xs, ws = x.detach().double(), w.detach().double()
    seg = [(0, 4, 0), (4, 9, 2)]
    dx = torch.zeros(tokens, k, dtype=torch.float64, device=DEV)
    dw = torch.zeros(e, n, k, dtype=torch.float64, device=DEV)
    for lo, hi, ex in seg:
        dx.index_add_(0, gather[lo:hi], dy[lo:hi].double() @ ws[ex])
        dw[ex] = dy[lo:hi].double().T @ xs[gather[lo:hi]]
    torch.testing.assert_close(x.grad.double(), dx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), dw, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["triton", "triton_expanded", "grouped_mm", "reference"])
@pytest.mark.parametrize("act", [QuantRecipe(), QuantRecipe(scale="row")], ids=["tensor", "row"])
def test_in_kernel_gather_equals_gathering_first(backend, act):
    """``a_rows``: tokens quantized once (with their expansion), the top-k gather done inside the GEMM."""
    gen = torch.Generator().manual_seed(11)
    counts = COUNTS["uneven+empty"]
    tokens = 13
    x = (torch.randn(tokens, 48, generator=gen) * 2).to(DEV, torch.bfloat16)
    rows = torch.randint(0, tokens, (sum(counts),), generator=gen).to(DEV)
    a_tok = quantize(x, act, backend="torch", emit_expanded=torch.bfloat16)
    _, w, offs = _operands(counts, seed=2)
    # gathering the quantized rows == quantizing per tensor/row then gathering (same bytes and scales)
    ref = grouped_gemm_reference(
        quantize(x, act, backend="torch").__class__(
            data=a_tok.data[rows], scale=a_tok.scale[rows],
            global_scale=a_tok.global_scale[rows] if act.scale == "row" else a_tok.global_scale,
            recipe=act, shape=torch.Size((rows.numel(), 48)), dtype=torch.bfloat16,
        ),
        w, offs, out_dtype=torch.float32,
    )  # fmt: skip
    y = grouped_gemm(a_tok, w, offs, out_dtype=torch.float32, backend=backend, a_rows=rows)
    tol = 1e-2 if backend == "grouped_mm" else 1e-5
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_bad_gather_rows_are_rejected():
    a, w, offs = _operands(COUNTS["uneven+empty"])
    with pytest.raises(ValueError, match="outside"):
        grouped_gemm(a, w, offs, a_rows=torch.full((25,), 99, device=DEV))
    with pytest.raises(ValueError, match="1-D integer"):
        grouped_gemm(a, w, offs, a_rows=torch.zeros(25, device=DEV))


def test_hadamard_on_one_operand_is_rejected():
    a, w, offs = _operands([3, 2, 4, 1], k=32)
    a_h = quantize(torch.randn(10, 32).to(DEV), QuantRecipe(hadamard=True), backend="torch")
    with pytest.raises(ValueError, match="exactly one operand went through the Hadamard transform"):
        grouped_gemm(a_h, w, offs, backend="reference")
    with pytest.raises(ValueError, match="exactly one operand went through the Hadamard transform"):
        grouped_gemm(a_h, w, offs, backend="triton")


def test_padded_hadamard_reference_keeps_the_rotated_padding():
    """K=20 padded to 32 and rotated: the padding columns are not zero, the product contracts over all 32
    (as the dense reference and the kernel do)."""
    gen = torch.Generator().manual_seed(12)
    x, w = torch.randn(9, 20, generator=gen).to(DEV), torch.randn(2, 8, 20, generator=gen).to(DEV)
    a = quantize(x, QuantRecipe(pad=True, hadamard=True), backend="torch")
    wq = quantize(w, QuantRecipe(pad=True, hadamard=True, scale="expert"), backend="torch")
    offs = _offsets([4, 5])
    ref = grouped_gemm_reference(a, wq, offs, out_dtype=torch.float32)
    rows = [(0, 4), (4, 9)]
    dense = torch.cat(
        [gemm_reference(a, _expert(wq, e), out_dtype=torch.float32)[lo:hi] for e, (lo, hi) in enumerate(rows)]
    )
    torch.testing.assert_close(ref, dense, rtol=1e-6, atol=1e-6 * dense.abs().max().item())
    y = grouped_gemm(a, wq, offs, out_dtype=torch.float32, backend="triton")
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def _expert(w, e):
    """Expert e of NVFP4 expert weights as a dense [N, K] operand (its outer scale as a per-tensor one)."""
    return w.__class__(
        data=w.data[e], scale=w.scale[e], global_scale=w.global_scale[e].reshape(()),
        recipe=dataclasses.replace(w.recipe, scale="tensor"),
        shape=torch.Size(tuple(w.shape)[1:]), dtype=w.dtype,
    )  # fmt: skip


def test_grouped_linear_validates_offsets_and_gather():
    x, w = torch.randn(6, 32, device=DEV), torch.randn(4, 16, 32, device=DEV)
    cfg = NVFP4MoEConfig(gemm_backend="reference")
    with pytest.raises(ValueError, match="does not match the token count 6"):
        grouped_nvfp4_linear(x, w, _on([0, 2, 3, 4, 4]), cfg)  # rows 4, 5 belong to no expert
    with pytest.raises(ValueError, match="expected num_experts \\+ 1 = 5"):
        grouped_nvfp4_linear(x, w, _on([0, 3, 6]), cfg)
    with pytest.raises(ValueError, match="does not match the token count 3"):
        grouped_nvfp4_linear(x, w, _offsets([2, 2, 2, 0]), cfg, _on([0, 5, 1]))
    with pytest.raises(ValueError, match="gather has entries outside \\[0, 6\\)"):
        grouped_nvfp4_linear(x, w, _offsets([1, 1, 0, 1]), cfg, _on([0, 6, 1]))
    with pytest.raises(TypeError, match="gather must be a 1-D integer tensor"):
        grouped_nvfp4_linear(x, w, _offsets([1, 1, 0, 1]), cfg, _on([0.0, 2.0, 1.0]))
    y = grouped_nvfp4_linear(x, w, _offsets([1, 1, 0, 1]), cfg, _on([0, 5, 1]))
    assert y.shape == (3, 16)


def test_float_expert_ids_are_a_dtype_error():
    with pytest.raises(TypeError, match="expert_ids must be an integer tensor, got torch.float32"):
        offsets_from_expert_ids(torch.tensor([[0.0, 1.0]]), 2)


_TMA_TEST_TILES = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=1)


@pytest.mark.parametrize("case", [*COUNTS, "one-expert"])
@pytest.mark.parametrize(
    "gather,k,ga",  # K a multiple of BLOCK_K, and not (TMA's zeros past K); g_a per row, one, none
    [(False, 64, "row"), (True, 48, "row"), (True, 64, "one"), (False, 48, "none")],
)
def test_tma_kernel_gives_the_pointer_kernels_bits(case, gather, k, ga):
    """The persistent kernel with the expert weights read through TMA (``TMA=True``) returns the pointer
    kernel's bits with the same tiles: N = 24 is not a multiple of BLOCK_N, so a weight tile runs into the
    next expert's rows (the last expert's into TMA's zeros); operands are views of wider buffers holding NaN
    past K (nothing past K may be read); per-row and per-expert outer scales, with and without the gather."""
    from triage.kernels.moe.grouped_triton import launch_grouped_gemm

    counts = COUNTS.get(case, [21])
    gen = torch.Generator().manual_seed(sum(counts) + k)
    E, n, T = len(counts), 24, sum(counts)
    rows = torch.randint(0, 7, (T,), generator=gen).to(DEV) if gather else None
    wide_a = torch.full((7 if gather else T, k + 16), float("nan"), dtype=torch.float16)
    wide_a[:, :k] = torch.randn(wide_a.shape[0], k, generator=gen).half()
    wide_b = torch.full((E, n, k + 16), float("nan"), dtype=torch.float16)
    wide_b[..., :k] = torch.randn(E, n, k, generator=gen).half()
    a, b = wide_a.to(DEV)[:, :k], wide_b.to(DEV)[..., :k]
    g_a = {"row": (torch.rand(a.shape[0], generator=gen) + 0.5).to(DEV),
           "one": torch.full((1,), 0.75, device=DEV), "none": None}[ga]  # fmt: skip
    offs = _offsets(counts)
    for g_b in ((torch.rand(E, generator=gen) + 0.5).to(DEV), (torch.rand(E, n, generator=gen) + 0.5).to(DEV)):
        want = torch.full((T, n), -7.0, device=DEV)
        got = want.clone()
        launch_grouped_gemm(a, None, b, None, k, offs, want, g_a, g_b, rows=rows, config=_TMA_TEST_TILES)
        with _counting_tma_launches() as launches:
            launch_grouped_gemm(a, None, b, None, k, offs, got, g_a, g_b, rows=rows, config=dict(_TMA_TEST_TILES, TMA=True))
        assert len(launches) == 1 and torch.equal(got, want) and want.isfinite().all()
        ea = torch.repeat_interleave(torch.arange(E, device=DEV), offs.diff(), output_size=T)
        src = a[rows] if gather else a
        ref = torch.einsum("tk,tnk->tn", src.double(), b.double()[ea])
        if ga == "row":
            ref = ref * (g_a[rows] if gather else g_a).double()[:, None]
        elif ga == "one":
            ref = ref * 0.75
        ref = ref * (g_b.double()[ea][:, None] if g_b.dim() == 1 else g_b.double()[ea])
        torch.testing.assert_close(want.double(), ref, rtol=1e-5, atol=1e-5)


def test_tma_kernel_is_skipped_for_weights_whose_experts_are_not_evenly_strided():
    """A weight whose experts' rows are not one evenly strided [E·N, K] block (a transposed view, as dgrad
    passes) keeps the pointer kernel under ``TMA=True``: the same result as without it."""
    from triage.kernels.moe.grouped_triton import launch_grouped_gemm

    gen = torch.Generator().manual_seed(3)
    counts = COUNTS["uneven+empty"]
    E, n, k, T = len(counts), 32, 32, sum(counts)
    a = torch.randn(T, k, generator=gen).half().to(DEV)
    b = torch.randn(E, k, n, generator=gen).half().to(DEV).transpose(1, 2)  # [E, n, k], unit stride along n
    g_a, g_b = torch.ones(1, device=DEV), torch.ones(E, device=DEV)
    offs = _offsets(counts)
    want, got = torch.zeros(T, n, device=DEV), torch.zeros(T, n, device=DEV)
    launch_grouped_gemm(a, None, b, None, k, offs, want, g_a, g_b, config=_TMA_TEST_TILES)
    with _counting_tma_launches() as launches:
        launch_grouped_gemm(a, None, b, None, k, offs, got, g_a, g_b, config=dict(_TMA_TEST_TILES, TMA=True))
    assert launches == [] and torch.equal(got, want)


@contextlib.contextmanager
def _counting_tma_launches():
    """The grids of the TMA kernel's launches while the block runs."""
    from triage.kernels.moe import grouped_triton

    real, grids = grouped_triton._grouped_tma_kernel, []

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return real[grid]

    grouped_triton._grouped_tma_kernel = Spy()
    try:
        yield grids
    finally:
        grouped_triton._grouped_tma_kernel = real


def test_tma_kernel_is_skipped_for_packed_operands():
    """Packed NVFP4 operands (unpacked in registers) keep the pointer kernel under ``TMA=True``."""
    from triage.kernels.moe.grouped_triton import launch_grouped_gemm

    a, w, offs = _operands(COUNTS["uneven+empty"])
    T, K = a.shape
    E, N = w.shape[0], w.shape[1]
    g_w = w.global_scale.reshape(E).float()
    args = (a.data.reshape(T, K // 2), a.scale.reshape(T, K // 16), w.data, w.scale, K, offs)
    want, got = torch.zeros(T, N, device=DEV), torch.zeros(T, N, device=DEV)
    launch_grouped_gemm(*args, want, a.global_scale.reshape(1).float(), g_w, config=_TMA_TEST_TILES)
    with _counting_tma_launches() as launches:
        launch_grouped_gemm(*args, got, a.global_scale.reshape(1).float(), g_w, config=dict(_TMA_TEST_TILES, TMA=True))
    assert launches == [] and torch.equal(got, want) and want.abs().sum() > 0
