"""Qwen3-MoE (transformers 5.x fused experts) conversion to NVFP4 experts: semantics, training, generation."""

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from triage.kernels import NVFP4Config, convert, unconvert
from triage.kernels.linear import transpose_16x16
from triage.kernels.moe import offsets_from_expert_ids
from triage.kernels.moe.experts import (
    NVFP4MoEConfig,
    NVFP4MoeExperts,
    _WeightCache,
    grouped_nvfp4_linear,
)
from triage.kernels.nvfp4.api import dequantize, quantize
from triage.kernels.nvfp4.recipe import QuantRecipe

#: the device of the tests that run the Triton backends (CUDA tensors, or the interpreter on the CPU)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _tiny_moe(seed=0, **kw):
    cfg = Qwen3MoeConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        **kw,
    )
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(cfg)


def convert_experts(model, config=None):
    """``convert`` of the fused experts only (the dense layers stay ``nn.Linear``)."""
    return convert(model, NVFP4Config(linear=None, moe=config or NVFP4MoEConfig()))


def _experts(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, NVFP4MoeExperts)]


def test_conversion_keeps_parameters_keys_and_router():
    model = _tiny_moe()
    keys = list(model.state_dict())
    before = {n: p for n, p in model.named_parameters()}
    router_type = type(model.model.layers[0].mlp.gate)
    assert convert_experts(model) is model
    assert _experts(model) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert isinstance(model.model.layers[1].mlp.experts, NVFP4MoeExperts)
    assert type(model.model.layers[0].mlp.gate) is router_type  # router stays high precision
    assert list(model.state_dict()) == keys
    assert all(p is before[n] for n, p in model.named_parameters())
    converted = [model.get_submodule(n) for n in _experts(model)]
    convert_experts(model)  # idempotent
    assert [model.get_submodule(n) for n in _experts(model)] == converted


def _reference_experts(module, hidden, idx, weights):
    """Per-expert loop on the NVFP4-dequantized operands the module uses (fp64)."""
    cfg = module.config
    k = idx.shape[1]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // k
    xq = quantize(hidden, cfg.activation, backend="torch").dequantize(torch.float64)
    wgu = quantize(module.gate_up_proj.detach(), cfg.weight, backend="torch").dequantize(torch.float64)
    wdn = quantize(module.down_proj.detach(), cfg.weight, backend="torch").dequantize(torch.float64)
    e_sorted = flat[order]
    gu = torch.stack([xq[t] @ wgu[e].T for t, e in zip(token, e_sorted)]).to(hidden.dtype)
    g, u = gu.chunk(2, -1)
    h = module.act_fn(g) * u
    hq = quantize(h, cfg.activation, backend="torch").dequantize(torch.float64)
    out = torch.stack([hq[r] @ wdn[e].T for r, e in enumerate(e_sorted)])
    out = out * weights.reshape(-1)[order, None].double()
    return torch.zeros(hidden.shape, dtype=torch.float64, device=hidden.device).index_add_(0, token, out)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_nvfp4_experts_match_per_expert_loop(backend):
    model = _tiny_moe(seed=1).to(DEV)
    convert_experts(model, NVFP4MoEConfig(gemm_backend=backend))
    experts = model.model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(11, 32, generator=gen).to(DEV)
    idx = torch.tensor([[0, 2]] * 5 + [[2, 3]] * 6, device=DEV)  # expert 1 receives nothing
    weights = torch.rand(11, 2, generator=gen).to(DEV)
    y = experts(hidden, idx, weights)
    ref = _reference_experts(experts, hidden, idx, weights)
    torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_bad_expert_ids_raise():
    model = _tiny_moe()
    convert_experts(model)
    experts = model.model.layers[0].mlp.experts
    with pytest.raises(ValueError, match=r"expert_ids\[1, 0\] = 4 is outside \[0, 4\)"):
        experts(torch.randn(2, 32), torch.tensor([[0, 1], [4, 1]]), torch.rand(2, 2))


def test_bad_shapes_raise():
    model = _tiny_moe()
    convert_experts(model)
    experts = model.model.layers[0].mlp.experts
    h, idx, w = torch.randn(6, 32), torch.randint(0, 4, (6, 2)), torch.rand(6, 2)
    with pytest.raises(ValueError, match=r"hidden_states must be \[T, 32\], got \(2, 3, 32\)"):
        experts(h.reshape(2, 3, 32), idx.reshape(2, 3, 2), w.reshape(2, 3, 2))
    with pytest.raises(ValueError, match=r"top_k_index must be \[T, k\] with T = 6 .*got \(8, 2\)"):
        experts(h, torch.zeros(8, 2, dtype=torch.long), torch.rand(8, 2))
    with pytest.raises(
        ValueError, match=r"top_k_weights must have top_k_index's shape \(6, 2\), got \(6, 3\)"
    ):
        experts(h, idx, torch.rand(6, 3))


