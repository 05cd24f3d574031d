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
    logp, ent = token_logprobs(hid, w, y, entropy=True, chunk_size=11, backend=backend)
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
    token_logprobs(hq, wq, y, chunk_size=8, backend="triton").sum().backward()
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
