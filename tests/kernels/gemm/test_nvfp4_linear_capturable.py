"""``NVFP4LinearConfig(capturable=True)``: W quantized on the device at every call, GEMMs that read no outer
scale on the host, stochastic-rounding seeds drawn by the forward on the device; the bits of the cached layer,
eager and compiled, step after step of AdamW; under torch.compile an op CUDA graphs may capture (no CPU
tensor, no per-layer constant in its graph)."""

from __future__ import annotations

import copy
import dataclasses
import importlib

import pytest
import torch
from _dense_operands import device
from _train_step import train_step
from torch import nn

from triage.kernels import NVFP4Linear, NVFP4LinearConfig
from triage.kernels.nvfp4 import QuantRecipe
from triage.kernels.nvfp4.device import interpreting

BACKWARDS = ("bf16-backward", "nvfp4-backward")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test's compilations count alone against dynamo's recompile limit (nn.Sequential's compiled code
    is shared with every other test that compiles one)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _pair(backward: str, gelu: bool = True, device=None, dtype=None, **config):
    """Two-layer models, cached and capturable, with the same weights (copies: layers of their own)."""
    torch.manual_seed(0)
    cfg = NVFP4LinearConfig(backward=backward, **config)
    between = [nn.GELU()] if gelu else []
    cached = nn.Sequential(NVFP4Linear(32, 48, config=cfg), *between, NVFP4Linear(48, 16, config=cfg))
    cached = cached.to(device, dtype)
    capturable = copy.deepcopy(cached)
    for m in capturable:
        if isinstance(m, NVFP4Linear):
            m.config = dataclasses.replace(cfg, capturable=True)
    return cached, capturable


def _adamw(model):
    try:
        return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    except RuntimeError:  # no fused AdamW for this device
        return torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)


@pytest.mark.parametrize(
    "backward, rows, backend",
    [("bf16-backward", 8, None), ("nvfp4-backward", 8, None), ("bf16-backward", 8, "aot_eager"),
     ("nvfp4-backward", 8, "aot_eager"), ("nvfp4-backward", 8, "inductor"), ("nvfp4-backward", 40, None)],
)  # fmt: skip
def test_capturable_gives_the_cached_bits(backward, rows, backend):
    """Outputs and every gradient equal the cached layer's bit for bit over three fused-AdamW steps (the
    weights change: a stale W_q would show; nvfp4-backward: the stochastic-rounding seeds must advance as
    the cached layer's do), eager and compiled (``fullgraph=True``; under inductor both models are compiled:
    inductor's GELU rounds unlike eager's). 2×40 rows: the GEMMs on expansions (with
    ``gemm_backend="triton"`` in both: the cached layer's ``"auto"`` takes cuBLAS's host alpha there, which
    the capturable one leaves for the Triton GEMM)."""
    cached, capturable = _pair(backward, device=device(), **({"gemm_backend": "triton"} if rows > 32 else {}))
    run_a = torch.compile(cached, backend=backend, fullgraph=True) if backend == "inductor" else cached
    run_b = torch.compile(capturable, backend=backend, fullgraph=True) if backend else capturable
    opt_a, opt_b = _adamw(cached), _adamw(capturable)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x, dy = torch.randn(2, rows, 32, generator=g), torch.randn(2, rows, 16, generator=g)
        x, dy = x.to(device()), dy.to(device())
        y_a, grads_a = train_step(run_a, opt_a, x, dy)
        y_b, grads_b = train_step(run_b, opt_b, x, dy)
        assert torch.equal(y_a, y_b), step
        for a, b in zip(grads_a, grads_b):
            assert torch.equal(a, b), step
    assert capturable[0]._weight_cache.misses == 0  # never consulted
    if backward == "nvfp4-backward":  # the seeds' count lives on the device, the host count is untouched
        assert capturable[0]._grad_calls == [0] and capturable[0]._sr_calls.tolist() == [6, 7]


def test_the_capturable_op_is_what_compiles():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    _, capturable = _pair("bf16-backward")
    torch.compile(capturable, backend=backend, fullgraph=True)(torch.randn(4, 32))
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.triage.nvfp4_linear_capturable.default) == 2
    assert torch.ops.triage.nvfp4_linear.default not in targets