@pytest.mark.parametrize("mode", ["bf16-backward", "nvfp4-backward"])
def test_zero_tokens_give_an_empty_output(mode):
    model = _tiny_moe()
    convert_experts(model, NVFP4MoEConfig(backward=mode, weight=QuantRecipe(scale="expert", block="16x16")))
    experts = model.model.layers[0].mlp.experts
    h = torch.randn(0, 32, requires_grad=True)
    w = torch.rand(0, 2, requires_grad=True)
    y = experts(h, torch.zeros(0, 2, dtype=torch.long), w)
    assert y.shape == (0, 32) and y.dtype == h.dtype
    y.sum().backward()
    assert h.grad.shape == h.shape and w.grad.shape == w.shape
    for p in (experts.gate_up_proj, experts.down_proj):
        assert p.grad is not None and p.grad.shape == p.shape and not p.grad.any()


@pytest.mark.parametrize("mode", ["bf16-backward", "dequantized", "nvfp4-backward"])
def test_gradient_checkpointing_gives_the_same_gradients(mode):
    """Non-reentrant checkpointing (HF's default) unpacks saved tensors once: the backward must too."""
    from torch.utils.checkpoint import checkpoint

    model = _tiny_moe()
    convert_experts(model, NVFP4MoEConfig(backward=mode, weight=QuantRecipe(scale="expert", block="16x16")))
    experts = model.model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(12, 32, generator=gen)
    idx = torch.randint(0, 4, (12, 2), generator=gen)
    w = torch.rand(12, 2, generator=gen)
    grads = []
    for wrap in (False, True):
        experts.zero_grad()
        y = checkpoint(experts, h, idx, w, use_reentrant=False) if wrap else experts(h, idx, w)
        y.square().sum().backward()
        grads.append([p.grad.clone() for p in (experts.gate_up_proj, experts.down_proj)])
    for plain, ckpt in zip(*grads):
        if mode == "nvfp4-backward":  # stochastic rounding draws anew per backward call: close, not equal
            assert torch.isfinite(ckpt).all() and (ckpt - plain).norm() < 0.3 * plain.norm()
        else:
            torch.testing.assert_close(ckpt, plain, rtol=0, atol=0)


def test_convert_back_restores_the_original_experts_with_the_same_parameters():
    model = _tiny_moe()
    original = model.model.layers[0].mlp.experts
    convert_experts(model)
    converted = model.model.layers[0].mlp.experts
    assert isinstance(converted, NVFP4MoeExperts)
    assert unconvert(model) is model and _experts(model) == []
    back = model.model.layers[0].mlp.experts
    assert back is original and back.gate_up_proj is converted.gate_up_proj


def test_expert_weight_cache_is_not_fooled_by_a_reused_address():
    """A replaced ``param.data`` whose new storage lands on the freed address (same version, shape and
    dtype) must be quantized anew: the cache holds the keyed storage so that address cannot be reused."""
    cache, recipe = _WeightCache(), QuantRecipe(scale="expert")
    w = torch.nn.Parameter(torch.randn(4, 16, 32))
    with torch.no_grad():
        for _ in range(20):
            cache.get(w, recipe, False, "auto")
            old_ptr = w.data_ptr()
            w.data = torch.randn_like(w)  # the old storage is freed (if unreferenced)
            new = [torch.randn_like(w) for _ in range(8)]  # the allocator tends to hand it back
            w.data = next((t for t in new if t.data_ptr() == old_ptr), new[0])
            del new
            wq = cache.get(w, recipe, False, "auto").wq
            assert torch.equal(wq.data, quantize(w.detach(), recipe, backend="torch").data)


@pytest.mark.parametrize("mode", ["dequantized", "bf16-backward", "nvfp4-backward"])
def test_converted_model_trains_and_generates(mode):
    model = _tiny_moe(seed=3)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref_logits = model(ids).logits
    weight = QuantRecipe(scale="expert", block="16x16")
    convert_experts(model, NVFP4MoEConfig(backward=mode, gemm_backend="reference", weight=weight))  # CPU path
    with torch.no_grad():
        logits = model(ids).logits
    assert ((logits - ref_logits).abs().max() / ref_logits.abs().max()) < 0.05  # NVFP4 error, not garbage
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    losses = []
    for _ in range(6):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        grads = [
            model.model.layers[0].mlp.experts.gate_up_proj.grad,
            model.model.layers[0].mlp.gate.weight.grad,
        ]
        assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses
    out = model.generate(ids[:1, :4], max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 8) and out[0, :4].equal(ids[0, :4])


W16 = QuantRecipe(scale="expert", block="16x16")


def test_nvfp4_backward_needs_16x16_expert_weights():
    with pytest.raises(ValueError, match="16x16"):
        NVFP4MoEConfig(backward="nvfp4-backward")
    with pytest.raises(ValueError, match="Hadamard"):
        NVFP4MoEConfig(backward="nvfp4-backward", weight=W16, grad=QuantRecipe(hadamard=True))
    NVFP4MoEConfig(backward="nvfp4-backward", weight=W16)


