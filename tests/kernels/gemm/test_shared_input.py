"""Sibling layers reading one input quantize it once (``share_inputs``), with the bytes of a per-call quantize.

q/k/v read one hidden state and gate/up another: :func:`triage.kernels.linear.quantize_input` keeps the last
input's x_q and hands it to the next layer that quantizes the same unchanged tensor with the same recipe.
These tests count the quantizations (the non-finite rule's ``_quantize``) and compare every output and
gradient with ``share_inputs=False``, bit for bit.
"""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
from torch import nn

import triage.kernels.linear as linear_mod
from triage.kernels import FrozenNVFP4Linear, NVFP4FrozenConfig, NVFP4Linear, NVFP4LinearConfig
from triage.kernels.nvfp4 import QuantRecipe

CFG = NVFP4LinearConfig(quant_backend="torch", gemm_backend="reference")
OFF = dataclasses.replace(CFG, share_inputs=False)


class Attention(nn.Module):
    """Three siblings on one input (q/k/v) and one on another (o), as a decoder layer's attention."""

    def __init__(self, config: NVFP4LinearConfig, k: int = 64) -> None:
        super().__init__()
        self.q, self.k, self.v = (NVFP4Linear(k, n, bias=False, config=config) for n in (64, 32, 32))
        self.o = NVFP4Linear(64, k, bias=False, config=config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        return self.o(q * torch.cat([k, v], -1))


def _twins(count: list):
    """Two equal attention blocks, sharing on and off, with their weights quantized (the count then reset)."""
    torch.manual_seed(0)
    on, off = Attention(CFG), Attention(OFF)
    off.load_state_dict(on.state_dict())
    for model in (on, off):
        for layer in model.children():
            layer.quantized_weight()  # the weight cache: W_q is quantized once, not counted below
    count.clear()
    return on, off


@pytest.fixture
def count(monkeypatch):
    """The quantizations run (``_quantize`` calls: activations, and a weight when its cache misses)."""
    calls = []
    real = linear_mod._quantize

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(linear_mod, "_quantize", counting)
    monkeypatch.setattr(linear_mod, "_last_input", None)
    return calls


def test_siblings_share_one_quantization(count):
    on, off = _twins(count)
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        y_on = on(x)
        assert len(count) == 2  # q/k/v share one; o quantizes its own input
        count.clear()
        y_off = off(x)
        assert len(count) == 4
    assert torch.equal(y_on, y_off)


def test_training_gradients_match_with_sharing(count):
    on, off = _twins(count)
    x = torch.randn(6, 64)
    for model, quantizations in ((on, 2), (off, 4)):
        count.clear()
        xg = x.clone().requires_grad_()
        model(xg).square().sum().backward()
        model.grad_x = xg.grad
        assert len(count) == quantizations  # with grad too: q/k/v share (bf16-backward quantizes nothing)
    assert torch.equal(on.grad_x, off.grad_x)
    for (name, p_on), p_off in zip(on.named_parameters(), off.parameters(), strict=True):
        assert torch.equal(p_on.grad, p_off.grad), name


def test_an_inplace_write_between_siblings_quantizes_again(count):
    on, off = _twins(count)
    x = torch.randn(4, 64)
    x0 = x.clone()
    with torch.no_grad():
        a = on.q(x)
        x.mul_(3.0)  # bumps x._version: the next sibling must not reuse the old x_q
        b = on.k(x)
        assert len(count) == 2
        assert torch.equal(a, off.q(x0))
        assert torch.equal(b, off.k(x))
        assert not torch.equal(b, off.k(x0))


def test_not_shared_across_recipes_rounding_and_inference_tensors(count):
    x = torch.randn(4, 64)
    torch.manual_seed(0)
    a = NVFP4Linear(64, 32, bias=False, config=CFG)
    other = dataclasses.replace(CFG, activation=QuantRecipe(scale="row"))
    b = NVFP4Linear(64, 32, bias=False, config=other)
    stochastic = dataclasses.replace(CFG, activation=QuantRecipe(rounding="stochastic", seed=1))
    s1, s2 = (NVFP4Linear(64, 32, bias=False, config=stochastic) for _ in range(2))
    for layer in (a, b, s1, s2):
        layer.quantized_weight()
    count.clear()
    with torch.no_grad():
        a(x), b(x)
    assert len(count) == 2  # another recipe: its own quantization
    count.clear()
    with torch.no_grad():
        s1(x), s2(x)
    assert len(count) == 2  # stochastic rounding: each call draws its own
    count.clear()
    with torch.inference_mode():
        xi = torch.randn(4, 64)
        a(xi), a(xi)
    assert len(count) == 2  # an inference tensor has no version counter: never reused


def test_share_inputs_off_quantizes_every_call(count):
    _, off = _twins(count)
    with torch.no_grad():
        off(torch.randn(3, 64))
    assert len(count) == 4


def _one_kept(count):
    """A layer and an input whose quantization the layer's call left kept."""
    on, _ = _twins(count)
    x = torch.randn(4, 64)
    with torch.no_grad():
        on.q(x)
    assert linear_mod._last_input is not None
    return on, x


def test_the_kept_quantization_dies_with_its_input(count):
    _, x = _one_kept(count)
    del x
    gc.collect()
    assert linear_mod._last_input is None


def test_nonfinite_input_is_shared_as_nan(count):
    on, _ = _twins(count)
    x = torch.randn(4, 64)
    x[1, 3] = float("nan")
    with torch.no_grad():
        q, k = on.q(x), on.k(x)
    assert len(count) == 1
    assert q.isnan().all() and k.isnan().all()


def test_frozen_w4a4_siblings_share(count):
    torch.manual_seed(0)
    lins = [nn.Linear(64, n, bias=False) for n in (64, 32, 32)]
    on = [FrozenNVFP4Linear.from_linear(lin, NVFP4FrozenConfig(quant_backend="torch")) for lin in lins]
    off_cfg = NVFP4FrozenConfig(quant_backend="torch", share_inputs=False)
    off = [FrozenNVFP4Linear.from_linear(lin, off_cfg) for lin in lins]
    x = torch.randn(5, 64)
    with torch.no_grad():
        y_on = [layer(x) for layer in on]
        assert len(count) == 1
        y_off = [layer(x) for layer in off]
        assert len(count) == 4
    for a, b in zip(y_on, y_off, strict=True):
        assert torch.equal(a, b)
    assert NVFP4FrozenConfig.like(OFF).share_inputs is False


@pytest.mark.parametrize("cls", [NVFP4LinearConfig, NVFP4FrozenConfig])
def test_share_inputs_must_be_a_bool(cls):
    with pytest.raises(TypeError, match="share_inputs must be a bool"):
        cls(share_inputs=1)


def test_an_optimizer_step_or_a_data_swap_drops_the_kept_quantization(count):
    on, off = _twins(count)
    x = torch.randn(4, 64)
    opt = torch.optim.SGD(on.parameters(), lr=0.1)
    with torch.no_grad():
        on.q(x)
    opt.step()  # (no gradients: W unchanged) a fused optimizer may write an input without a version bump
    assert linear_mod._last_input is None
    count.clear()
    x0 = x.clone()
    with torch.no_grad():
        a = on.q(x)
        x.data = torch.randn(4, 64)  # a new storage behind the same object, same shape, no version bump
        b = on.k(x)
        assert len(count) == 2 + 2  # both quantized (+2: the weights the optimizer step invalidated)
        assert torch.equal(b, off.k(x))
        assert torch.equal(a, off.q(x0))


def test_capture_scope_drops_the_kept_quantization_and_does_not_nest(count):
    on, x = _one_kept(count)
    with linear_mod.capture_scope():
        assert linear_mod._last_input is None  # nothing made before the capture is shared into it
        with pytest.raises(RuntimeError, match="already open"):
            with linear_mod.capture_scope():
                pass
        with torch.no_grad():
            on.q(x)
    assert linear_mod._last_input is None and not linear_mod._capture_scope


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_siblings_share_only_inside_a_capture_scope(count):
    """Two graphs capturing siblings on one x never share (each replays its own quantization); one graph
    inside ``capture_scope`` shares, and its replays give the eager outputs."""
    torch.manual_seed(0)
    q, k = (NVFP4Linear(256, 128, bias=False, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        eager = (q(x).clone(), k(x).clone())
        count.clear()
        g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(g1):
            y1 = q(x)
        with torch.cuda.graph(g2):
            y2 = k(x)
        assert len(count) == 2  # no scope: each graph quantizes x itself
        count.clear()
        g3 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g3), linear_mod.capture_scope():
            y3 = (q(x), k(x))
        assert len(count) == 1
    g2.replay()
    g1.replay()
    g3.replay()
    torch.cuda.synchronize()
    assert torch.equal(y1, eager[0]) and torch.equal(y2, eager[1])
    assert torch.equal(y3[0], eager[0]) and torch.equal(y3[1], eager[1])
