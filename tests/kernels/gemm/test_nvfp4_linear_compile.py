"""NVFP4Linear under ``torch.compile(fullgraph=True)``: the layer compiles to its ``torch.library`` custom ops
(``triage::nvfp4_linear`` and its backward) and gives the eager bits, outputs and gradients, step after
step of fused AdamW (which writes the weights without bumping their version: the weight cache follows)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from _train_step import train_step
from torch import nn

from triage.kernels import NVFP4Linear, NVFP4LinearConfig


def _model(backward: str) -> nn.Module:
    torch.manual_seed(0)
    cfg = NVFP4LinearConfig(backward=backward)
    return nn.Sequential(NVFP4Linear(32, 48, config=cfg), nn.GELU(), NVFP4Linear(48, 16, config=cfg))


@pytest.mark.parametrize(
    "backward, backend", [("bf16-backward", "eager"), ("nvfp4-backward", "aot_eager")]
)  # aot_eager traces the backward op through its fake too (slower to compile: once here)
def test_compiled_model_matches_eager_bit_for_bit(backward, backend):
    eager = _model(backward)
    compiled_model = copy.deepcopy(eager)  # a copy is a layer of its own (own op id, cache, counters)
    assert int(compiled_model[0]._op_id) != int(eager[0]._op_id)
    compiled = torch.compile(compiled_model, backend=backend, fullgraph=True)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2, fused=True)
    opt_c = torch.optim.AdamW(compiled_model.parameters(), lr=1e-2, fused=True)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x, dy = torch.randn(2, 8, 32, generator=g), torch.randn(2, 8, 16, generator=g)
        # a model converted afresh from the current weights: the compiled one must not serve a stale W_q
        fresh = copy.deepcopy(compiled_model)
        for m in fresh:
            if isinstance(m, NVFP4Linear):
                m.invalidate_cache()
        with torch.no_grad():
            y_fresh = fresh(x)
        y_e, grads_e = train_step(eager, opt_e, x, dy)
        y_c, grads_c = train_step(compiled, opt_c, x, dy)
        assert torch.equal(y_e, y_c) and torch.equal(y_c, y_fresh), step
        for a, b in zip(grads_e, grads_c):
            assert torch.equal(a, b), step
    cache = compiled_model[0]._weight_cache
    x = x.requires_grad_()  # the compiled graph's signature: no recompile
    compiled(x)
    hits = cache.hits
    compiled(x)
    assert cache.hits == hits + 1  # no weight update since the last call: W_q served from the cache


def test_the_custom_op_is_what_compiles():
    """The compiled graph holds the layer as the custom op (no graph break, no inlined kernels)."""
    model = _model("bf16-backward")
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(model, backend=backend, fullgraph=True)(torch.randn(4, 32))
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.triage.nvfp4_linear.default) == 2


def test_layers_of_one_signature_share_one_graph():
    """Each layer compiled on its own (regional compilation), more layers than dynamo's recompile limit:
    the layer's op id is a graph input, not a constant, so all of them run one graph (no recompile, no
    eager fallback) and give the eager bits, outputs and gradients."""
    torch._dynamo.reset()  # the compiled code of NVFP4Linear.forward is shared with the other tests
    torch.manual_seed(0)
    limit = getattr(torch._dynamo.config, "recompile_limit", None) or torch._dynamo.config.cache_size_limit
    n_layers = limit + 2  # (recompile_limit: torch >= 2.7; cache_size_limit before)
    layers = [NVFP4Linear(32, 48) for _ in range(n_layers)]
    copies = copy.deepcopy(layers)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    x, dy = torch.randn(4, 32), torch.randn(4, 48)
    for eager, layer in zip(layers, copies):
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_e = eager(xe)
        y_c = torch.compile(layer, backend=backend, fullgraph=True)(xc)
        y_e.backward(dy)
        y_c.backward(dy)
        assert torch.equal(y_e, y_c)
        assert torch.equal(xe.grad, xc.grad) and torch.equal(eager.weight.grad, layer.weight.grad)
        assert torch.equal(eager.bias.grad, layer.bias.grad)
    assert len(graphs) == 1
    torch._dynamo.reset()


def test_op_checks():
    """The ops pass torch.library's own consistency checks (schema, fake vs real, autograd)."""
    layer = NVFP4Linear(32, 48, config=dataclasses.replace(NVFP4LinearConfig(), backward="nvfp4-backward"))
    x = torch.randn(4, 32, requires_grad=True)
    torch.library.opcheck(
        torch.ops.triage.nvfp4_linear.default, (x, layer.weight, layer.bias, layer._op_id, True),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )  # fmt: skip


@pytest.mark.skipif(
    not hasattr(torch.Tag, "cudagraph_unsafe"), reason="this torch has no cudagraph_unsafe tag"
)
def test_cuda_graphs_leave_the_ops_out():
    """The ops keep the weight cache and the rounding counter outside any graph: a CUDA graph replay would
    skip them, so they are tagged ``cudagraph_unsafe`` (torch.compile's "reduce-overhead" leaves them out)."""
    for op in (torch.ops.triage.nvfp4_linear.default, torch.ops.triage.nvfp4_linear_backward.default):
        assert torch.Tag.cudagraph_unsafe in op.tags


def test_the_frozen_op_quantizes_an_input_buffer_rewritten_without_a_version_bump():
    """Compiled code writes and reuses its buffers without bumping their version counters (inductor hands a
    dead buffer's storage, the same tensor object, to a later op): the frozen W4A4 op quantizes its input per
    call, so a second layer called on a buffer rewritten since the first one's call never reads the first
    call's x_q. (The NVFP4Linear ops never share outside a sibling group: tests/kernels/gemm/test_siblings.py.)"""
    from triage.kernels import NVFP4Config, convert
    from triage.kernels.nvfp4 import QuantRecipe

    torch.manual_seed(0)
    recipe = QuantRecipe(scale="row", profile="compressed-tensors")
    two = convert(
        nn.Sequential(nn.Linear(32, 16), nn.Linear(32, 16)), NVFP4Config.from_recipe(recipe, frozen="w4a4")
    )
    buf = torch.randn(4, 32)
    with torch.no_grad():
        torch.ops.triage.frozen_nvfp4_linear(buf, two[0]._op_id, 16)
        version = buf._version
        buf.data.copy_(torch.randn(4, 32))  # a write that bypasses the version counter, as compiled code's
        assert buf._version == version
        assert torch.equal(torch.ops.triage.frozen_nvfp4_linear(buf, two[1]._op_id, 16), two[1](buf.clone()))


def test_every_op_takes_its_input_as_inductor_lays_it_out():
    """Each custom op carries ``flexible_layout`` (inductor then hands sibling layers one input buffer, not a
    copy each, tests/kernels/gemm/test_siblings.py)."""
    import triage.kernels.frozen_linear  # noqa: F401 - registers its op

    names = ["nvfp4_linear", "nvfp4_linear_backward", "nvfp4_linear_capturable", "nvfp4_linear_capturable_backward",
             "frozen_nvfp4_linear"]  # fmt: skip
    for name in names:
        assert torch.Tag.flexible_layout in getattr(torch.ops.triage, name).default.tags, name
