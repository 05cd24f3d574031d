"""The decode kernel (small M, packed weight streamed once), the large-M GEMMs on exact expansions (Triton
and the cuBLAS alpha path), the ``fused`` baseline, and the quantizer's expansion feeding the GEMM."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _dense_operands import device, random_nvfp4, rel_err

from triage.kernels.nvfp4 import QuantRecipe, quantize
from triage.kernels.nvfp4 import gemm_decode as gd
from triage.kernels.nvfp4 import matmul as mm
from triage.kernels.nvfp4.matmul import (
    SMALL_M,
    expand,
    gemm,
    gemm_reference,
    gemm_w4a16,
    gemm_w4a16_reference,
    host_decode_scale,
)

FP32_TOL = 2e-6


def _poisoned(M, N, dtype=torch.float32):
    return torch.full((M, N), float("nan"), dtype=dtype, device=device())


@pytest.mark.parametrize("M", [1, 7, 16, 33, 64])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize(
    "N,K,xdtype", [(37, 208, torch.bfloat16), (37, 208, torch.float16), (32, 256, torch.bfloat16)]
)  # ragged tiles (masked loop) for both unpacks / even tiles (unmasked)
def test_decode_kernel_w4a16(M, split_k, xdtype, N, K):
    gen = torch.Generator().manual_seed(M * 10 + split_k)
    x = (torch.randn(M, K, generator=gen) * 2).to(xdtype).to(device())
    w = random_nvfp4((N, K), gen=gen, scale="row", zero_block_frac=0.2)
    bias = torch.randn(N, generator=gen).to(device())
    out = _poisoned(M, N)
    gd.launch_decode(x, w.data, w.scale, K, out, None, w.global_scale.reshape(-1), bias, split_k=split_k)
    assert not torch.isnan(out).any(), "unwritten output"
    ref = gemm_w4a16_reference(x, w, out_dtype=torch.float64, bias=bias)
    assert rel_err(out, ref) < FP32_TOL
    again = torch.empty_like(out)
    gd.launch_decode(x, w.data, w.scale, K, again, None, w.global_scale.reshape(-1), bias, split_k=split_k)
    assert torch.equal(out, again)  # deterministic split-K


@pytest.mark.parametrize("M", [1, 16, 64])
def test_decode_w4a4_through_gemm(M):
    gen = torch.Generator().manual_seed(M)
    a = random_nvfp4((M, 96), gen=gen, scale="row", zero_block_frac=0.1)
    b = random_nvfp4((40, 96), gen=gen)
    ref = gemm_reference(a, b, out_dtype=torch.float64)
    assert M <= SMALL_M
    y = gemm(a, b, out_dtype=torch.float32, backend="triton", out=_poisoned(M, 40))
    assert rel_err(y, ref) < FP32_TOL


def test_decode_nan_scale_gives_nan_row_only_and_padded_k():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 40, generator=gen).to(torch.bfloat16).to(device())
    w = random_nvfp4((20, 40), gen=gen, pad=True)
    ref = gemm_w4a16_reference(x, w, out_dtype=torch.float64)
    assert rel_err(gemm_w4a16(x, w, out_dtype=torch.float32, backend="triton"), ref) < FP32_TOL
    sc = w.scale.view(torch.uint8).clone()
    sc[5, 1] = 0x7F  # NaN block scale in weight row 5
    w2 = dataclasses.replace(w, scale=sc.view(torch.float8_e4m3fn))
    y = gemm_w4a16(x, w2, out_dtype=torch.float32, backend="triton")
    assert torch.isnan(y[:, 5]).all() and not torch.isnan(y[:, [0, 1, 2, 3, 4, 6]]).any()


@pytest.mark.parametrize("backend", ["triton", "cublas", "fused"])
@pytest.mark.parametrize("scale", ["tensor", "row"])
def test_large_m_backends_on_expansions(backend, scale):
    gen = torch.Generator().manual_seed(5)
    M = SMALL_M + 9
    x = (torch.randn(M, 80, generator=gen) * 3).to(device())
    a = quantize(x, QuantRecipe(scale=scale), emit_expanded=torch.bfloat16)
    b = random_nvfp4((30, 80), gen=gen)
    bias = torch.randn(30, generator=gen).to(device())
    ref = gemm_reference(a, b, out_dtype=torch.float64, bias=bias)
    y = gemm(a, b, out_dtype=torch.float32, bias=bias, backend=backend, out=_poisoned(M, 30))
    assert rel_err(y, ref) < FP32_TOL
    # the cached weight expansion and host scale are what a cached NVFP4Linear passes
    y2 = gemm(a, b, out_dtype=torch.float32, bias=bias, backend=backend, b_expanded=expand(b),
              b_scale_host=host_decode_scale(b))  # fmt: skip
    assert rel_err(y2, ref) < FP32_TOL


def test_gemm_consumes_the_quantizers_expansion():
    """A large-M GEMM reads ``a.expanded`` instead of re-expanding: poisoning it changes the result."""
    gen = torch.Generator().manual_seed(6)
    a = quantize(torch.randn(SMALL_M + 1, 32, generator=gen).to(device()), emit_expanded=torch.bfloat16)
    b = random_nvfp4((8, 32), gen=gen)
    good = gemm(a, b, out_dtype=torch.float32, backend="triton")
    poisoned = dataclasses.replace(a, expanded=torch.zeros_like(a.expanded))
    assert torch.equal(gemm(poisoned, b, out_dtype=torch.float32, backend="triton"), torch.zeros_like(good))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_cublas_alpha_path_is_one_rounding(out_dtype):
    """Per-tensor scales fold into alpha = RN(g_a·g_b): y = RN_out(alpha·acc (+ bias)), within half an ulp."""
    gen = torch.Generator().manual_seed(7)
    a = random_nvfp4((SMALL_M + 3, 64), gen=gen, scale_exp=(-3, 3))
    b = random_nvfp4((24, 64), gen=gen, scale_exp=(-3, 3))
    for bias in (None, torch.randn(24, generator=gen).to(out_dtype).to(device())):
        ref = gemm_reference(a, b, out_dtype=torch.float64, bias=bias)
        y = gemm(a, b, out_dtype=out_dtype, bias=bias, backend="cublas")
        half_ulp = torch.finfo(out_dtype).eps / 2
        bound = half_ulp * ref.abs() * (1 + 1e-3) + 1e-5 * ref.abs().max()
        assert bool(((y.double() - ref).abs() <= bound).all())


def test_w4a16_large_m_backends_and_cached_expansion():
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(mm.W4A16_UNPACK_MAX_M + 5, 48, generator=gen).to(torch.bfloat16).to(device())  # the expand route
    w = random_nvfp4((20, 48), gen=gen)
    ref = gemm_w4a16_reference(x, w, out_dtype=torch.float64)
    for backend in ("triton", "cublas", "fused"):
        y = gemm_w4a16(x, w, out_dtype=torch.float32, backend=backend, w_expanded=expand(w, torch.bfloat16))
        assert rel_err(y, ref) < FP32_TOL, backend


@pytest.mark.parametrize("split_k,fused", [(1, True), (2, True), (3, False)])
def test_decode_kernel_tiles_m_above_its_tile(split_k, fused):
    """More rows than BM: program axis 2 tiles M (ragged last tile), each tile with its own split-K counters
    (fused reduction) or partials (two-kernel reduction); exact, every element written, counters left zeroed."""
    gen = torch.Generator().manual_seed(9)
    M, N, K = 70, 40, 96
    x = torch.randn(M, K, generator=gen).to(torch.float16).to(device())
    w = random_nvfp4((N, K), gen=gen, scale="row", zero_block_frac=0.1)
    cfg = dict(BM=32, BN=16, NB=2, SPLIT_K=split_k, num_warps=4, num_stages=1, FUSED_REDUCE=fused)
    launch = gd.decode_launch(M, N, K, K // 16, x.dtype, torch.float32, config=cfg)
    assert launch.grid == (3, split_k, 3)
    counters = torch.zeros(9, dtype=torch.int32, device=device())
    out = _poisoned(M, N)
    launch.run(x, w.data, w.scale, out, None, w.global_scale.reshape(-1), None, counters if fused else None)
    assert rel_err(out, gemm_w4a16_reference(x, w, out_dtype=torch.float64)) < FP32_TOL
    assert not counters.any()
    if fused and split_k > 1:  # the counters cover every N tile of every M tile
        with pytest.raises(ValueError, match=">= 9 elements"):
            launch.run(x, w.data, w.scale, out, None, None, None, counters[:8])
    members = [(w.data, w.scale, _poisoned(M, N), None, None)] * 2
    with pytest.raises(ValueError, match="M <= 64"):
        gd.launch_decode_group(x, members, K, None)
    with pytest.raises(ValueError, match="< 2\\*\\*31"):  # int32 offsets
        gd.decode_launch(2**19, 4096, 4096, 256, torch.float16, torch.float32)


def test_w4a16_runs_the_decode_kernel_up_to_its_rows(monkeypatch):
    """``gemm_w4a16`` (``auto``) unpacks the weight in the decode kernel up to W4A16_UNPACK_MAX_M rows, and
    expands it for the dense GEMM above; both exact."""
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(80, 64, generator=gen).to(torch.float16).to(device())
    w = random_nvfp4((24, 64), gen=gen, scale="row")
    ref = gemm_w4a16_reference(x, w, out_dtype=torch.float64)
    calls = []
    launch = gd.launch_decode
    monkeypatch.setattr(gd, "launch_decode", lambda *a, **k: calls.append(a[0].shape[0]) or launch(*a, **k))
    for rows, decoded in ((64, False), (128, True)):
        monkeypatch.setattr(mm, "W4A16_UNPACK_MAX_M", rows)
        assert mm.decode_route("auto", 80, x.device, weight_only=True) is decoded
        calls.clear()
        y = gemm_w4a16(x, w, out_dtype=torch.float32)
        assert calls == ([80] if decoded else [])
        assert rel_err(y, ref) < FP32_TOL


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("N,K", [(37, 208), (32, 256)])
def test_decode_kernel_variants(prefetch, N, K):
    """Both loop schedules (register prefetch: DECODE_CONFIG; none: DECODE_CONFIG_M16) stay exact, with both
    activation loads (K tail: 13 blocks, NB = 2; even K)."""
    gen = torch.Generator().manual_seed(14 + prefetch)
    x = torch.randn(5, K, generator=gen).to(torch.float16).to(device())
    w = random_nvfp4((N, K), gen=gen, scale="row", zero_block_frac=0.2)
    cfg = dict(BM=16, BN=16, NB=2, SPLIT_K=2, num_warps=4, num_stages=1, PREFETCH=prefetch)
    out = _poisoned(5, N)
    gd.launch_decode(x, w.data, w.scale, K, out, None, w.global_scale.reshape(-1), None, config=cfg)
    assert rel_err(out, gemm_w4a16_reference(x, w, out_dtype=torch.float64)) < FP32_TOL


# (M, N, K, split_k, x dtype, out dtype, g_a per row?, w scale, bias?): ragged N (masked rows), ragged K-tail
# (K % 16 != 0: padded weight, and KB % NB != 0), even tiles, empty trailing K slices (split 8 of 13 blocks)
_FUSED_CASES = [
    (37, 200, 3, torch.bfloat16, torch.bfloat16, True, "row", True),
    (32, 256, 4, torch.float16, torch.float16, False, "tensor", True),
    (48, 208, 8, torch.bfloat16, torch.float16, True, "tensor", False),
]


@pytest.mark.parametrize(
    "M,case", [(1, 0), (1, 2), (7, 1), (7, 2), (16, 0), (16, 1), (33, 2), (33, 0), (64, 1), (64, 2)]
)
def test_decode_fused_splitk_reduce_bit_identical(M, case):
    """The in-kernel ("last program reduces") split-K reduction gives the two-kernel path's bits, writes every
    output, and leaves its ticket counters at zero (so back-to-back calls and graph replays work)."""
    N, K, split, xdtype, odtype, ga_row, wscale, has_bias = _FUSED_CASES[case]
    gen = torch.Generator().manual_seed(100 * M + case)
    x = (torch.randn(M, K, generator=gen) * 0.5).to(xdtype).to(device())  # fp16 outputs stay finite
    w = random_nvfp4((N, K), gen=gen, scale=wscale, scale_exp=(-9, 4), zero_block_frac=0.2, pad=K % 16 != 0)
    g_a = (torch.rand(M if ga_row else 1, generator=gen) + 0.5).to(device())
    g_b = w.global_scale.reshape(-1)
    bias = torch.randn(N, generator=gen).to(odtype).to(device()) if has_bias else None
    cnt = torch.zeros(8, dtype=torch.int32, device=device())
    outs = []
    # two-kernel on x, then fused twice in a row: on -x (its partials are what a reducer reading a slice too
    # early would find in a reused workspace), then on x
    for fused, xs in ((False, x), (True, -x), (True, x)):
        out = _poisoned(M, N, odtype)
        gd.launch_decode(xs, w.data, w.scale, K, out, g_a, g_b, bias, split_k=split, fused_reduce=fused,
                         counters=cnt if fused else None)  # fmt: skip
        assert not torch.isnan(out).any(), "unwritten output"
        assert not cnt.any(), "ticket counters not reset"
        outs.append(out)
    assert torch.equal(outs[0].view(torch.int16), outs[2].view(torch.int16))
    ref = gemm_w4a16_reference(x, w, out_dtype=torch.float64) * g_a.double().reshape(-1, 1)
    ref = ref + (bias.double() if has_bias else 0.0)
    assert rel_err(outs[2], ref) < 2 * torch.finfo(odtype).eps


def test_decode_default_plan_is_kept_per_signature():
    """``launch_decode`` with the default tiles keeps one plan per signature (M, N, K, blocks, dtypes,
    device): a second call reuses it, another signature gets its own, and the kept plan computes the bits of
    the plan built for the call (``split_k=`` with the default split builds a fresh one)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 96, generator=gen).to(torch.bfloat16).to(device())
    w = random_nvfp4((40, 96), gen=gen, scale="row")
    g_b = w.global_scale.reshape(-1)
    gd._LAUNCHES.clear()
    out = _poisoned(3, 40)
    gd.launch_decode(x, w.data, w.scale, 96, out, None, g_b, None)
    assert len(gd._LAUNCHES) == 1
    plan = next(iter(gd._LAUNCHES.values()))
    again = _poisoned(3, 40)
    gd.launch_decode(x, w.data, w.scale, 96, again, None, g_b, None)
    assert len(gd._LAUNCHES) == 1 and next(iter(gd._LAUNCHES.values())) is plan
    fresh = _poisoned(3, 40)
    gd.launch_decode(x, w.data, w.scale, 96, fresh, None, g_b, None, split_k=plan.split)
    assert torch.equal(out, again) and torch.equal(out, fresh)
    gd.launch_decode(x[:1], w.data, w.scale, 96, _poisoned(1, 40), None, g_b, None)
    gd.launch_decode(x.half(), w.data, w.scale, 96, _poisoned(3, 40), None, g_b, None)
    assert len(gd._LAUNCHES) == 3  # M and x's dtype are part of the signature


