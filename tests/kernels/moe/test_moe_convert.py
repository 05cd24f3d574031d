"""Qwen3-MoE (transformers 5.x fused experts) conversion to NVFP4 experts: semantics, training, generation."""

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from triage.kernels.moe.experts import MoEQuantConfig, NVFP4MoeExperts, convert_moe_experts
from triage.kernels.nvfp4.api import quantize


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


def test_conversion_keeps_parameters_keys_and_router():
    model = _tiny_moe()
    keys = list(model.state_dict())
    before = {n: p for n, p in model.named_parameters()}
    router_type = type(model.model.layers[0].mlp.gate)
    names = convert_moe_experts(model)
    assert names == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert isinstance(model.model.layers[1].mlp.experts, NVFP4MoeExperts)
    assert type(model.model.layers[0].mlp.gate) is router_type  # router stays high precision
    assert list(model.state_dict()) == keys
    assert all(p is before[n] for n, p in model.named_parameters())
    assert convert_moe_experts(model) == []  # idempotent


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
    return torch.zeros(hidden.shape, dtype=torch.float64).index_add_(0, token, out)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_nvfp4_experts_match_per_expert_loop(backend):
    model = _tiny_moe(seed=1)
    convert_moe_experts(model, MoEQuantConfig(backend=backend))
    experts = model.model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(11, 32, generator=gen)
    idx = torch.tensor([[0, 2]] * 5 + [[2, 3]] * 6)  # expert 1 receives nothing
    weights = torch.rand(11, 2, generator=gen)
    y = experts(hidden, idx, weights)
    ref = _reference_experts(experts, hidden, idx, weights)
    torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_bad_expert_ids_raise():
    model = _tiny_moe()
    convert_moe_experts(model)
    experts = model.model.layers[0].mlp.experts
    with pytest.raises(ValueError, match=r"expert_ids\[1, 0\] = 4 is outside \[0, 4\)"):
        experts(torch.randn(2, 32), torch.tensor([[0, 1], [4, 1]]), torch.rand(2, 2))


@pytest.mark.parametrize("mode", ["dequantized", "bf16-backward"])
def test_converted_model_trains_and_generates(mode):
    model = _tiny_moe(seed=3)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref_logits = model(ids).logits
    convert_moe_experts(model, MoEQuantConfig(backward=mode, backend="reference"))  # CPU path
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