@pytest.mark.skipif(
    not hasattr(torch.Tag, "cudagraph_unsafe"), reason="this torch has no cudagraph_unsafe tag"
)
def test_only_the_cached_ops_are_cudagraph_unsafe():
    """CUDA graphs (torch.compile's "reduce-overhead") leave out the cached layer's ops, whose weight-cache
    check is Python a replay would skip, and may capture the capturable layer's; both backwards are
    ``nondeterministic_seeded`` (their seeds change per call)."""
    ops = torch.ops.triage
    for op in (ops.nvfp4_linear.default, ops.nvfp4_linear_backward.default):
        assert torch.Tag.cudagraph_unsafe in op.tags
    for op in (ops.nvfp4_linear_capturable.default, ops.nvfp4_linear_capturable_backward.default):
        assert torch.Tag.cudagraph_unsafe not in op.tags
    for op in (ops.nvfp4_linear_backward.default, ops.nvfp4_linear_capturable_backward.default):
        assert torch.Tag.nondeterministic_seeded in op.tags


def test_capturable_op_checks():
    config = NVFP4LinearConfig(backward="nvfp4-backward", capturable=True)
    layer = NVFP4Linear(32, 48, config=config)
    x = torch.randn(4, 32, requires_grad=True)
    seeds = torch.tensor([2, 3])  # what the layer draws for its first backward
    torch.library.opcheck(
        torch.ops.triage.nvfp4_linear_capturable.default,
        (x, layer.weight, layer.bias, seeds, config._op_key),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )  # fmt: skip


