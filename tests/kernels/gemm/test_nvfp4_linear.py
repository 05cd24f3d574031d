"""NVFP4Linear (forward, both backward modes, weight cache, checkpointing) and model conversion."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _dense_operands import device, rel_err
from torch import nn

from triage.kernels import NVFP4Config, NVFP4Linear, NVFP4LinearConfig, convert, unconvert
from triage.kernels.linear import transpose_16x16
from triage.kernels.nvfp4 import QuantRecipe, quantize
from triage.kernels.nvfp4.matmul import gemm_reference

# the torch reference quantizer keeps the CPU tests fast; the GEMMs run in the Triton interpreter
CFG = NVFP4LinearConfig(quant_backend="torch")
CFG_FP4_BWD = dataclasses.replace(CFG, backward="nvfp4-backward")


def _layer(k=48, n=32, bias=True, config=CFG, seed=0):
    torch.manual_seed(seed)
    return NVFP4Linear(k, n, bias=bias, config=config, device=device())


def _x(m, k, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(dtype).to(device())


def test_forward_is_the_nvfp4_gemm_of_the_quantized_operands():
    layer = _layer()
    x = _x(2 * 9, 48).reshape(2, 9, 48)
    y = layer(x)
    xq = quantize(x.reshape(-1, 48), CFG.activation, backend="torch")
    wq = quantize(layer.weight.detach(), CFG.weight, backend="torch")
    ref = gemm_reference(xq, wq, out_dtype=torch.float64, bias=layer.bias.detach())
    assert y.shape == (2, 9, 32)
    assert rel_err(y.reshape(-1, 32), ref) < 2e-6
    # and it is an NVFP4 approximation of the exact layer
    assert rel_err(y, nn.functional.linear(x, layer.weight, layer.bias)) < 0.25


@pytest.mark.parametrize("shape", [(18, 48), (2, 9, 48)])
def test_grad_off_forward_gives_the_grad_on_bits_without_a_node(shape):
    layer = _layer()
    x = _x(18, 48).reshape(shape)
    y = layer(x)
    with torch.no_grad():
        y0 = layer(x)
    assert y.grad_fn is not None and y0.grad_fn is None and not y0.requires_grad
    assert y0.shape == y.shape == (*shape[:-1], 32)
    assert torch.equal(y0, y.detach())


def test_bf16_backward_is_straight_through_on_master_tensors():
    layer = _layer()
    x = _x(20, 48).requires_grad_()
    dy = _x(20, 32, seed=2)
    layer(x).backward(dy)
    w, xd = layer.weight.detach().double(), x.detach().double()
    assert rel_err(x.grad, dy.double() @ w) < 1e-6
    assert rel_err(layer.weight.grad, dy.double().T @ xd) < 1e-6
    assert rel_err(layer.bias.grad, dy.double().sum(0)) < 1e-6


def test_bf16_dtype_end_to_end():
    layer = _layer().to(torch.bfloat16)
    x = _x(5, 48, dtype=torch.bfloat16).requires_grad_()
    y = layer(x)
    y.float().sum().backward()
    assert y.dtype == x.grad.dtype == layer.weight.grad.dtype == torch.bfloat16


def test_weight_cache_follows_the_version_counter():
    layer = _layer(bias=False)
    x = _x(4, 48)
    cache = layer._weight_cache
    y1 = layer(x)
    layer(x)
    assert (cache.misses, cache.hits) == (1, 1)
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    layer(x).sum().backward()
    opt.step()
    y2 = layer(x)
    assert cache.misses == 2 and not torch.equal(y1, y2)
    # .data writes bypass the version counter: documented, and invalidate_cache() fixes it
    with torch.no_grad():
        layer.weight.data.copy_(torch.randn_like(layer.weight))
    assert torch.equal(layer(x), y2)  # stale, as documented
    layer.invalidate_cache()
    assert not torch.equal(layer(x), y2)


def test_a_new_config_on_a_live_layer_quantizes_the_weight_for_it():
    """Switching a layer to nvfp4-backward (W_qᵀ needed) without a weight update must not reuse the
    bf16-backward entry (which has no W_qᵀ): the backward runs and equals a fresh nvfp4-backward layer's."""
    layer, fresh = _layer(bias=False), _layer(bias=False, config=CFG_FP4_BWD)
    x = _x(4, 48)
    layer(x)  # cached under the bf16-backward config
    layer.config = CFG_FP4_BWD
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    layer(xa).sum().backward()
    fresh(xb).sum().backward()
    assert torch.equal(xa.grad, xb.grad) and torch.equal(layer.weight.grad, fresh.weight.grad)


