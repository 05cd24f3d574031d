"""What a kept CUDA graph of a model's forward may rely on (:mod:`triage.kernels.capture`).

``keep_weight_addresses``: an ``NVFP4Linear`` re-quantizes each new weight into the tensors it cached
(same addresses), with the bits a fresh layer quantizes; ``graph_key`` stays equal across such refreshes and
in-place writes and changes when anything a capture read is reallocated or a config changes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from triage.kernels import NVFP4Config, NVFP4Linear, NVFP4LinearConfig, convert
from triage.kernels.capture import graph_key, keep_weight_addresses
from triage.kernels.linear import _entry_tensors
from triage.kernels.nvfp4 import QuantRecipe

CFG = NVFP4LinearConfig(quant_backend="torch", gemm_backend="reference")
# weight recipe, backward (nvfp4-backward: 16x16 weight tiles, W_qᵀ cached too)
CASES = {
    "tensor": (QuantRecipe(), "bf16-backward"),
    "row": (QuantRecipe(scale="row", profile="compressed-tensors"), "bf16-backward"),
    "16x16-nvfp4-backward": (QuantRecipe(block="16x16"), "nvfp4-backward"),
}


def _addresses(layer):
    return [None if t is None else t.data_ptr() for t in _entry_tensors(layer._weight_cache.entry)]


def _fresh(layer):
    lin = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
    lin.load_state_dict(layer.state_dict(), strict=False)
    return NVFP4Linear.from_linear(lin, layer.config)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("update", ["load_state_dict", "adamw-fused"])
def test_kept_addresses_take_each_new_weight_in_place_with_fresh_bits(case, update):
    torch.manual_seed(0)
    recipe, backward = CASES[case]
    config = dataclasses.replace(CFG, weight=recipe, backward=backward)
    layer = NVFP4Linear(64, 48, config=config)
    assert keep_weight_addresses(layer) == 1
    x = torch.randn(5, 64)
    with torch.no_grad():
        layer(x)
    addresses, key = _addresses(layer), graph_key(layer)
    opt = torch.optim.AdamW(layer.parameters(), lr=0.05, fused=True)
    for step in range(3):
        token = layer._decode_weight()[2]
        if update == "load_state_dict":  # a sampler sync
            with torch.no_grad():
                state = {k: v + 0.01 * (step + 1) for k, v in layer.state_dict().items()}
            layer.load_state_dict(state)
        else:  # no version bump: the optimizer-step generation tells
            layer(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            y, fresh = layer(x), _fresh(layer)
            assert torch.equal(y, fresh(x))
        fresh_q, mine = fresh._weight_cache.entry, layer._weight_cache.entry
        for a, b in zip(_entry_tensors(mine), _entry_tensors(fresh_q)):
            assert (a is None) == (b is None)
            assert a is None or torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        assert _addresses(layer) == addresses and graph_key(layer) == key
        assert layer._decode_weight()[2] != token  # a sibling output kept from before is not handed out


def test_without_kept_addresses_a_new_weight_gets_new_tensors_and_a_new_key():
    torch.manual_seed(0)
    layer = NVFP4Linear(32, 16, config=CFG)
    with torch.no_grad():
        layer(torch.randn(2, 32))
        held = layer.quantized_weight()
        before, addresses, key = held.data.clone(), _addresses(layer), graph_key(layer)
        layer.weight.add_(0.5)
        layer(torch.randn(2, 32))
    assert torch.equal(held.data, before)  # what a caller holds keeps its values
    assert _addresses(layer) != addresses and graph_key(layer) != key


def test_graph_key_names_every_address_and_config_a_capture_reads():
    model = nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 16))
    convert(model, NVFP4Config(linear=CFG, skip=()))
    keep_weight_addresses(model)
    with torch.no_grad():
        model(torch.randn(3, 32))
    key = graph_key(model)
    with torch.no_grad():  # in place: same addresses
        model[1].weight.mul_(2)
        model[0].weight.add_(1)
    assert graph_key(model) == key
    model[1].bias = nn.Parameter(model[1].bias.detach().clone())  # reallocated
    assert graph_key(model) != key
    key = graph_key(model)
    model[2].config = dataclasses.replace(CFG, share_inputs=not CFG.share_inputs)
    assert graph_key(model) != key
    key = graph_key(model)
    model[1].register_buffer("extra", torch.zeros(2))
    assert graph_key(model) != key


def test_the_key_refreshes_a_stale_weight_cache_first():
    """Before the first forward (or after a weight update not yet seen by one) the key quantizes, as the
    forward would: the key taken then equals the key after the forward."""
    layer = NVFP4Linear(32, 16, config=CFG)
    key = graph_key(layer)
    with torch.no_grad():
        layer(torch.randn(2, 32))
    assert graph_key(layer) == key


def test_a_host_read_decode_scale_is_in_the_key_by_value():
    """A cuBLAS-alpha GEMM (more than SMALL_M rows) reads W_q's decode scale to the host and a capture bakes
    it in: an in-place refresh reads the new one at once (the key compares values), so a refresh that
    changes it changes the key (the graph is captured anew) and one that keeps it keeps the key."""
    torch.manual_seed(0)
    layer = NVFP4Linear(32, 16, config=CFG)
    keep_weight_addresses(layer)
    with torch.no_grad():
        layer(torch.randn(2, 32))
    entry = layer._weight_cache.entry
    entry.host_scale()  # what a large forward reads
    key = graph_key(layer)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.load_state_dict({k: 1.5 * v for k, v in state.items()})
    assert graph_key(layer) != key  # refreshed in place, the new scale read
    assert layer._weight_cache.entry is entry and entry.scale_host == float(entry.quantized.global_scale)
    layer.load_state_dict(state)  # a sync back to the first weights: the first scale, the first key
    assert graph_key(layer) == key
    unread = NVFP4Linear(32, 16, config=CFG)  # a scale never read stays unread through refreshes
    keep_weight_addresses(unread)
    graph_key(unread)
    unread.load_state_dict({k: 1.5 * v for k, v in unread.state_dict().items()})
    graph_key(unread)
    assert unread._weight_cache.entry.scale_host is None


def test_train_mode_and_peft_switches_are_in_the_key():
    from peft import LoraConfig, get_peft_model

    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    model = get_peft_model(model, LoraConfig(r=2, target_modules=["0"]))
    model.eval()
    key = graph_key(model)
    model.train()
    assert graph_key(model) != key
    model.eval()
    assert graph_key(model) == key
    with model.disable_adapter():
        assert graph_key(model) != key
    assert graph_key(model) == key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [16, 128])  # the decode kernel (device scales) / cuBLAS alpha (a host scale)
def test_a_kept_graph_replays_a_refreshed_weight_or_its_key_changes(rows):
    """After an in-place refresh a captured forward either reads the new weight (same key, replay == eager) or,
    where the capture baked the old decode scale in (a cuBLAS alpha GEMM), the key changed."""
    torch.manual_seed(0)
    static = QuantRecipe(scale_source="static", static_amax=4.0)
    layer = NVFP4Linear(1024, 1024, config=NVFP4LinearConfig(activation=static)).cuda().to(torch.bfloat16)
    keep_weight_addresses(layer)
    x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        layer(x)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            layer(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x)
        key = graph_key(layer)
        layer.load_state_dict({k: v * 1.5 for k, v in layer.state_dict().items()})
        eager = layer(x)
        graph.replay()
        torch.cuda.synchronize()
    if rows <= 64:
        assert graph_key(layer) == key and torch.equal(out, eager)
    else:
        assert layer._weight_cache.entry.scale_host is not None and graph_key(layer) != key