def test_decode_fused_splitk_default_counters_and_config_switch():
    """Default path: the device's cached counters (zero after each call); ``config["FUSED_REDUCE"]`` and
    ``fused_reduce`` pick the path; counters that are too small are refused."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(3, 96, generator=gen).to(torch.float16).to(device())
    w = random_nvfp4((40, 96), gen=gen, scale="row")
    g_b = w.global_scale.reshape(-1)
    cfg = dict(BM=16, BN=16, NB=2, SPLIT_K=3, num_warps=4, num_stages=1)
    outs = []
    for fused in (True, False, None):
        out = _poisoned(3, 40)
        c = dict(cfg) if fused is None else dict(cfg, FUSED_REDUCE=fused)
        gd.launch_decode(x, w.data, w.scale, 96, out, None, g_b, None, config=c)
        outs.append(out)
    out = _poisoned(3, 40)  # the keyword wins over the config
    gd.launch_decode(x, w.data, w.scale, 96, out, None, g_b, None, config=dict(cfg, FUSED_REDUCE=True),
                     fused_reduce=False)  # fmt: skip
    outs.append(out)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    cached = gd.splitk_counters(out.device, 3)
    assert cached.numel() >= 3 and not cached.any()
    assert gd.splitk_counters(out.device, cached.numel() + 1).numel() > cached.numel()  # grows
    with pytest.raises(ValueError, match="counters"):
        gd.launch_decode(x, w.data, w.scale, 96, out, None, g_b, None, config=cfg,
                         counters=torch.zeros(2, dtype=torch.int32, device=device()))  # fmt: skip


def test_graph_counters_give_the_capture_one_buffer(monkeypatch):
    """Inside ``graph_counters`` a captured launch on the opening stream and thread takes the capture's one
    buffer (made, zeroed, by the first such launch) when it fits; another device, stream or thread, or more
    tiles, gets its own. Outside a capture the context refuses to open, and it cannot nest. The capture is
    simulated (CPU): the buffer choice is host logic."""
    import threading
    from types import SimpleNamespace

    with pytest.raises(RuntimeError, match="inside a CUDA-graph capture"):
        with gd.graph_counters():
            pass
    made = []
    real_zeros = torch.zeros

    def zeros(*args, device=None, **kwargs):  # a CPU tensor standing for a device allocation
        made.append(args[0])
        return real_zeros(*args, **kwargs)

    stream = SimpleNamespace(cuda_stream=7)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch, "zeros", zeros)
    dev = torch.device("cuda", 0)
    with gd.graph_counters():
        assert made == []  # nothing allocated until a launch needs counters
        shared = gd.splitk_counters(dev, 40)
        assert made == [gd._SPLITK_COUNTERS_MIN] and not shared.any()
        assert gd.splitk_counters(dev, 7) is shared
        own = gd.splitk_counters(dev, gd._SPLITK_COUNTERS_MIN + 1)  # too many tiles: a buffer of its own
        assert own is not shared and own.numel() == gd._SPLITK_COUNTERS_MIN + 1
        assert gd.splitk_counters(torch.device("cuda", 1), 40) is not shared  # another device
        stream.cuda_stream = 8  # a side stream of the capture
        assert gd.splitk_counters(dev, 40) is not shared
        stream.cuda_stream = 7
        other = []
        worker = threading.Thread(target=lambda: other.append(gd.splitk_counters(dev, 40)))
        worker.start()
        worker.join()
        assert other[0] is not shared  # another thread
        assert gd.splitk_counters(dev, 40) is shared
        with pytest.raises(RuntimeError, match="already open"):
            with gd.graph_counters():
                pass
    assert gd._GRAPH_COUNTERS is None
    assert gd.splitk_counters(dev, 40) is not shared  # closed: each captured launch zeroes its own again


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_counters_replays_match_eager(monkeypatch):
    """Two split-K decode launches captured under ``graph_counters`` get one counter buffer (spied) and their
    replays give the eager bits, replay after replay, with new inputs copied in."""
    gen = torch.Generator().manual_seed(5)
    w1, w2 = (random_nvfp4((200, 1024), gen=gen, scale="row") for _ in range(2))
    x = torch.randn(4, 1024, generator=gen).to(torch.bfloat16).cuda()
    cfg = dict(gd.decode_config(4, 200, 1024, 4))

    def step():
        y = torch.empty(4, 200, device="cuda", dtype=torch.float32)
        z = torch.empty(4, 200, device="cuda", dtype=torch.float32)
        gd.launch_decode(x, w1.data, w1.scale, 1024, y, None, w1.global_scale.reshape(-1), None, config=cfg)
        gd.launch_decode(x, w2.data, w2.scale, 1024, z, None, w2.global_scale.reshape(-1), None, config=cfg)
        return y, z

    step()  # warm-up: compile the kernels outside the capture
    given = []
    real = gd.splitk_counters
    monkeypatch.setattr(gd, "splitk_counters", lambda *a: given.append(real(*a)) or given[-1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), gd.graph_counters():
        out = step()
    assert len(given) == 2 and given[0] is given[1]
    for seed in range(3):
        x.copy_(torch.randn(4, 1024, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16))
        graph.replay()
        eager = step()
        assert all(torch.equal(a, b) for a, b in zip(out, eager, strict=True))
    assert not given[0].any()  # every replay left the shared counters at zero


def test_bf16_unpack_by_multiply_is_the_shift_trick():
    """The bf16 unpack's multiply form (``_unpack_pairs_mul``) gives the shift-and-mask trick's registers
    bit for bit: every pair of codes in every nibble pair of a word (each register depends on its two nibbles
    alone), then random words."""
    import triton
    import triton.language as tl

    @triton.jit
    def both(u_ptr, a_ptr, b_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        ok = offs < n
        u = tl.load(u_ptr + offs, mask=ok, other=0).to(tl.uint32, bitcast=True)
        a0, a1, a2, a3 = gd._unpack_pairs(u, 6)
        b0, b1, b2, b3 = gd._unpack_pairs_mul(u)
        tl.store(a_ptr + offs, a0.to(tl.int32, bitcast=True), mask=ok)
        tl.store(a_ptr + n + offs, a1.to(tl.int32, bitcast=True), mask=ok)
        tl.store(a_ptr + 2 * n + offs, a2.to(tl.int32, bitcast=True), mask=ok)
        tl.store(a_ptr + 3 * n + offs, a3.to(tl.int32, bitcast=True), mask=ok)
        tl.store(b_ptr + offs, b0.to(tl.int32, bitcast=True), mask=ok)
        tl.store(b_ptr + n + offs, b1.to(tl.int32, bitcast=True), mask=ok)
        tl.store(b_ptr + 2 * n + offs, b2.to(tl.int32, bitcast=True), mask=ok)
        tl.store(b_ptr + 3 * n + offs, b3.to(tl.int32, bitcast=True), mask=ok)

    lo, hi = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    pair = lo.flatten() | (hi.flatten() << 16)  # nibbles i and i + 4 of one word
    words = sum(pair << (4 * i) for i in range(4))  # the same pair in every nibble position
    rand = torch.randint(0, 2**32, (4096,), generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    u = torch.cat([words, rand, torch.tensor([0, 2**32 - 1, 0x88888888, 0x77777777])])
    u = (u - ((u >= 2**31).long() << 32)).to(torch.int32).to(device())  # uint32 bits as int32
    a = torch.empty(4, u.numel(), dtype=torch.int32, device=device())
    b = torch.full_like(a, -1)
    both[(1,)](u, a, b, u.numel(), BLOCK=triton.next_power_of_2(u.numel()))
    assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_scale_pairs_is_the_exact_product():
    """``_scale_pairs`` (inline ``fma.rn.bf16x2`` by the scale's half, -0 addend) on every unpacked bf16 code
    pair times every e4m3 scale as the kernel prepares it (``s·2¹¹⁹`` in bf16, NaN included): the bits of
    torch's bf16 product of the two values, ±0 and NaN included (NaN compared as NaN)."""
    import triton
    import triton.language as tl

    @triton.jit
    def scaled(r_ptr, s_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        r = tl.load(r_ptr + offs, mask=ok, other=0).to(tl.uint32, bitcast=True)
        s = tl.load(s_ptr + offs, mask=ok, other=0).to(tl.uint32, bitcast=True)
        tl.store(out_ptr + offs, gd._scale_pairs(r, s).to(tl.int32, bitcast=True), mask=ok)

    codes = torch.arange(16, dtype=torch.int64)
    halves = ((codes & 8) << 12) | ((codes & 7) << 6)  # e2m1·2⁻¹²⁶ in bf16 (the unpack's values)
    lo, hi = torch.meshgrid(halves, halves, indexing="ij")
    pairs = (lo.flatten() | (hi.flatten() << 16)).repeat_interleave(256)
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().repeat(256)
    scale = (e4m3 * 2.0**119).to(torch.bfloat16)  # exact: 4 significant bits, normal in bf16
    s16 = scale.view(torch.int16).to(torch.int64) & 0xFFFF
    as_i32 = lambda t: (t - ((t >= 2**31).long() << 32)).to(torch.int32)  # noqa: E731
    r, s = as_i32(pairs).cuda(), as_i32(s16 | 0x12340000).cuda()  # high half of s must be ignored
    out = torch.empty_like(r)
    scaled[(triton.cdiv(r.numel(), 1024),)](r, s, out, r.numel(), BLOCK=1024)

    def halves_of(words):
        w = words.to(torch.int64) & 0xFFFFFFFF
        return torch.stack([w & 0xFFFF, w >> 16]).to(torch.int16).view(torch.bfloat16).float()

    want = halves_of(r.cpu()) * scale[None].float()
    got = halves_of(out.cpu())
    assert torch.equal(got.isnan(), want.isnan())
    fin = ~want.isnan()
    assert torch.equal(got[fin].view(torch.int32), want[fin].to(torch.bfloat16).float().view(torch.int32))