def test_weight_cache_is_not_fooled_by_a_reused_address():
    """Replacing ``param.data`` frees the old storage unless the cache holds it; a new weight allocated at
    the freed address (same version, shape, dtype) must not hit the old W_q."""
    layer = _layer(bias=False)
    x = _x(4, 48)
    with torch.no_grad():  # no autograd graph holding the old weight either
        for _ in range(20):
            layer(x)
            old_ptr = layer.weight.data_ptr()
            layer.weight.data = torch.randn_like(layer.weight)  # the old storage is freed (if unreferenced)
            new = [torch.randn_like(layer.weight) for _ in range(8)]  # the allocator tends to hand it back
            layer.weight.data = next((t for t in new if t.data_ptr() == old_ptr), new[0])
            del new
            y = layer(x)
            layer.invalidate_cache()
            assert torch.equal(y, layer(x))


def test_zero_tokens_give_an_empty_output_like_nn_linear():
    layer = _layer().to(torch.bfloat16)
    x = torch.randn(2, 0, 48, dtype=torch.bfloat16, device=device(), requires_grad=True)
    y = layer(x)
    assert y.shape == (2, 0, 32) and y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.shape == x.shape
    assert layer.weight.grad.dtype == torch.bfloat16 and not layer.weight.grad.any()
    assert layer.bias.grad is not None and not layer.bias.grad.any()


def test_transpose_16x16_equals_quantizing_the_transpose():
    w = _x(32, 48, seed=3)
    wq = quantize(w, QuantRecipe(block="16x16"), backend="torch")
    direct = quantize(w.T.contiguous(), QuantRecipe(block="16x16"), backend="torch")
    t = transpose_16x16(wq)
    assert torch.equal(t.data, direct.data)
    assert torch.equal(t.scale.view(torch.uint8), direct.scale.view(torch.uint8))
    assert torch.equal(t.global_scale, direct.global_scale) and t.shape == direct.shape
    with pytest.raises(ValueError, match="16x16"):
        transpose_16x16(quantize(w, QuantRecipe(), backend="torch"))


def test_nvfp4_backward_uses_the_te_operands():
    layer = _layer(config=CFG_FP4_BWD)
    x = _x(20, 48).requires_grad_()  # 20 tokens: wgrad pads M to 32
    dy = _x(20, 32, seed=2)
    layer(x).backward(dy)
    seed = CFG_FP4_BWD.grad.seed + 2  # first backward call of this module
    wq = quantize(layer.weight.detach(), CFG.weight, backend="torch")
    dyq = quantize(dy, CFG.grad, backend="torch", seed=seed)
    dx_ref = gemm_reference(dyq, transpose_16x16(wq), out_dtype=torch.float64)
    assert rel_err(x.grad, dx_ref) < 2e-6
    r = CFG.wgrad
    dyt = quantize(dy.T.contiguous(), r, backend="torch", seed=seed + 1)
    xt = quantize(x.detach().T.contiguous(), dataclasses.replace(r, rounding="nearest"), backend="torch")
    assert rel_err(layer.weight.grad, gemm_reference(dyt, xt, out_dtype=torch.float64)) < 2e-6
    # both are NVFP4 estimates of the exact gradients
    assert rel_err(x.grad, dy.double() @ layer.weight.detach().double()) < 0.3
    assert rel_err(layer.weight.grad, dy.double().T @ x.detach().double()) < 0.3


