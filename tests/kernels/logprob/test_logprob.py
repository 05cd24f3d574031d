"""token_logprobs (chunked, Triton epilogues under the interpreter on CPU) against eager log_softmax."""

import math

import pytest
import torch

from triage.kernels.logprob import (
    dlogits_chunk_torch,
    lse_chunk_update_torch_,
    token_logprobs,
    token_logprobs_reference,
)

BACKENDS = ["triton", "torch"]


def _inputs(n=37, v=53, h=24, dtype=torch.float32, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    hid = (torch.randn(n, h, generator=gen) * scale).to(dtype)
    w = (torch.randn(v, h, generator=gen) * scale).to(dtype)
    y = torch.randint(0, v, (n,), generator=gen)
    return hid, w, y


def _ref64(hid, w, y, temperature=1.0):
    return token_logprobs_reference(hid, w, y, temperature, entropy=True, compute_dtype=torch.float64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk", [7, 16, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_forward_matches_eager_fp32(backend, chunk, temperature):
    hid, w, y = _inputs()
    logp, ent = token_logprobs(hid, w, y, temperature, entropy=True, chunk_size=chunk, backend=backend)
    ref_logp, ref_ent = _ref64(hid, w, y, temperature)
    assert logp.dtype == torch.float32 and logp.shape == y.shape
    torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=2e-5)
    only = token_logprobs(hid, w, y, temperature, chunk_size=chunk, backend=backend)
    torch.testing.assert_close(only, logp, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_match_fp32_math_of_the_same_values(backend, dtype):
    hid, w, y = _inputs(dtype=dtype, seed=1)
    logp, ent = token_logprobs(
        hid, w, y, entropy=True, chunk_size=11, backend=backend, logits_dtype=torch.float32
    )
    ref_logp, ref_ent = _ref64(hid, w, y)  # exact products of the same (rounded) inputs
    torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-5, atol=5e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=5e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_entropy", [False, True])
def test_gradients_match_eager(backend, with_entropy):
    hid, w, y = _inputs(n=29, v=41, h=16, seed=2)
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(29, generator=gen)
    g_ent = torch.randn(29, generator=gen)

    def run(fn, h0, w0, **kw):
        h0 = h0.clone().requires_grad_(True)
        w0 = w0.clone().requires_grad_(True)
        out = fn(h0, w0, y, 0.8, entropy=True, **kw)
        loss = (out[0] * g).sum() + ((out[1] * g_ent).sum() if with_entropy else 0.0)
        loss.backward()
        return h0.grad, w0.grad

    dh, dw = run(token_logprobs, hid, w, chunk_size=9, backend=backend)
    rdh, rdw = run(token_logprobs_reference, hid.double(), w.double(), compute_dtype=torch.float64)
    torch.testing.assert_close(dh.double(), rdh, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw.double(), rdw, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gradients_half_dtype(dtype):
    hid, w, y = _inputs(n=21, v=30, h=16, dtype=dtype, seed=4)
    hq, wq = hid.clone().requires_grad_(True), w.clone().requires_grad_(True)
    token_logprobs(hq, wq, y, chunk_size=8, backend="triton", logits_dtype=torch.float32).sum().backward()
    assert hq.grad.dtype == dtype and wq.grad.dtype == dtype
    h64, w64 = hid.double().requires_grad_(True), w.double().requires_grad_(True)
    token_logprobs_reference(h64, w64, y, compute_dtype=torch.float64).sum().backward()
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3  # one rounding of dlogits / of the result
    torch.testing.assert_close(hq.grad.double(), h64.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(wq.grad.double(), w64.grad, rtol=tol, atol=tol)


def test_only_weight_or_only_hidden_grad():
    hid, w, y = _inputs(n=10, v=12, h=8, seed=5)
    wq = w.clone().requires_grad_(True)
    token_logprobs(hid, wq, y, chunk_size=5, backend="triton").sum().backward()
    w64 = w.double().requires_grad_(True)
    token_logprobs_reference(hid.double(), w64, y, compute_dtype=torch.float64).sum().backward()
    torch.testing.assert_close(wq.grad.double(), w64.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_shape_and_non_contiguous(backend):
    gen = torch.Generator().manual_seed(6)
    hid = torch.randn(3, 16, 5, generator=gen).transpose(1, 2)  # [3, 5, 16], non-contiguous
    w_big = torch.randn(40, 32, generator=gen)
    w = w_big[:, ::2]  # [40, 16], stride 2
    y = torch.randint(0, 40, (5, 3), generator=gen).t()  # [3, 5] non-contiguous
    logp, ent = token_logprobs(hid, w, y, entropy=True, chunk_size=6, backend=backend)
    ref_logp, ref_ent = _ref64(hid, w, y)
    assert logp.shape == (3, 5)
    torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n,v,h", [(1, 1, 1), (1, 7, 3), (5, 2, 1), (0, 9, 4), (17, 300, 3)])
def test_odd_shapes(backend, n, v, h):
    hid, w, y = _inputs(n, v, h, seed=7)
    logp, ent = token_logprobs(hid, w, y, entropy=True, chunk_size=4, backend=backend)
    ref_logp, ref_ent = _ref64(hid, w, y)
    torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_hidden_is_uniform(backend):
    _, w, y = _inputs(n=6, v=33, h=8, seed=8)
    logp, ent = token_logprobs(torch.zeros(6, 8), w, y, entropy=True, chunk_size=10, backend=backend)
    torch.testing.assert_close(logp, torch.full((6,), -math.log(33)), rtol=0, atol=1e-6)
    torch.testing.assert_close(ent, torch.full((6,), math.log(33)), rtol=0, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_huge_and_subnormal_values(backend):
    hid, w, y = _inputs(n=12, v=25, h=8, seed=9)
    big = hid * 300.0  # logits ~ 1e3..1e4: exp overflows without the running max
    logp, ent = token_logprobs(big, w, y, entropy=True, chunk_size=7, backend=backend)
    ref_logp, ref_ent = _ref64(big, w, y)
    torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-5, atol=1e-2)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-3)
    tiny = hid * 1e-39  # subnormal fp32 hidden: logits underflow to ~0 -> uniform
    logp, ent = token_logprobs(tiny, w, y, entropy=True, chunk_size=7, backend=backend)
    torch.testing.assert_close(logp, torch.full((12,), -math.log(25)), rtol=0, atol=1e-6)
    torch.testing.assert_close(ent, torch.full((12,), math.log(25)), rtol=0, atol=1e-6)


def test_triton_epilogues_match_torch_twins():
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(19, 37, generator=gen) * 5
    y = torch.randint(30, 80, (19,), generator=gen)  # some targets inside cols [40, 77), some not
    from triage.kernels.logprob_triton import dlogits_chunk, lse_chunk_update_

    states = []
    for fn in (lse_chunk_update_, lse_chunk_update_torch_):
        st = [torch.full((19,), -math.inf), torch.zeros(19), torch.zeros(19), torch.zeros(19)]
        fn(x, y, 40, 0.9, *st)
        fn(x[:, :11] + 3, y, 0, 0.9, *st)  # a second chunk with a larger max: rescaling
        states.append(st)
    for a, b in zip(*states):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    lse = states[0][0] + torch.log(states[0][1])
    g, gh, ent = torch.randn(19, generator=gen), torch.randn(19, generator=gen), torch.rand(19, generator=gen)
    for args in [(g, gh, ent), (g, None, None)]:
        a = dlogits_chunk(x, y, 40, 0.9, lse, *args, torch.float32)
        b = dlogits_chunk_torch(x, y, 40, 0.9, lse, *args, torch.float32)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_no_vocab_sized_tensor_is_saved_for_backward():
    hid, w, y = _inputs(n=64, v=512, h=8, seed=11)
    hq = hid.clone().requires_grad_(True)
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
        out = token_logprobs(hq, w, y, entropy=True, chunk_size=64, backend="triton")
    out[0].sum().backward()
    assert max(sizes) == w.numel() and 64 * 512 not in sizes


@pytest.mark.parametrize("bad", [-1, 53, 10**6])
def test_target_out_of_range_names_position(bad):
    hid, w, y = _inputs(n=12, seed=12)
    y = y.view(3, 4).clone()
    y[2, 1] = bad
    with pytest.raises(ValueError, match=r"target_ids\[2, 1\] = .* outside the vocabulary \[0, 53\)"):
        token_logprobs(hid.view(3, 4, -1), w, y)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_inputs_raise_with_position(backend):
    hid, w, y = _inputs(n=8, seed=13)
    hid[5, 3] = float("nan")
    with pytest.raises(ValueError, match=r"position \[5\]: hidden\[5\] has non-finite"):
        token_logprobs(hid, w, y, backend=backend)
    hid, w, y = _inputs(n=8, seed=13)
    w[7, 0] = float("inf")
    with pytest.raises(ValueError, match=r"position \[0\]: .*lm_head_weight has non-finite"):
        token_logprobs(hid, w, y, backend=backend)


def test_bad_arguments():
    hid, w, y = _inputs(n=4, v=6, h=5)
    with pytest.raises(TypeError, match="share one of"):
        token_logprobs(hid, w.half(), y)
    with pytest.raises(ValueError, match="target_ids shape"):
        token_logprobs(hid, w, y[:3])
    with pytest.raises(ValueError, match="H=5"):
        token_logprobs(hid[:, :4], w, y)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(hid, w, y, temperature=0.0)
    with pytest.raises(TypeError, match="integer"):
        token_logprobs(hid, w, y.float())


# ----- performance options: logits_dtype, saved_chunks, overlap -----


def _grads(fn, hid, w, y, g, g_ent, temperature=0.8, **kw):
    h0 = hid.clone().requires_grad_(True)
    w0 = w.clone().requires_grad_(True)
    logp, ent = fn(h0, w0, y, temperature, entropy=True, **kw)
    ((logp * g).sum() + (ent * g_ent).sum()).backward()
    return logp.detach(), ent.detach(), h0.grad, w0.grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("saved", [0, 1, 2, 100])
@pytest.mark.parametrize("overlap", [False, True])
def test_saved_chunks_and_overlap_match_eager(backend, saved, overlap):
    hid, w, y = _inputs(n=23, v=50, h=16, seed=20)
    gen = torch.Generator().manual_seed(21)
    g, g_ent = torch.randn(23, generator=gen), torch.randn(23, generator=gen)
    logp, ent, dh, dw = _grads(
        token_logprobs,
        hid,
        w,
        y,
        g,
        g_ent,
        chunk_size=8,
        backend=backend,
        saved_chunks=saved,
        overlap=overlap,
    )
    rl, re, rdh, rdw = _grads(
        token_logprobs_reference, hid.double(), w.double(), y, g, g_ent, compute_dtype=torch.float64
    )
    torch.testing.assert_close(logp.double(), rl, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(ent.double(), re, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(dh.double(), rdh, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw.double(), rdw, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("saved", [0, 3])
def test_half_inputs_fp32_logits_gradients(backend, dtype, saved):
    """fp32 logits, 16-bit gradient packed into the fp32 chunk buffer in place (the SYNC kernel path)."""
    hid, w, y = _inputs(n=21, v=45, h=16, dtype=dtype, seed=22)
    gen = torch.Generator().manual_seed(23)
    g, g_ent = torch.randn(21, generator=gen), torch.randn(21, generator=gen)
    logp, ent, dh, dw = _grads(
        token_logprobs,
        hid,
        w,
        y,
        g,
        g_ent,
        chunk_size=10,
        backend=backend,
        saved_chunks=saved,
        logits_dtype=torch.float32,
    )
    assert dh.dtype == dtype and dw.dtype == dtype
    rl, re, rdh, rdw = _grads(
        token_logprobs_reference, hid.double(), w.double(), y, g, g_ent, compute_dtype=torch.float64
    )
    torch.testing.assert_close(logp.double(), rl, rtol=1e-5, atol=5e-5)
    torch.testing.assert_close(ent.double(), re, rtol=1e-5, atol=5e-5)
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(dh.double(), rdh, rtol=tol, atol=tol)
    torch.testing.assert_close(dw.double(), rdw, rtol=tol, atol=tol)


def _ref_half_logits(hid, w, y, temperature, entropy=True, logits_dtype=None):
    """fp64 eager on the 16-bit logits (h @ W.T rounded like eager), gradients straight through the rounding."""
    exact = hid @ w.t()
    rounded = (
        hid.detach().to(logits_dtype) @ w.detach().to(logits_dtype).t()
    ).double()  # eager's GEMM output
    logits = (exact + (rounded - exact).detach()) / temperature
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("saved,overlap", [(0, False), (1, False), (2, True)])
def test_half_logits_match_eager_with_half_logits(backend, dtype, saved, overlap):
    hid, w, y = _inputs(n=25, v=70, h=32, dtype=dtype, seed=24, scale=1.5)
    gen = torch.Generator().manual_seed(25)
    g, g_ent = torch.randn(25, generator=gen), torch.randn(25, generator=gen)
    kw = dict(chunk_size=16, backend=backend, logits_dtype=dtype, saved_chunks=saved, overlap=overlap)
    logp, ent, dh, dw = _grads(token_logprobs, hid, w, y, g, g_ent, **kw)
    # values: the eager reference in fp32 / fp64 on the same 16-bit logits
    e32 = token_logprobs_reference(hid, w, y, 0.8, entropy=True, logits_dtype=dtype)
    e64 = token_logprobs_reference(
        hid, w, y, 0.8, entropy=True, compute_dtype=torch.float64, logits_dtype=dtype
    )
    torch.testing.assert_close(logp, e32[0], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(ent, e32[1], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(logp.double(), e64[0], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(ent.double(), e64[1], rtol=1e-5, atol=2e-5)
    # ... and they differ from exact-logit values by the 16-bit logit rounding only
    ex = _ref64(hid, w, y, 0.8)
    zmax = (hid.double() @ w.double().t()).abs().max() / 0.8
    assert (logp.double() - ex[0]).abs().max() < 2 * zmax * (2**-8 if dtype == torch.bfloat16 else 2**-11)
    rl, re, rdh, rdw = _grads(_ref_half_logits, hid.double(), w.double(), y, g, g_ent, logits_dtype=dtype)
    torch.testing.assert_close(logp.double(), rl, rtol=1e-5, atol=2e-5)
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    scale_h, scale_w = rdh.abs().max(), rdw.abs().max()
    torch.testing.assert_close(dh.double() / scale_h, rdh / scale_h, rtol=0, atol=tol)
    torch.testing.assert_close(dw.double() / scale_w, rdw / scale_w, rtol=0, atol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_inputs_logits_dtype_fp32_is_default(backend):
    hid, w, y = _inputs(n=9, v=20, h=8, seed=26)
    a = token_logprobs(hid, w, y, chunk_size=6, backend=backend)
    b = token_logprobs(hid, w, y, chunk_size=6, backend=backend, logits_dtype=torch.float32)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_retain_graph_second_backward_recomputes_kept_chunks(backend):
    hid, w, y = _inputs(n=12, v=30, h=8, seed=27)
    hq, wq = hid.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out = token_logprobs(hq, wq, y, chunk_size=7, backend=backend, saved_chunks=3)
    out.sum().backward(retain_graph=True)
    g1 = hq.grad.clone(), wq.grad.clone()
    hq.grad = wq.grad = None
    out.sum().backward()  # the kept chunks were overwritten by the first backward: must recompute
    torch.testing.assert_close(hq.grad, g1[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(wq.grad, g1[1], rtol=1e-6, atol=1e-7)


def test_no_grad_forward_keeps_nothing():
    hid, w, y = _inputs(n=8, v=20, h=8, seed=28)
    hq = hid.clone().requires_grad_(True)
    with torch.no_grad():
        out = token_logprobs(hq, w, y, chunk_size=6, saved_chunks=5)
    assert out.grad_fn is None


def test_spans_put_the_ragged_chunk_first():
    from triage.kernels.logprob import _spans

    assert _spans(10, 4) == [(8, 10), (0, 4), (4, 8)]
    assert _spans(8, 4) == [(0, 4), (4, 8)]
    assert _spans(3, 4) == [(0, 3)]


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
def test_triton_dlogits_in_place_packed_half(out_dtype):
    from triage.kernels.logprob import packed_half_view
    from triage.kernels.logprob_triton import dlogits_chunk

    gen = torch.Generator().manual_seed(29)
    x = torch.randn(13, 2100, generator=gen) * 3  # > one 1024-column block per row
    y = torch.randint(0, 2500, (13,), generator=gen)
    lse = torch.logsumexp(x / 0.9, 1) + 1.0
    g, gh, ent = torch.randn(13, generator=gen), torch.randn(13, generator=gen), torch.rand(13, generator=gen)
    ref = dlogits_chunk_torch(x, y, 300, 0.9, lse, g, gh, ent, out_dtype)
    out = packed_half_view(x, out_dtype)
    res = dlogits_chunk(x, y, 300, 0.9, lse, g, gh, ent, out_dtype, out=out)
    assert res.data_ptr() == x.data_ptr() and res.stride() == (2 * 2100, 1)
    torch.testing.assert_close(res, ref)  # 16-bit defaults: 1 ulp (exp differs in the last fp32 bit)
    xb = (torch.randn(13, 700, generator=gen) * 3).to(out_dtype)  # same-dtype in place
    ref = dlogits_chunk_torch(xb, y, 0, 0.9, lse, g, None, None, out_dtype)
    res = dlogits_chunk(xb, y, 0, 0.9, lse, g, None, None, out_dtype, out=xb)
    torch.testing.assert_close(xb, ref)


def test_bad_performance_options():
    hid, w, y = _inputs(n=4, v=6, h=5)
    with pytest.raises(ValueError, match="logits_dtype"):
        token_logprobs(hid, w, y, logits_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="saved_chunks"):
        token_logprobs(hid, w, y, saved_chunks=-1)


@pytest.mark.parametrize("saved,overlap", [(0, False), (1, False), (3, True), (9, False)])
def test_kept_chunks_skip_the_recompute_gemm(monkeypatch, saved, overlap):
    import triage.kernels.logprob as lp

    calls = []
    real = lp._logits_into
    monkeypatch.setattr(
        lp, "_logits_into", lambda h, wc, flat, n: calls.append(wc.shape[0]) or real(h, wc, flat, n)
    )
    hid, w, y = _inputs(n=10, v=30, h=8, seed=30)  # chunks of 7: 2, 7, 7, 7, 7 columns
    hq = hid.clone().requires_grad_(True)
    out = token_logprobs(hq, w, y, chunk_size=7, backend="torch", saved_chunks=saved, overlap=overlap)
    assert calls == [2, 7, 7, 7, 7]
    out.sum().backward()
    kept = min(saved, 5)
    assert len(calls) == 5 + 5 - kept and sorted(calls[5:]) == sorted([2, 7, 7, 7, 7][: 5 - kept])
    h64 = hid.double().requires_grad_(True)
    token_logprobs_reference(h64, w.double(), y, compute_dtype=torch.float64).sum().backward()
    torch.testing.assert_close(hq.grad.double(), h64.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_default_to_half_logits(backend, dtype):
    """16-bit inputs: the default rounds the logits like eager's GEMM (``logits_dtype=hidden.dtype``)."""
    hid, w, y = _inputs(n=9, v=20, h=8, dtype=dtype, seed=28)
    a = token_logprobs(hid, w, y, chunk_size=6, backend=backend)
    b = token_logprobs(hid, w, y, chunk_size=6, backend=backend, logits_dtype=dtype)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