def _graph_tensors(gm) -> list:
    """The fake values of an AOT graph's inputs and outputs (what a cudagraph partition takes and gives)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    outputs = [a for a in out.args[0] if isinstance(a, torch.fx.Node)]
    nodes = [n for n in gm.graph.nodes if n.op == "placeholder"] + outputs
    return [n.meta["val"] for n in nodes if isinstance(n.meta.get("val"), torch.Tensor)]


@pytest.mark.parametrize("backward", BACKWARDS)
def test_the_compiled_graph_holds_no_op_id_and_layers_share_it(backward):
    """Under torch.compile the capturable layer passes its op no CPU tensor and no per-layer constant: no
    0-d int64 tensor (the cached layer's op id) among the inputs or outputs of the AOT forward and backward
    graphs (on a GPU a CPU tensor there made ``mode="reduce-overhead"`` refuse the graph: "Expected all cuda
    outputs in cuda graph recording"), no layer's op id among dynamo's graph inputs; and more same-shape
    layers than dynamo's recompile limit, each compiled on its own with an equal config of its own
    (regional compilation), run one graph and give the eager cached layer's bits."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    aot_graphs, dynamo_inputs = [], []

    def record(gm, example_inputs):
        aot_graphs.append(_graph_tensors(gm))
        return make_boxed_func(gm.forward)

    aot = aot_autograd(fw_compiler=record, bw_compiler=record)

    def backend(gm, example_inputs):
        dynamo_inputs.append(list(example_inputs))
        return aot(gm, example_inputs)

    torch.manual_seed(0)
    limit = getattr(torch._dynamo.config, "recompile_limit", None) or torch._dynamo.config.cache_size_limit
    cached = [NVFP4Linear(32, 48, config=NVFP4LinearConfig(backward=backward)) for _ in range(limit + 2)]
    layers = copy.deepcopy(cached)
    for layer in layers:  # an equal config of its own per layer
        layer.config = NVFP4LinearConfig(backward=backward, capturable=True)
    g = torch.Generator().manual_seed(1)
    for a, b in zip(cached, layers):
        x, dy = torch.randn(4, 32, generator=g), torch.randn(4, 48, generator=g)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = a(xa), torch.compile(b, backend=backend, fullgraph=True)(xb)
        ya.backward(dy)
        yb.backward(dy)
        assert torch.equal(ya, yb)
        assert torch.equal(xa.grad, xb.grad) and torch.equal(a.weight.grad, b.weight.grad)
        assert torch.equal(a.bias.grad, b.bias.grad)
    assert len(dynamo_inputs) == 1 and len(aot_graphs) == 2  # one graph: forward and backward
    op_ids = {layer._op_id.data_ptr() for layer in layers}
    assert not any(t.data_ptr() in op_ids for t in dynamo_inputs[0] if isinstance(t, torch.Tensor))
    for tensors in aot_graphs:
        assert not [t for t in tensors if t.dim() == 0 and t.dtype == torch.int64], tensors


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_seeds_are_drawn_by_a_forward_a_backward_can_follow(monkeypatch, backend):
    """A capturable layer's nvfp4-backward seeds are drawn at the forward (the count advances there, before
    the backward), and only where a backward can follow: grad mode on and x, W or b requiring grad. A
    no-grad forward, one with nothing requiring grad, and any bf16-backward forward draw nothing."""
    # ``requires_grad_`` below flips the parameters' flag in place. Dynamo before pytorch/pytorch#177158
    # (torch 2.11 among them) takes a parameter for immutable while its module's ``_parameters`` dict keeps
    # its tag, skips its tensor guards (requires_grad too) and reruns the graph traced with nothing requiring
    # grad, which draws nothing. The rule under test is the layer's: keep those guards on every torch.
    if hasattr(torch._dynamo.config, "skip_tensor_guards_with_matching_dict_tags"):
        monkeypatch.setattr(torch._dynamo.config, "skip_tensor_guards_with_matching_dict_tags", False)
    cfg = NVFP4LinearConfig(backward="nvfp4-backward", capturable=True)
    layer = NVFP4Linear(32, 48, config=cfg)
    run = torch.compile(layer, backend=backend, fullgraph=True) if backend else layer
    x, dy = torch.randn(4, 32), torch.randn(4, 48)
    with torch.no_grad():
        run(x)
    assert layer._sr_calls.tolist() == [0, 1]
    layer.requires_grad_(False)
    run(x)
    assert layer._sr_calls.tolist() == [0, 1]
    layer.requires_grad_(True)
    y = run(x)  # W and b require grad
    assert layer._sr_calls.tolist() == [2, 3]
    y.backward(dy)
    assert layer._sr_calls.tolist() == [2, 3] and layer._grad_calls == [0]
    bf16 = NVFP4Linear(32, 48, config=dataclasses.replace(cfg, backward="bf16-backward"))
    run = torch.compile(bf16, backend=backend, fullgraph=True) if backend else bf16
    run(x.clone().requires_grad_()).backward(dy)
    assert bf16._sr_calls.tolist() == [0, 1]


@pytest.mark.parametrize("backend", [None, "aot_eager"])
@pytest.mark.parametrize("trainable", ["x", "bias"])
def test_a_partly_frozen_layer_draws_and_matches_the_cached_layer(backend, trainable):
    """Only some inputs need a gradient — a frozen W with x requiring grad (LoRA's base, a layer above a
    trainable one), or the bias alone: the capturable layer still draws at the forward, and over two steps
    its outputs and gradients are the cached layer's bits (same seeds, one backward per forward)."""
    torch.manual_seed(0)
    cfg = NVFP4LinearConfig(backward="nvfp4-backward")
    cached = NVFP4Linear(32, 48, config=cfg)
    capturable = copy.deepcopy(cached)
    capturable.config = dataclasses.replace(cfg, capturable=True)
    for layer in (cached, capturable):
        layer.weight.requires_grad_(False)
        layer.bias.requires_grad_(trainable == "bias")
    run = torch.compile(capturable, backend=backend, fullgraph=True) if backend else capturable
    g = torch.Generator().manual_seed(2)
    for step in (1, 2):
        x, dy = torch.randn(4, 32, generator=g), torch.randn(4, 48, generator=g)
        xa, xb = (x.clone().requires_grad_(trainable == "x") for _ in range(2))
        ya, yb = cached(xa), run(xb)
        assert capturable._sr_calls.tolist() == [2 * step, 2 * step + 1]
        ya.backward(dy)
        yb.backward(dy)
        assert torch.equal(ya, yb)
        if trainable == "x":
            assert torch.equal(xa.grad, xb.grad)
        else:
            assert torch.equal(cached.bias.grad, capturable.bias.grad)
            cached.bias.grad = capturable.bias.grad = None
    assert cached._grad_calls == [2]


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_checkpoint_recompute_draws_again(use_reentrant):
    """Activation checkpointing: the recomputed forward draws the next seeds and the backward uses them.
    Non-reentrant checkpointing runs the first forward with grad (a draw), reentrant under no_grad (none):
    the count advances by 4 or 2 per step, and the backward's seeds are the last draw's."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    layer = NVFP4Linear(32, 48, config=NVFP4LinearConfig(backward="nvfp4-backward", capturable=True))
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(4, 32, generator=g), torch.randn(4, 48, generator=g)

    def grads(model, draws_before: int, checkpointed: bool = False):
        model = copy.deepcopy(model)
        model._sr_calls.copy_(torch.tensor([2 * draws_before, 2 * draws_before + 1]))
        xg = x.clone().requires_grad_()
        y = checkpoint(model, xg, use_reentrant=use_reentrant) if checkpointed else model(xg)
        y.backward(dy)
        return [xg.grad, model.weight.grad, model.bias.grad], model._sr_calls.tolist()

    got, count = grads(layer, 0, checkpointed=True)
    draws = 1 if use_reentrant else 2
    assert count == [2 * draws, 2 * draws + 1]
    want, _ = grads(layer, draws - 1)  # a plain layer's backward with the seeds of the last draw
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    if not use_reentrant:  # the first forward's seeds are not what the backward used
        first, _ = grads(layer, 0)
        assert not torch.equal(got[1], first[1])


class _Launches:
    """Stands in for a Triton kernel: launches nothing, records each launch's arguments."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.log.append((self.name, args, kwargs))


def _stub_kernels(monkeypatch) -> list:
    log: list = []
    for name in ("quantize_rows", "quantize_columns", "dequantize_rows", "gemm_dense", "gemm_decode"):
        module = importlib.import_module(f"triage.kernels.nvfp4.{name}")
        for attr in dir(module):
            if type(getattr(module, attr)).__name__ in ("JITFunction", "InterpretedFunction", "FastLaunch"):
                monkeypatch.setattr(module, attr, _Launches(attr, log))
    return log


def _meta_call(config, rows: int) -> None:
    layer = NVFP4Linear(64, 96, device="meta", dtype=torch.bfloat16, config=config)
    for _ in range(2):  # the first call builds the plans, the second runs them
        x = torch.empty(rows, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
        y = layer(x)
        y.backward(torch.empty_like(y))
        assert x.grad.shape == x.shape and layer.weight.grad.shape == layer.weight.shape


@pytest.mark.skipif(not interpreting(), reason="meta tensors take the Triton path under the interpreter only")
@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize("gemm_backend", ["auto", "cublas"])
@pytest.mark.parametrize("rows", [16, 128])
def test_a_capturable_call_reads_nothing_on_the_host(monkeypatch, backward, gemm_backend, rows):
    """Forward and backward on meta tensors (no data: any ``.item()``/``float(t)``/``bool(t)`` raises, as it
    would sync on CUDA) with every Triton launch stubbed, for the GEMM backends whose large-M route is
    cuBLAS with a host alpha in the cached layer (next test); every stochastic-rounding launch takes its
    seed as a device tensor (``SEED_PTR``), none as a host int."""
    log = _stub_kernels(monkeypatch)
    cfg = NVFP4LinearConfig(
        backward=backward, gemm_backend=gemm_backend, quant_backend="triton", capturable=True
    )
    _meta_call(cfg, rows)
    quantizers = [(a, k) for name, a, k in log if name in ("_quantize_kernel", "_quantize_colwise_kernel")]
    stochastic = [(a, k) for a, k in quantizers if k["STOCHASTIC"]]
    assert len(stochastic) == (4 if backward == "nvfp4-backward" else 0)  # dy and dyᵀ, two calls
    for args, kwargs in stochastic:
        assert kwargs["SEED_PTR"] and isinstance(args[-1], torch.Tensor)


@pytest.mark.skipif(not interpreting(), reason="meta tensors take the Triton path under the interpreter only")
@pytest.mark.parametrize("gemm_backend", ["auto", "cublas"])
def test_the_check_sees_the_cached_layers_host_reads(monkeypatch, gemm_backend):
    """The check above can fail: the cached layer at 128 rows takes cuBLAS's alpha route, which reads the
    dynamic activation scale (and the weight's, once per update) on the host."""
    _stub_kernels(monkeypatch)
    cfg = NVFP4LinearConfig(gemm_backend=gemm_backend, quant_backend="triton")
    with pytest.raises((RuntimeError, NotImplementedError)):
        _meta_call(cfg, 128)


def _forbid_host_reads(monkeypatch, allowed: set) -> None:
    """Make every Python-level read of tensor data to the host raise, except ``int()`` of the op ids in
    ``allowed`` (CPU tensors: which layer the cached op serves, not data)."""

    def refuse(name):
        def method(self, *args, **kwargs):
            raise AssertionError(f"host read: Tensor.{name}")

        return method

    for name in ("item", "tolist", "numpy", "__bool__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse(name))
    to_int = torch.Tensor.__int__
    monkeypatch.setattr(
        torch.Tensor, "__int__",
        lambda t: to_int(t) if t.data_ptr() in allowed else refuse("__int__")(t),
    )  # fmt: skip


@pytest.mark.parametrize("capturable", [True, False])
def test_the_compiled_capturable_op_reads_nothing_on_the_host(monkeypatch, capturable):
    """The compiled ops (their real bodies: the Triton kernels on CUDA, under the interpreter on a CPU) at 80
    rows, where the cached layer's GEMM is cuBLAS with a host alpha: forward and nvfp4-backward run with
    every Python-level host read of tensor data refused (``.item()``, ``float()``, ``bool()``, ...; ``int()``
    only of the cached layer's op ids: the capturable op takes none). The cached layer fails it (``float()`` of the
    activation's outer scale), so the check can fail."""
    from triage.kernels import linear
    from triage.kernels.nvfp4 import matmul

    # On CUDA, "auto" leaves cuBLAS's alpha for the sync-free Triton GEMM below SYNC_FREE_MAX_FLOP when the
    # activation's scale is dynamic, as these small GEMMs are (the interpreter has no such rule): a zero
    # threshold gives them the large-GEMM routes on both, and fresh plan caches (read when a plan is built).
    monkeypatch.setattr(matmul, "SYNC_FREE_MAX_FLOP", 0)
    monkeypatch.setattr(matmul, "SYNC_FREE_MAX_FLOP_TMA", 0)
    monkeypatch.setattr(matmul, "_GEMM_PLANS", {})
    monkeypatch.setattr(linear, "_PLANS", {})
    cached, model = _pair("nvfp4-backward", device=device())
    model = model if capturable else cached
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x, dy = torch.randn(80, 32).to(device()), torch.randn(80, 16).to(device())
    train_step(compiled, _adamw(model), x, dy)  # compiles, and fills the caches of the cached layers
    allowed = set() if capturable else {m._op_id.data_ptr() for m in model if isinstance(m, NVFP4Linear)}
    _forbid_host_reads(monkeypatch, allowed)
    if capturable:
        compiled(x.clone().requires_grad_()).backward(dy)
    else:
        with pytest.raises(AssertionError, match="host read: Tensor.__float__"):
            compiled(x.clone().requires_grad_()).backward(dy)


# --- on a GPU: capture and replay (skipped on CPU) ---------------------------------------------------------


def _inputs(g: torch.Generator, rows: int = 16):
    x, dy = torch.randn(2, rows, 32, generator=g), torch.randn(2, rows, 16, generator=g)
    return x.to("cuda", torch.bfloat16), dy.to("cuda", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backward", BACKWARDS)
def test_cuda_graph_replays_give_the_cached_bits(backward):
    """``torch.cuda.graph`` captures the capturable model's forward + backward once; each replay, after an
    eager fused-AdamW step on its weights, gives the eager cached model's outputs and gradients bit for bit
    (a replay that reused the captured W_q, or the captured seeds, would not)."""
    cached, capturable = _pair(backward, device="cuda", dtype=torch.bfloat16)
    opt_a, opt_b = _adamw(cached), _adamw(capturable)
    g = torch.Generator().manual_seed(1)
    x, dy = _inputs(g)
    static_x, static_dy = x.clone().requires_grad_(), dy.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(
        side
    ):  # warm-up (Triton compiles, plans), the cached model the same number of calls
        for model in (capturable, cached):
            for _ in range(3):
                model(static_x).backward(static_dy)
                model.zero_grad(set_to_none=True)
    torch.cuda.current_stream().wait_stream(side)
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = capturable(static_x)
        static_y.backward(static_dy)
    for step in range(4):
        x, dy = _inputs(g)
        with torch.no_grad():
            static_x.copy_(x)
            static_dy.copy_(dy)
        graph.replay()
        y_b = static_y.detach().clone()
        grads_b = [static_x.grad.clone()] + [p.grad.clone() for p in capturable.parameters()]
        opt_b.step()  # eager, on the graph's gradients: the next replay reads the new weights
        y_a, grads_a = train_step(cached, opt_a, x, dy)
        assert torch.equal(y_a, y_b), step
        for a, b in zip(grads_a, grads_b):
            assert torch.equal(a, b), step


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backward", BACKWARDS)
def test_reduce_overhead_captures_the_capturable_layer(monkeypatch, backward):
    """``torch.compile(mode="reduce-overhead")`` puts the capturable layers in its CUDA graphs: after the
    warm-up and recording steps no Python of the layer runs (replays only), and every step gives the eager
    cached model's bits (no GELU between the layers: inductor's rounds unlike eager's)."""
    from torch._dynamo.utils import counters

    from triage.kernels import linear

    cached, capturable = _pair(backward, gelu=False, device="cuda", dtype=torch.bfloat16)
    opt_a, opt_b = _adamw(cached), _adamw(capturable)
    calls = []
    quantize_weight = linear._quantize_weight
    # the capturable layers' calls only (the eager cached model beside it re-quantizes after every step)
    monkeypatch.setattr(
        linear, "_quantize_weight", lambda w, c: (c.capturable and calls.append(1)) or quantize_weight(w, c)
    )
    counters.clear()
    compiled = torch.compile(capturable, mode="reduce-overhead", fullgraph=True)
    g = torch.Generator().manual_seed(1)
    seen = []
    for step in range(6):
        x, dy = _inputs(g)
        torch.compiler.cudagraph_mark_step_begin()
        y_b, grads_b = train_step(compiled, opt_b, x, dy)
        y_a, grads_a = train_step(cached, opt_a, x, dy)
        assert torch.equal(y_a, y_b), step
        for a, b in zip(grads_a, grads_b):
            assert torch.equal(a, b), step
        seen.append(len(calls))
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert seen[2] == seen[-1], seen  # steps 4-6: replays, the layer's Python never ran


def test_meta_init_then_to_empty_and_reset_restores_the_seed_count():
    """Meta-device init (FSDP2, accelerate's init_empty_weights): ``to_empty`` leaves the non-persistent
    seed count uninitialised; ``reset_parameters`` (the initialisation that follows) restores it."""
    with torch.device("meta"):
        layer = NVFP4Linear(32, 48, config=NVFP4LinearConfig(capturable=True))
    layer.to_empty(device="cpu")
    layer._sr_calls.fill_(12345)  # what uninitialised memory may hold
    layer.reset_parameters()
    assert layer._sr_calls.tolist() == [0, 1]


def test_equal_configs_share_one_key_and_an_unpickled_config_registers_it(monkeypatch):
    """The capturable op names its config by a key (``repr``: every field) that finds it in a registry:
    equal configs have one key, another config another; an unpickled config (a new process's registry
    lacks it) registers itself."""
    import pickle

    from triage.kernels import linear

    cfg = NVFP4LinearConfig(backward="nvfp4-backward", capturable=True)
    assert NVFP4LinearConfig(backward="nvfp4-backward", capturable=True)._op_key == cfg._op_key
    assert dataclasses.replace(cfg, gemm_backend="triton")._op_key != cfg._op_key
    data = pickle.dumps(cfg)
    monkeypatch.setattr(linear, "_CONFIGS", {})
    back = pickle.loads(data)
    assert back == cfg and linear._config_of(back._op_key) is back


def test_only_capturable_configs_are_registered(monkeypatch):
    """The registry serves the capturable op alone: a cached config gets its key (the call plans use it) but
    is not kept, so code that makes a config per step (a sampler's per-sync weight scales) does not grow it."""
    from triage.kernels import linear

    monkeypatch.setattr(linear, "_CONFIGS", {})
    for amax in (1.0, 2.0, 3.0):
        cached = NVFP4LinearConfig(weight=QuantRecipe(scale_source="static", static_amax=amax))
        assert cached._op_key == repr(cached)
    assert linear._CONFIGS == {}
    cfg = NVFP4LinearConfig(capturable=True)
    assert linear._config_of(cfg._op_key) is cfg
