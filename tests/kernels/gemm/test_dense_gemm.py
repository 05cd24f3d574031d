"""W4A4 / W4A16 GEMMs against the torch reference (dequantize, fp64 matmul), under TRITON_INTERPRET on CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _dense_operands import device, random_nvfp4, rel_err

from triage.kernels.nvfp4 import gemm_dense
from triage.kernels.nvfp4.matmul import (
    _dequantize64,
    expand,
    gemm,
    gemm_reference,
    gemm_w4a16,
    gemm_w4a16_reference,
)

FP32_TOL = 2e-6  # fp32 accumulation of ≤ 100 exact products, normalised by max |y|

SHAPES = [(1, 16, 16), (5, 33, 48), (37, 19, 80), (70, 40, 96)]  # M, N, K: none a tile multiple


def _poisoned(M, N, dtype):
    return torch.full((M, N), float("nan"), dtype=dtype, device=device())


@pytest.mark.parametrize("backend", ["triton", "cublas"])
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_w4a4_matches_reference(backend, M, N, K):
    gen = torch.Generator().manual_seed(M * 1000 + N + K)
    a = random_nvfp4((M, K), gen=gen, zero_block_frac=0.1)
    b = random_nvfp4((N, K), gen=gen)
    ref = gemm_reference(a, b, out_dtype=torch.float64)
    out = _poisoned(M, N, torch.float32)
    y = gemm(a, b, out_dtype=torch.float32, backend=backend, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert not torch.isnan(y).any(), "unwritten (poisoned) output elements"
    assert rel_err(y, ref) < FP32_TOL


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_w4a4_low_precision_out_is_one_rounding(out_dtype):
    gen = torch.Generator().manual_seed(1)
    a = random_nvfp4((21, 64), gen=gen, scale="row", scale_exp=(-3, 3))
    b = random_nvfp4((24, 64), gen=gen, scale="row", scale_exp=(-3, 3))
    bias = torch.randn(24, generator=gen).to(device())
    ref = gemm_reference(a, b, out_dtype=torch.float64, bias=bias)
    # |terms| bound: the fp32 accumulation error is at most ~K·2⁻²⁴ of Σ|products|
    terms = _dequantize64(a).abs() @ _dequantize64(b).abs().T + bias.double().abs()
    half_ulp = torch.finfo(out_dtype).eps / 2
    for backend in ("triton", "cublas"):
        y = gemm(a, b, out_dtype=out_dtype, bias=bias, backend=backend, out=_poisoned(21, 24, out_dtype))
        # a single final rounding: within half an ulp of the exact value, plus the fp32 accumulation slack
        bound = half_ulp * ref.abs() * (1 + 1e-3) + 64 * 2.0**-24 * terms
        assert bool(((y.double() - ref).abs() <= bound).all()), backend


def test_per_row_scales_bias_and_batched_a():
    gen = torch.Generator().manual_seed(2)
    a = random_nvfp4((3, 7, 32), gen=gen, scale="row")
    b = random_nvfp4((18, 32), gen=gen, scale="row")
    bias = torch.randn(18, generator=gen, dtype=torch.float32).to(device())
    ref = gemm_reference(a, b, out_dtype=torch.float64, bias=bias)
    for backend in ("triton", "cublas"):
        y = gemm(a, b, out_dtype=torch.float32, bias=bias, backend=backend)
        assert y.shape == (3, 7, 18)
        assert rel_err(y, ref) < FP32_TOL, backend


@pytest.mark.parametrize("split_k", [2, 3])
def test_split_k_decode_path_is_exact_and_writes_everything(split_k):
    gen = torch.Generator().manual_seed(3)
    M, N, K = 3, 37, 160
    a = random_nvfp4((M, K), gen=gen, scale="row")
    b = random_nvfp4((N, K), gen=gen)
    bias = torch.randn(N, generator=gen).to(device())

    def launch(out):
        gemm_dense.launch_gemm(
            a.data, a.scale, b.data, b.scale, K, out, a.global_scale.reshape(-1), b.global_scale.reshape(1), bias,
            split_k=split_k,
        )  # fmt: skip
        return out

    out = launch(_poisoned(M, N, torch.float32))
    assert not torch.isnan(out).any()
    ref = gemm_reference(a, b, out_dtype=torch.float64, bias=bias)
    assert rel_err(out, ref) < FP32_TOL
    # deterministic: same bits twice
    assert torch.equal(out, launch(torch.empty_like(out)))


def test_adversarial_scales_huge_subnormal_zero():
    gen = torch.Generator().manual_seed(4)
    K = 48
    a = random_nvfp4((19, K), gen=gen, scale_exp=(-9, -6), zero_block_frac=0.3)  # subnormal e4m3 scales
    b = random_nvfp4((17, K), gen=gen, scale_exp=(7, 9))  # up to 448
    b.data.fill_(0x77)  # every element +6: products up to 6·448
    ref = gemm_reference(a, b, out_dtype=torch.float64)
    for backend in ("triton", "cublas"):
        y = gemm(a, b, out_dtype=torch.float32, backend=backend)
        assert rel_err(y, ref) < FP32_TOL, backend
    # an all-zero operand gives exact zeros
    z = dataclasses.replace(a, scale=torch.zeros_like(a.scale))
    for backend in ("triton", "cublas"):
        assert torch.equal(
            gemm(z, b, out_dtype=torch.float32, backend=backend), torch.zeros(19, 17, device=device())
        )


def test_nan_scale_and_inf_outer_scale_propagate_like_the_reference():
    gen = torch.Generator().manual_seed(5)
    a = random_nvfp4((9, 32), gen=gen, scale="row")
    b = random_nvfp4((11, 32), gen=gen)
    sc = a.scale.view(torch.uint8).clone()
    sc[2, 1] = 0x7F  # e4m3 NaN
    a = dataclasses.replace(a, scale=sc.view(torch.float8_e4m3fn))
    a.global_scale[5, 0] = float("inf")
    ref = gemm_reference(a, b, out_dtype=torch.float64)
    for backend in ("triton", "cublas"):
        y = gemm(a, b, out_dtype=torch.float32, backend=backend).double()
        finite = torch.isfinite(ref)
        # NaN block scale: NaN row, like the reference; Inf outer scale: non-finite row (the reference
        # gets NaN from 0·Inf in the dequantized operand, the kernel ±Inf from acc·Inf)
        assert torch.equal(torch.isnan(y[2]), torch.isnan(ref[2])), backend
        assert torch.equal(torch.isfinite(y), finite), backend
        assert torch.isnan(y[2]).all() and finite[[0, 1, 3, 4, 6, 7, 8]].all()
        assert rel_err(y[finite], ref[finite]) < FP32_TOL


def test_non_contiguous_operands():
    gen = torch.Generator().manual_seed(6)
    a = random_nvfp4((12, 64), gen=gen)
    b = random_nvfp4((10, 64), gen=gen)
    # a's rows taken with a stride: every other row of a bigger tensor
    big = random_nvfp4((24, 64), gen=gen)
    a2 = dataclasses.replace(a, data=big.data[::2], scale=big.scale[::2])
    assert not a2.data.is_contiguous()
    ref = gemm_reference(a2, b, out_dtype=torch.float64)
    y = gemm(a2, b, out_dtype=torch.float32, backend="triton")
    assert rel_err(y, ref) < FP32_TOL
    x = torch.randn(32, 12, generator=gen).to(torch.bfloat16).to(device()).T  # [12, 32] non-contiguous
    w = random_nvfp4((20, 32), gen=gen)
    assert (
        rel_err(
            gemm_w4a16(x, w, out_dtype=torch.float32, backend="triton"),
            gemm_w4a16_reference(x, w, out_dtype=torch.float64),
        )
        < FP32_TOL
    )


def test_padded_k_operands():
    gen = torch.Generator().manual_seed(7)
    a = random_nvfp4((6, 40), gen=gen, pad=True)
    b = random_nvfp4((9, 40), gen=gen, pad=True)
    ref = gemm_reference(a, b, out_dtype=torch.float64)
    for backend in ("triton", "cublas"):
        assert rel_err(gemm(a, b, out_dtype=torch.float32, backend=backend), ref) < FP32_TOL
    x = torch.randn(5, 40, generator=gen).to(torch.bfloat16).to(device())
    ref = gemm_w4a16_reference(x, b, out_dtype=torch.float64)
    for backend in ("triton", "cublas"):
        assert rel_err(gemm_w4a16(x, b, out_dtype=torch.float32, backend=backend), ref) < FP32_TOL


@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,N,K", [(1, 24, 32), (16, 33, 64), (67, 18, 48)])
def test_w4a16_matches_reference(xdtype, M, N, K):
    gen = torch.Generator().manual_seed(M + N + K)
    x = (torch.randn(M, K, generator=gen) * 3).to(xdtype).to(device())
    w = random_nvfp4((N, K), gen=gen, scale="row", zero_block_frac=0.1)
    bias = torch.randn(N, generator=gen).to(xdtype).to(device())
    ref = gemm_w4a16_reference(x, w, out_dtype=torch.float64, bias=bias)
    for backend in ("triton", "cublas"):
        y = gemm_w4a16(
            x, w, out_dtype=torch.float32, bias=bias, backend=backend, out=_poisoned(M, N, torch.float32)
        )
        assert rel_err(y, ref) < FP32_TOL, backend
    assert gemm_w4a16(x, w, bias=bias, backend="triton").dtype == xdtype


def test_expand_is_exact_in_bf16_and_fp16():
    gen = torch.Generator().manual_seed(8)
    t = random_nvfp4((13, 48), gen=gen, zero_block_frac=0.2)
    exact = t.block_values()
    for dtype in (torch.bfloat16, torch.float16):
        e = expand(t, dtype)
        assert e.dtype == dtype and torch.equal(e.float(), exact)


def test_auto_on_cpu_without_interpreter_uses_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if torch.cuda.is_available():
        pytest.skip("CPU-only dispatch rule")
    gen = torch.Generator().manual_seed(9)
    a, b = random_nvfp4((4, 16), gen=gen), random_nvfp4((5, 16), gen=gen)
    assert torch.equal(gemm(a, b), gemm_reference(a, b))
    with pytest.raises(ValueError, match="needs a CUDA tensor"):
        gemm(a, b, backend="triton")


def test_mid_m_rows_take_mid_tiles_split_to_fill_the_gpu(monkeypatch):
    """On the GPU: ≤ 64 rows the decode-sized tiles, then each of MID_CONFIGS up to its rows with K split
    (doubling) while the programs fill less than one wave and each split keeps MID_MIN_SPLIT_K of K, above
    the last DENSE_CONFIG."""
    monkeypatch.setattr(gemm_dense, "interpreting", lambda: False)
    monkeypatch.setattr(gemm_dense, "num_sms", lambda: 132)
    monkeypatch.setattr(gemm_dense, "tma_supported", lambda: True)  # packed operands never take TMA tiles
    (small_m, small), (mid_m, mid) = gemm_dense.MID_CONFIGS
    assert gemm_dense._tile_config(64, 1024, 2560, None)["BLOCK_M"] == 64
    assert gemm_dense._tile_config(128, 1024, 2560, None) == dict(small, SPLIT_K=4)  # 2 × 8 tiles; 2560 / 8 < 512
    assert gemm_dense._tile_config(small_m, 1024, 2560, None)["BLOCK_M"] == small["BLOCK_M"]
    assert gemm_dense._tile_config(small_m + 1, 2560, 9728, None) == dict(mid, SPLIT_K=4)  # 3 × 20 tiles; 120 < 132
    assert gemm_dense._tile_config(512, 2560, 9728, None) == dict(mid, SPLIT_K=2)  # 4 × 20 = 80 tiles
    assert gemm_dense._tile_config(1024, 2560, 9728, None) == dict(mid, SPLIT_K=1)  # 160 tiles
    assert gemm_dense._tile_config(512, 2560, 9728, 3)["SPLIT_K"] == 3  # an explicit split stands
    assert gemm_dense._tile_config(mid_m, 1024, 2560, None)["BLOCK_M"] == mid["BLOCK_M"]
    large = gemm_dense._tile_config(mid_m + 1, 1024, 2560, None)
    assert large == dict(gemm_dense.DENSE_CONFIG, SPLIT_K=1)


def test_dense_operands_take_tma_tiles_above_256_rows_on_sm90(monkeypatch):
    """Two dense operands on a TMA GPU: the pointer tiles up to 256 rows; above, TMA_MID_CONFIG (no split)
    where its 128 × 128 tiles number ≥ TMA_MIN_TILES, else the mid pointer tiles with their split; above
    2,048 rows TMA_CONFIG. An explicit split, packed operands or a GPU without TMA keep the pointer kernel."""
    monkeypatch.setattr(gemm_dense, "interpreting", lambda: False)
    monkeypatch.setattr(gemm_dense, "num_sms", lambda: 132)
    monkeypatch.setattr(gemm_dense, "tma_supported", lambda: True)
    (small_m, small), (mid_m, mid) = gemm_dense.MID_CONFIGS
    tma_mid = dict(gemm_dense.TMA_MID_CONFIG, SPLIT_K=1, TMA=True)
    assert gemm_dense._tile_config(small_m, 4096, 2560, None, dense=True) == dict(small, SPLIT_K=2)
    assert gemm_dense._tile_config(small_m + 1, 4096, 2560, None, dense=True) == tma_mid  # 3 × 32 tiles
    assert gemm_dense._tile_config(512, 1024, 2560, None, dense=True) == dict(mid, SPLIT_K=4)  # 4 × 8 < 64
    assert gemm_dense._tile_config(1024, 1024, 2560, None, dense=True) == tma_mid  # 8 × 8 = 64
    assert gemm_dense._tile_config(mid_m, 9728, 2560, None, dense=True) == tma_mid
    assert gemm_dense._tile_config(mid_m + 1, 1024, 2560, None, dense=True) == dict(
        gemm_dense.TMA_CONFIG, SPLIT_K=1, TMA=True
    )
    assert gemm_dense._tile_config(mid_m + 1, 1024, 2560, 2, dense=True)["SPLIT_K"] == 2
    launch = gemm_dense.dense_launch(4096, 1024, 2560, torch.bfloat16, False, torch.bfloat16, False, torch.bfloat16)
    assert launch.tma and launch.split == 1 and "TMA" not in launch.kwargs
    assert not gemm_dense.dense_launch(4096, 1024, 2560, torch.uint8, True, torch.uint8, True, torch.bfloat16).tma
    monkeypatch.setattr(gemm_dense, "tma_supported", lambda: False)
    assert gemm_dense._tile_config(mid_m + 1, 1024, 2560, None, dense=True) == dict(
        gemm_dense.DENSE_CONFIG, SPLIT_K=1
    )


def test_mid_tiles_with_split_k_are_exact_on_expanded_operands():
    """The Triton GEMM with each of MID_CONFIGS' tiles and a 3-way split on W4A16's operands (x fp16, the weight's
    exact fp16 expansion, per-row outer scale, bias) against the reference; every element written."""
    gen = torch.Generator().manual_seed(6)
    M, N, K = 70, 130, 1024
    x = (torch.randn(M, K, generator=gen) * 0.5).to(torch.float16).to(device())
    w = random_nvfp4((N, K), gen=gen, scale="row", scale_exp=(-3, 3))
    bias = torch.randn(N, generator=gen).to(device())
    ref = gemm_w4a16_reference(x, w, out_dtype=torch.float64, bias=bias)
    for _, cfg in gemm_dense.MID_CONFIGS:
        out = _poisoned(M, N, torch.float32)
        gemm_dense.launch_gemm(
            x, None, expand(w, torch.float16), None, K, out, None, w.global_scale.reshape(-1), bias,
            config=dict(cfg, SPLIT_K=3),
        )  # fmt: skip
        assert not torch.isnan(out).any()
        assert rel_err(out, ref) < FP32_TOL


TMA_TILES = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, SPLIT_K=1, num_warps=4, num_stages=1)


@pytest.mark.parametrize("M,N,K", [(5, 33, 48), (37, 19, 80), (70, 40, 96), (33, 70, 528)])
@pytest.mark.parametrize("scale", ["tensor", "row"])
def test_tma_kernel_gives_the_pointer_kernels_bits(M, N, K, scale):
    """The persistent TMA kernel (dense operands, no split; TMA zero-fills past M, N and K) against the
    fp64 reference and bit for bit against the masked-pointer kernel with the same tiles: W4A4's fp16
    expansions with outer scales per tensor or per row and a bias, fp32 and bf16 outputs; every element
    written (3 programs sweep 2-12 tiles, (70, 40) a count that is no multiple of 3)."""
    gen = torch.Generator().manual_seed(M + N + K)
    a = random_nvfp4((M, K), gen=gen, scale=scale, scale_exp=(-3, 3))
    b = random_nvfp4((N, K), gen=gen, scale=scale, scale_exp=(-3, 3))
    bias = torch.randn(N, generator=gen).to(device())
    ref = gemm_reference(a, b, out_dtype=torch.float64, bias=bias)
    xa, wb = expand(a, torch.float16), expand(b, torch.float16)
    g_a, g_b = a.global_scale.reshape(-1), b.global_scale.reshape(-1)
    launch = gemm_dense.dense_launch(M, N, K, torch.float16, False, torch.float16, False, torch.float32,
                                     config=dict(TMA_TILES, TMA=True))  # fmt: skip
    assert launch.tma and gemm_dense.tma_ready(xa) and gemm_dense.tma_ready(wb)
    for out_dtype in (torch.float32, torch.bfloat16):
        outs = []
        for tma in (True, False):
            out = _poisoned(M, N, out_dtype)
            gemm_dense.launch_gemm(xa, None, wb, None, K, out, g_a, g_b, bias, config=dict(TMA_TILES, TMA=tma))
            assert not torch.isnan(out).any()
            outs.append(out)
        assert torch.equal(outs[0].view(torch.int16 if out_dtype != torch.float32 else torch.int32),
                           outs[1].view(torch.int16 if out_dtype != torch.float32 else torch.int32))  # fmt: skip
        if out_dtype == torch.float32:
            assert rel_err(outs[0], ref) < FP32_TOL


def test_tma_kernel_reads_k_columns_of_a_wider_buffer():
    """The weight's expansion as an aligned [N, K] view of an [N, K + 16] buffer whose padding holds NaN (a
    cached expansion is [N, Kp]): the descriptor stops at K, so the output is the reference's, NaN-free."""
    gen = torch.Generator().manual_seed(5)
    M, N, K = 40, 36, 80  # K steps of 32 read columns 80-95: past K, in the padding
    a = random_nvfp4((M, K), gen=gen)
    b = random_nvfp4((N, K), gen=gen)
    wide = torch.full((N, K + 16), float("nan"), dtype=torch.float16, device=device())
    wide[:, :K] = expand(b, torch.float16)
    wb = wide[:, :K]
    assert gemm_dense.tma_ready(wb)
    out = _poisoned(M, N, torch.float32)
    gemm_dense.launch_gemm(expand(a, torch.float16), None, wb, None, K, out, a.global_scale.reshape(-1),
                           b.global_scale.reshape(-1), None, config=dict(TMA_TILES, TMA=True))  # fmt: skip
    assert not torch.isnan(out).any()
    assert rel_err(out, gemm_reference(a, b, out_dtype=torch.float64)) < FP32_TOL