def test_transpose_16x16_per_expert_equals_quantizing_the_transpose():
    w = torch.randn(3, 32, 48, generator=torch.Generator().manual_seed(7))
    w[1, :16, 16:32] = 0.0  # a zero tile
    t = transpose_16x16(quantize(w, W16))
    direct = quantize(w.transpose(1, 2).contiguous(), W16)
    assert t.shape == direct.shape == (3, 48, 32)
    assert torch.equal(t.data, direct.data)
    assert torch.equal(t.scale.view(torch.uint8), direct.scale.view(torch.uint8))
    assert torch.equal(t.global_scale, direct.global_scale)


def _routed(seed, T=20, E=4, k=2, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, E - 1, (T, k), generator=gen).to(device)  # expert E-1 receives no token
    order, offsets = offsets_from_expert_ids(idx, E)
    return order // k, offsets


def _grads(cfg, x, w, gather, offsets, dy):
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    grouped_nvfp4_linear(x, w, offsets, cfg, gather, _WeightCache()).backward(dy)
    return x.grad, w.grad


@pytest.mark.parametrize("backend", ["reference", "triton_expanded", "triton"])
def test_nvfp4_backward_matches_reference_with_nearest_rounding(backend):
    gen = torch.Generator().manual_seed(8)
    gather, offsets = _routed(9, device=DEV)
    x, w = torch.randn(20, 32, generator=gen).to(DEV), torch.randn(4, 48, 32, generator=gen).to(DEV)
    dy = torch.randn(gather.numel(), 48, generator=gen).to(DEV)
    grad = QuantRecipe()  # nearest: a deterministic reference
    wgrad = QuantRecipe(hadamard=True, pad=True)
    cfg = NVFP4MoEConfig(backward="nvfp4-backward", weight=W16, grad=grad, wgrad=wgrad, gemm_backend=backend)
    dx, dw = _grads(cfg, x, w, gather, offsets, dy)
    # dgrad: Q(dy)[r] · Q(W)[e(r)], rows scattered back to their tokens
    dyq = dequantize(quantize(dy, grad)).double()
    wq = dequantize(quantize(w, W16)).double()
    bounds = offsets.tolist()
    dx_rows = torch.cat([dyq[s:t] @ wq[e] for e, (s, t) in enumerate(zip(bounds[:-1], bounds[1:]))])
    ref_dx = torch.zeros(20, 32, dtype=torch.float64, device=DEV).index_add_(0, gather, dx_rows)
    assert ((dx.double() - ref_dx).abs().max() / ref_dx.abs().max()) < 1e-5
    # wgrad: Q_H(dyᵀ), Q_H(xᵀ) quantized once over the padded token layout (one amax per operand, x side
    # always nearest), then per expert the product over its padded columns; the empty expert gets exactly 0
    dyt, starts = _padded_layout(dy, bounds)
    xt, _ = _padded_layout(x[gather], bounds)
    dyv = quantize(dyt, wgrad).dequantize(torch.float64)
    xv = quantize(xt, wgrad).dequantize(torch.float64)
    for e, (s, t) in enumerate(zip(starts[:-1], starts[1:])):
        if s == t:
            assert torch.equal(dw[e], torch.zeros_like(dw[e]))
            continue
        ref = dyv[:, s:t] @ xv[:, s:t].T
        assert ((dw[e].double() - ref).abs().max() / ref.abs().max()) < 1e-5, e


def _padded_layout(rows, bounds):
    """[C, L]: expert e's rows (bounds[e]..bounds[e+1]) as columns from a multiple of 16 on, zeros between
    segments and in the tail, L = ceil16(T + 15·E) (the static bound). Returns it and the segment starts."""
    T, E = rows.shape[0], len(bounds) - 1
    out = torch.zeros(-(-(T + 15 * E) // 16) * 16, rows.shape[1], dtype=rows.dtype, device=rows.device)
    starts = [0]
    for s, t in zip(bounds[:-1], bounds[1:]):
        out[starts[-1] : starts[-1] + t - s] = rows[s:t]
        starts.append(starts[-1] + -(-(t - s) // 16) * 16)
    return out.t().contiguous(), starts


def test_nvfp4_backward_defaults_approximate_the_exact_gradient():
    gen = torch.Generator().manual_seed(10)
    gather, offsets = _routed(11, T=64)
    x, w = torch.randn(64, 32, generator=gen), torch.randn(4, 48, 32, generator=gen)
    dy = torch.randn(gather.numel(), 48, generator=gen)
    exact = _grads(NVFP4MoEConfig(weight=W16, gemm_backend="reference"), x, w, gather, offsets, dy)
    fp4 = _grads(
        NVFP4MoEConfig(backward="nvfp4-backward", weight=W16, gemm_backend="reference"),
        x,
        w,
        gather,
        offsets,
        dy,
    )
    for a, b in zip(fp4, exact):
        rel = ((a - b).norm() / b.norm()).item()
        assert 0 < rel < 0.3, rel  # FP4 (stochastic) noise, not a wrong or transposed gradient