def test_nvfp4_backward_seeds_wrap_at_2_32():
    grad = dataclasses.replace(CFG.grad, seed=2**32 - 3)  # first backward: dy seed 2**32 - 1
    cfg = dataclasses.replace(CFG_FP4_BWD, grad=grad)
    layer = _layer(config=cfg)
    x = _x(20, 48).requires_grad_()
    dy = _x(20, 32, seed=2)
    layer(x).backward(dy)  # the wgrad's dyᵀ seed wraps to 0 instead of failing the seed range check
    r = cfg.wgrad
    dyt = quantize(dy.T.contiguous(), r, backend="torch", seed=0)
    xt = quantize(x.detach().T.contiguous(), dataclasses.replace(r, rounding="nearest"), backend="torch")
    assert rel_err(layer.weight.grad, gemm_reference(dyt, xt, out_dtype=torch.float64)) < 2e-6


def test_nvfp4_backward_is_unbiased_on_average():
    cfg = dataclasses.replace(CFG_FP4_BWD, gemm_backend="reference")
    layer = _layer(k=32, n=16, bias=False, config=cfg)
    x = _x(16, 32).requires_grad_()
    dy = _x(16, 16, seed=2)
    # E[Q_sr(dy)] = dy, so E[dx] = dy·dequant(W_q): the stochastic part must average out
    wq = quantize(layer.weight.detach(), cfg.weight, backend="torch")
    exact_dx = dy.double() @ wq.dequantize(torch.float64)
    grads = []
    for _ in range(24):
        x.grad = None
        layer(x).backward(dy)
        grads.append(x.grad.double())
    single = rel_err(grads[0], exact_dx)
    mean = rel_err(torch.stack(grads).mean(0), exact_dx)
    assert mean < single / 2, (mean, single)


def _qwen3(seed=0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=False,
        max_position_embeddings=64,
    )
    return Qwen3ForCausalLM(cfg).to(device())


def test_convert_qwen3_and_back():
    model = _qwen3()
    ids = torch.randint(0, 96, (2, 7), device=device())
    with torch.no_grad():
        ref = model(ids).logits
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    convert(model, NVFP4Config(linear=CFG))
    converted = [n for n, m in model.named_modules() if isinstance(m, NVFP4Linear)]
    assert len(converted) == 2 * 7  # q,k,v,o,gate,up,down per layer
    assert type(model.lm_head) is nn.Linear and isinstance(model.model.embed_tokens, nn.Embedding)
    assert list(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())
    with torch.no_grad():
        y = model(ids).logits
    assert not torch.equal(y, ref) and rel_err(y, ref) < 0.5
    unconvert(model)
    assert not any(isinstance(m, NVFP4Linear) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)


def test_gradient_checkpointing_gives_the_same_gradients():
    grads = []
    for checkpointing in (False, True):
        model = convert(_qwen3(), NVFP4Config(linear=CFG))
        model.train()
        if checkpointing:
            kwargs = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):  # newer transformers
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(0)).to(device())
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        layer = model.model.layers[0].mlp.down_proj
        assert layer._weight_cache.misses == 1
        assert layer._weight_cache.hits == int(checkpointing)  # the recomputed forward hit the cache
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for n in grads[0]:
        assert torch.equal(grads[0][n], grads[1][n]), n


def test_conversion_and_config_errors():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(24, 16)

    with pytest.raises(ValueError, match="layer 'proj'.*in_features=24"):
        convert(Odd(), NVFP4Config(linear=CFG))
    assert type(convert(Odd(), NVFP4Config(linear=CFG, skip=("proj",))).proj) is nn.Linear
    with pytest.raises(ValueError, match="16x16"):
        NVFP4LinearConfig(backward="nvfp4-backward", weight=QuantRecipe())
    with pytest.raises(ValueError, match="backward must be one of"):
        NVFP4LinearConfig(backward="fp8")
    with pytest.raises(ValueError, match="multiples of 16"):
        NVFP4Linear(32, 24, config=CFG_FP4_BWD)
    with pytest.raises(TypeError, match="config must be an NVFP4Config"):
        convert(Odd(), "te")
    layer = _layer()
    with pytest.raises(ValueError, match="last dim 32, expected 48"):
        layer(_x(3, 32))
    with pytest.raises(ValueError, match="is on meta"):
        layer(torch.zeros(3, 48, device="meta"))