def test_tma_kernel_falls_back_on_unaligned_rows():
    """An operand whose row stride is not a multiple of 16 bytes (a [M, K] view of a wider buffer), or whose
    base is not 16-byte aligned, cannot be read by TMA: the launch runs the pointer kernel instead, with the
    same result; empty operands, packed operands and a split never take the TMA kernel."""
    gen = torch.Generator().manual_seed(3)
    M, N, K = 20, 24, 96
    a = random_nvfp4((M, K), gen=gen)
    b = random_nvfp4((N, K), gen=gen)
    wide = torch.zeros(M, K + 4, dtype=torch.float16, device=device())
    wide[:, :K] = expand(a, torch.float16)
    xa = wide[:, :K]
    assert not gemm_dense.tma_ready(xa)
    ref = gemm_reference(a, b, out_dtype=torch.float64)
    out = _poisoned(M, N, torch.float32)
    g_a, g_b = a.global_scale.reshape(-1), b.global_scale.reshape(-1)
    gemm_dense.launch_gemm(xa, None, expand(b, torch.float16), None, K, out, g_a, g_b, None,
                           config=dict(TMA_TILES, TMA=True))  # fmt: skip
    assert rel_err(out, ref) < FP32_TOL
    flat = torch.zeros(N * K + 1, dtype=torch.float16, device=device())
    shifted = flat[1:].view(N, K)  # base 2 bytes past an aligned one
    shifted.copy_(expand(b, torch.float16))
    assert not gemm_dense.tma_ready(shifted)
    out = _poisoned(M, N, torch.float32)
    gemm_dense.launch_gemm(wide[:, :K].contiguous(), None, shifted, None, K, out, g_a, g_b, None,
                           config=dict(TMA_TILES, TMA=True))  # fmt: skip
    assert rel_err(out, ref) < FP32_TOL
    assert not gemm_dense.tma_ready(torch.empty(0, K, dtype=torch.float16))
    assert not gemm_dense.dense_launch(M, N, K, torch.uint8, True, torch.uint8, True, torch.float32,
                                       config=dict(TMA_TILES, TMA=True)).tma  # fmt: skip
    assert not gemm_dense.dense_launch(M, N, K, torch.float16, False, torch.float16, False, torch.float32,
                                       config=dict(TMA_TILES, SPLIT_K=2, TMA=True)).tma  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "M,N,K,scale", [(4096, 2560, 9728, "tensor"), (512, 9728, 2560, "row"), (3000, 1000, 1040, "row")]
)
def test_tma_route_in_a_cuda_graph_gives_the_eager_bits(M, N, K, scale):
    """The GEMM plans of a capture (``host_scales=False``) that take the TMA kernel (TMA_CONFIG above 2,048
    rows, TMA_MID_CONFIG below; K not a multiple of the tile's) replay in a CUDA graph with the eager run's
    bits, within bf16 rounding of the fp64 reference."""
    from triage.kernels.nvfp4 import QuantRecipe, quantize
    from triage.kernels.nvfp4.matmul import gemm_plan

    torch.manual_seed(0)
    recipe = QuantRecipe(scale=scale)
    a = quantize(torch.randn(M, K, device="cuda", dtype=torch.bfloat16), recipe, emit_expanded=torch.bfloat16)
    b = quantize(torch.randn(N, K, device="cuda", dtype=torch.bfloat16), recipe)
    plan = gemm_plan(a, b, host_scales=False)
    assert plan.route == "dense" and plan.launch.tma
    eager = plan.run(a, b)
    out = torch.empty_like(eager)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        plan.run(a, b, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(a, b, out=out)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), eager.view(torch.int16))
    ref = gemm_reference(a, b, out_dtype=torch.float64)
    assert rel_err(eager, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dynamic_per_tensor_scales_are_sync_free_at_any_size_with_tma():
    """``auto`` with a dynamic per-tensor activation scale above SYNC_FREE_MAX_FLOP: the Triton GEMM (no host
    read of the scale) where the TMA kernel runs (sm_90+ with its shared memory), else cuBLAS's alpha (a host
    read)."""
    from triage.kernels.nvfp4 import QuantRecipe, quantize
    from triage.kernels.nvfp4 import matmul as mm

    M, N, K = 4096, 4096, 8192  # 2·M·N·K = 2.7e11 > SYNC_FREE_MAX_FLOP
    assert 2.0 * M * N * K > mm.SYNC_FREE_MAX_FLOP
    a = quantize(torch.randn(M, K, device="cuda", dtype=torch.bfloat16), QuantRecipe(), emit_expanded=torch.bfloat16)
    b = quantize(torch.randn(N, K, device="cuda", dtype=torch.bfloat16), QuantRecipe())
    route = mm.gemm_plan(a, b).route
    assert route == ("dense" if gemm_dense.tma_supported() else "alpha")
