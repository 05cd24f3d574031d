"""The static decode state kept across sampler calls (:mod:`triage.trainers.sampling.graphs`).

A call on a kept state (cache zeroed in place, fp8 KV scales recalibrated in place, buffers refilled) samples
exactly what a call on a fresh state samples; states are kept per shape, at most ``KEPT``; a kept CUDA graph is
captured once and re-captured only when :func:`~triage.kernels.capture.graph_key` changes (the CUDA graph is
faked here: the real one is the GPU test at the end).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from triage.trainers.sampling import HFSampler, SamplingParams, sample_with_kv_cache
from triage.trainers.sampling import graphs as g

PARAMS = SamplingParams(max_new_tokens=7, temperature=1.0)
SHORT = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
OTHER = [[30, 31], [40, 41, 42, 43, 44, 45], [50, 51, 52]]  # another width, the same cache-length bucket


def test_cache_length_buckets():
    assert g.static_cache_length(32, 128) == 192  # 159 positions → a multiple of 64
    assert g.static_cache_length(4, 1) == 64  # at least one decode position
    for n in range(1, 6000, 7):
        length = g.static_cache_length(n, 1)
        assert n + 1 <= length < n + 1 + max(64, (n + 1) / 8)
        assert g.static_cache_length(n - 1, 3) == length  # width + max_new_tokens - 1 is all that counts
    assert g.static_cache_length(4, 7) == g.static_cache_length(6, 7)


def _run(model, prompts, state, kv=None, seed=3):
    return sample_with_kv_cache(
        model, prompts, PARAMS, [], torch.Generator().manual_seed(seed), pad_id=0, kv_cache_dtype=kv,
        decode="static", decode_state=state,
    )  # fmt: skip


@pytest.mark.parametrize("kv", [None, "fp8_e4m3"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_kept_state_samples_what_a_fresh_one_does(tiny_model, kv, attn):
    model = copy.deepcopy(tiny_model)
    model.config._attn_implementation = attn
    kept = g.DecodeGraphs()
    for prompts, seed in ((SHORT, 3), (OTHER, 4), (SHORT, 5), (SHORT, 5)):
        fresh_state = g.DecodeGraphs()
        fresh = _run(model, prompts, fresh_state, kv, seed)
        assert _run(model, prompts, kept, kv, seed) == fresh  # tokens and float log-probs, exactly
        (state,), (new,) = kept.states.values(), fresh_state.states.values()
        if kv is not None:  # recalibrated on this call's prefill, into the tensors the first call made
            for a, b in zip(state.cache.layers, new.cache.layers):
                assert all(torch.equal(x, y) for x, y in zip(a.scales, b.scales))
    assert state.calls == 4  # one state served every call (same batch, same bucket)
    assert _run(model, OTHER, kept, kv, 4) != _run(model, SHORT, kept, kv, 4)


def test_states_are_kept_per_shape_least_recent_first(tiny_model):
    kept = g.DecodeGraphs()
    _run(tiny_model, SHORT, kept)
    first = next(iter(kept.states.values()))
    _run(tiny_model, SHORT[:2], kept)  # another batch
    _run(tiny_model, SHORT, kept)  # the first again: moved to most recent
    assert len(kept.states) == g.KEPT and list(kept.states.values())[-1] is first
    long = SamplingParams(max_new_tokens=90, temperature=1.0)  # another cache length
    sample_with_kv_cache(tiny_model, SHORT, long, [], pad_id=0, decode="static", decode_state=kept)
    assert len(kept.states) == g.KEPT and first in kept.states.values()  # the batch-2 state went
    assert {k[1:3] for k in kept.states} == {(3, 64), (3, g.static_cache_length(5, 90))}


def test_sampler_keeps_one_state_per_chunk_shape_and_samples_as_without(tiny_model):
    prompts = SHORT + OTHER[:2]  # chunks of 2, 2, 1 rows
    kept = HFSampler(tiny_model, params=PARAMS, seed=9, batch_size=2, decode="static")
    fresh = HFSampler(tiny_model, params=PARAMS, seed=9, batch_size=2, decode="static", keep_decode=False)
    for _ in range(2):
        assert kept.generate(prompts) == fresh.generate(prompts)
    assert len(kept.decode_graphs.states) == 2 and not fresh.decode_graphs.states
    assert sorted(s.calls for s in kept.decode_graphs.states.values()) == [2, 4]


class _FakeGraph:
    """Stands in for ``torch.cuda.CUDAGraph`` on CPU: a replay runs nothing (the logits stay the captured
    ones); what is tested is when the sampler warms up and captures, not what a replay computes (the GPU
    test below)."""

    def replay(self):
        pass


@pytest.fixture
def fake_graphs(monkeypatch):
    from triage.kernels.nvfp4 import gemm_decode
    from triage.trainers.sampling import hf

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: ("pool",))
    monkeypatch.setattr(gemm_decode, "graph_counters", contextlib.nullcontext)
    monkeypatch.setattr(hf, "_resolve_decode", lambda decode, model, device: decode)


def test_a_kept_graph_is_captured_once_and_again_when_an_address_changes(tiny_model, fake_graphs):
    """Eager decode forwards per call: 2 (warm-up, capture) on a new graph, 0 on a kept one; values written
    in place keep it, a reallocated parameter drops it."""
    model = copy.deepcopy(tiny_model)
    kept, eager = g.DecodeGraphs(), []
    hook = model.register_forward_pre_hook(
        lambda m, args, kwargs: eager.append(kwargs["input_ids"].shape[1] == 1), with_kwargs=True
    )

    def decode_forwards():
        eager.clear()
        sample_with_kv_cache(model, SHORT, PARAMS, [], pad_id=0, decode="cuda_graph", decode_state=kept)
        return sum(eager)

    try:
        assert decode_forwards() == 2
        assert decode_forwards() == 0
        with torch.no_grad():  # a weight sync writes in place: the graph reads the new values
            model.model.norm.weight.mul_(1.5)
        assert decode_forwards() == 0
        norm = model.model.norm
        norm.weight = torch.nn.Parameter(
            norm.weight.detach().clone()
        )  # reallocated: the graph would read freed memory
        assert decode_forwards() == 2
        assert decode_forwards() == 0
        kept.clear()
        assert decode_forwards() == 2
    finally:
        hook.remove()
    (state,) = kept.states.values()
    assert state.graph_step.captures == 1


def _prefill_forwards(model, kept, prompts=SHORT, kv=None):
    """Eager prompt forwards (more than one token) of one cuda_graph call on ``kept`` (a fake capture runs the
    forward: it counts)."""
    widths = []
    hook = model.register_forward_pre_hook(
        lambda m, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        sample_with_kv_cache(
            model, prompts, PARAMS, [], pad_id=0, decode="cuda_graph", decode_state=kept, kv_cache_dtype=kv
        )
    finally:
        hook.remove()
    return sum(w > 1 for w in widths)


def test_a_kept_prefill_is_captured_on_the_second_call_of_its_width(tiny_model, fake_graphs, monkeypatch):
    """The prompt's forward runs eagerly on the first call of a padded width (the warm-up), is captured on the
    second and replayed after that, one graph per width bucket (at most PREFILL_KEPT); a moved weight drops it
    with the decode graph; not captured with an fp8 KV cache (its calibration reads the host) nor with
    CAPTURE_PREFILL off (on by default)."""
    assert g.CAPTURE_PREFILL is True
    model = copy.deepcopy(tiny_model)
    kept = g.DecodeGraphs()
    assert [_prefill_forwards(model, kept) for _ in range(3)] == [1, 1, 0]
    assert _prefill_forwards(model, kept, OTHER) == 0  # widths 5 and 6: both pad to 16, one graph
    (state,) = kept.states.values()
    assert list(state.prefills) == [16] and state.prefills[16].step.captures == 1
    wide = [list(range(3, 20))] * 3  # width 17 → 32: its own graph beside the first
    assert [_prefill_forwards(model, kept, wide) for _ in range(3)] == [1, 1, 0]
    assert list(state.prefills) == [16, 32] and _prefill_forwards(model, kept) == 0
    norm = model.model.norm
    norm.weight = torch.nn.Parameter(norm.weight.detach().clone())  # reallocated: every graph goes
    assert [_prefill_forwards(model, kept) for _ in range(3)] == [1, 1, 0]
    assert state.graph_step.captures == 2 and _prefill_forwards(model, kept, wide) == 1  # warm-up again
    monkeypatch.setattr(g, "PREFILL_KEPT", 2)
    widest = [list(range(3, 40))] * 3  # → 48: the least recent width (16) goes
    assert [_prefill_forwards(model, kept, widest) for _ in range(2)] == [1, 1]
    assert list(state.prefills) == [32, 48]
    monkeypatch.setattr(g, "CAPTURE_PREFILL", False)
    assert [_prefill_forwards(model, kept, widest) for _ in range(2)] == [1, 1]
    monkeypatch.setattr(g, "CAPTURE_PREFILL", True)
    monkeypatch.setattr(g, "PREFILL_GRAPH_MAX_TOKENS", 3 * 48 - 1)  # 3 rows × 48: over the cap, eager
    assert [_prefill_forwards(model, kept, widest) for _ in range(2)] == [1, 1]
    assert all(p.step.pool == ("pool",) for p in state.prefills.values())  # one pool for the state's prefills
    fp8 = g.DecodeGraphs()
    assert [_prefill_forwards(model, fp8, kv="fp8_e4m3") for _ in range(3)] == [1, 1, 1]
    assert not next(iter(fp8.states.values())).prefills
    bf16 = g.DecodeGraphs()  # a bf16-rounded KV cache calibrates nothing: captured
    assert [_prefill_forwards(model, bf16, kv="bf16") for _ in range(3)] == [1, 1, 0]


@pytest.mark.parametrize("capture", [False, True])
def test_prompts_pad_to_a_bucket_only_with_prefill_graphs(tiny_model, capture, monkeypatch):
    monkeypatch.setattr(g, "CAPTURE_PREFILL", capture)
    widths = []
    hook = tiny_model.register_forward_pre_hook(
        lambda m, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        for decode in ("static", "dynamic"):
            sample_with_kv_cache(tiny_model, SHORT, PARAMS, [], pad_id=0, decode=decode)
    finally:
        hook.remove()
    assert widths[0] == (16 if capture else 5)  # the static prompt forward
    assert widths[PARAMS.max_new_tokens] == 5  # the dynamic path's never pads


def test_prefill_width_buckets_and_mask():
    assert [g.prefill_width(w) for w in (1, 16, 17, 32, 33, 100, 129, 300, 1000)] == [
        16, 16, 32, 32, 48, 112, 160, 320, 1024,
    ]  # fmt: skip
    for w in range(1, 3000, 3):
        assert w <= g.prefill_width(w) < w + max(16, w / 4)
        assert g.prefill_width(g.prefill_width(w)) == g.prefill_width(w)
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]])
    m4 = g.prefill_mask(mask, 6)
    assert m4.shape == (3, 1, 4, 6) and m4.dtype == torch.bool
    for b in range(3):
        for q in range(4):
            for k in range(6):
                assert bool(m4[b, 0, q, k]) == (k <= q and k < 4 and bool(mask[b, k]))
    add = g.prefill_mask(mask, 6, torch.bfloat16)
    assert add.dtype == torch.bfloat16
    assert torch.equal(add == 0, m4) and bool((add[~m4] == torch.finfo(torch.bfloat16).min).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision", ["bf16", "nvfp4"])
def test_one_kept_cuda_graph_serves_every_weight_sync(tiny_model, precision, monkeypatch):
    """A sampler copy refreshed in place (its NVFP4 caches too) keeps one captured decode graph and one prefill
    graph across syncs, and every call samples exactly what a fresh state (an eager prefill, a graph captured
    for that call) samples."""
    from triage.kernels import NVFP4Config, convert
    from triage.kernels.nvfp4 import QuantRecipe

    monkeypatch.setattr(g, "CAPTURE_PREFILL", True)
    learner = copy.deepcopy(tiny_model).cuda().to(torch.bfloat16)
    recipe = QuantRecipe(scale="row", profile="compressed-tensors")
    prepare = (lambda m: convert(m, NVFP4Config.from_recipe(recipe))) if precision == "nvfp4" else None
    samplers = [
        HFSampler(sampler_model="copy", prepare_model=prepare, params=PARAMS, seed=1, decode="cuda_graph",
                  keep_decode=keep)
        for keep in (True, False)
    ]  # fmt: skip
    for s in samplers:
        s.copy = s._build_copy(learner)
    outs = []
    for step in range(4):
        if step:  # a weight sync: the learner moved, the copies take its state in place
            with torch.no_grad():
                for p in learner.parameters():
                    p.add_(torch.randn_like(p) * 0.02)
            for s in samplers:
                s.copy.load_state_dict(learner.state_dict())
        kept, fresh = (s.generate(SHORT, model=s.copy) for s in samplers)
        assert kept == fresh
        outs.append(kept)
    assert outs[0] != outs[-1]  # the weights moved and the kept graph followed them
    (state,) = samplers[0].decode_graphs.states.values()
    assert state.graph_step.captures == 1 and state.calls == 4
    (prefill,) = state.prefills.values()  # eager on the first call, captured on the second, replayed after
    assert prefill.step.captures == 1 and prefill.step.graph is not None


def test_a_kept_state_does_not_keep_its_model_alive(tiny_model):
    import gc
    import weakref

    kept, model = g.DecodeGraphs(), copy.deepcopy(tiny_model)
    _run(model, SHORT, kept)
    _run(tiny_model, SHORT, kept)
    assert len(kept.states) == 2
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None and len(kept.states) == 1


def _nvfp4(model, frozen):
    from triage.kernels import NVFP4Config, convert
    from triage.kernels.nvfp4 import QuantRecipe

    recipe = QuantRecipe(scale="row", profile="compressed-tensors")
    return convert(copy.deepcopy(model), NVFP4Config.from_recipe(recipe, frozen=frozen))


@pytest.mark.parametrize(
    "precision, backend",
    [("fp32", "aot_eager"), ("w4a16", "aot_eager"), ("w4a4", "aot_eager"), ("w4a16", "inductor")],
)
def test_a_compiled_decode_step_samples_what_the_eager_one_does(tiny_model, precision, backend, monkeypatch):
    """``compile_decode``: the decode step through torch.compile (``aot_eager``: the graph dynamo traces,
    without code generation; inductor once, its CPU code) — one graph, no break, at the NVFP4 layers either
    (their custom ops, sibling groups inside) — and the same samples as the eager step."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the NVFP4 layers' torch twins: fast on CPU
    monkeypatch.setattr(g, "COMPILE_BACKEND", backend)
    torch._dynamo.reset()
    model = {
        "fp32": lambda m: copy.deepcopy(m),
        "w4a16": lambda m: _nvfp4(m, "w4a16"),
        "w4a4": lambda m: _nvfp4(m, None),
    }[precision](tiny_model)
    runs = [
        sample_with_kv_cache(
            model, SHORT, PARAMS, [], torch.Generator().manual_seed(2), pad_id=0, decode="static",
            compile_decode=compiled,
        )
        for compiled in (False, True)
    ]  # fmt: skip
    assert runs[0]["completion_ids"] == runs[1]["completion_ids"]
    for a, b in zip(runs[0]["logprobs"], runs[1]["logprobs"]):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    counts = torch._dynamo.utils.counters
    assert counts["stats"]["unique_graphs"] >= 1 and not counts["graph_break"]


def test_a_compiled_decode_step_launches_every_sibling_group_once(tiny_model, monkeypatch):
    """Under inductor (its CPU code; the decode kernel interpreted) every decoder layer's q/k/v and gate/up
    run as one launch each, the compiled step's too: the custom ops take their input as inductor laid it out
    (``flexible_layout``), so the members of a group get one buffer, never a copy each."""
    import triage.kernels.nvfp4.gemm_decode as gd

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(g, "COMPILE_BACKEND", "inductor")
    monkeypatch.setattr(torch._inductor.config, "force_disable_caches", True)  # its keys omit op tags
    torch._dynamo.reset()
    model = _nvfp4(copy.deepcopy(tiny_model).to(torch.float16), "w4a16")
    launches, real = [], gd.DecodeLaunch.launch_group

    def counting(self, *args, **kwargs):
        launches.append(len(self.members))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(gd.DecodeLaunch, "launch_group", counting)
    params = SamplingParams(max_new_tokens=3, temperature=1.0)
    sample_with_kv_cache(model, SHORT[:2], params, [], torch.Generator().manual_seed(2), pad_id=0,
                         decode="static", compile_decode=True)  # fmt: skip
    groups = {id(m._siblings): m._siblings for m in model.modules() if getattr(m, "_siblings", None)}
    layers = tiny_model.config.num_hidden_layers
    assert len(groups) == 2 * layers and not any(group.compiled_alone for group in groups.values())
    assert launches == [3, 2] * layers * 3  # the prompt pass and two compiled steps


@pytest.mark.parametrize("decode", ["static", "cuda_graph"])
def test_nothing_outlives_a_call_without_kept_states_nor_a_dropped_sampler(tiny_model, decode, fake_graphs):
    """Freed by reference counting alone (the cycle collector off): a call's own state at its end, a
    sampler's states with the sampler, a model's states with the model (no key or step holds it)."""
    import gc
    import weakref

    def live_states():
        return sum(isinstance(o, g.StaticDecode) for o in gc.get_objects())

    gc.collect()
    gc.disable()
    try:
        before = live_states()
        sample_with_kv_cache(tiny_model, SHORT, PARAMS, [], pad_id=0, decode=decode)
        sampler = HFSampler(tiny_model, params=PARAMS, seed=1, decode=decode, keep_decode=False)
        sampler.generate(SHORT)
        assert live_states() == before
        sampler = HFSampler(tiny_model, params=PARAMS, seed=1, decode=decode)
        sampler.generate(SHORT)
        assert live_states() == before + 1
        kept = weakref.ref(sampler.decode_graphs)
        del sampler
        assert live_states() == before and kept() is None  # the model lives on; the sampler's states went
        model = copy.deepcopy(tiny_model)
        sampler = HFSampler(model, params=PARAMS, seed=1, decode=decode)
        sampler.generate(SHORT)
        gone = weakref.ref(model)
        sampler.model = None
        del model
        assert gone() is None and not sampler.decode_graphs.states
    finally:
        gc.enable()


def test_a_model_cast_between_calls_gets_a_state_of_its_dtype(tiny_model):
    model, kept = copy.deepcopy(tiny_model), g.DecodeGraphs()
    _run(model, SHORT, kept)
    model.to(torch.bfloat16)
    assert _run(model, SHORT, kept) == _run(model, SHORT, None)
    model.to(torch.float32)  # (weights rounded through bf16 now)
    assert _run(model, SHORT, kept) == _run(model, SHORT, None)
    assert len(kept.states) == 2


def test_every_chunk_of_a_call_shares_one_cache_length(tiny_model):
    prompts = [
        [5, 6],
        [7, 8],
        [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28] * 4,
        [3],
    ]
    long = SamplingParams(max_new_tokens=3, temperature=1.0)  # chunk widths 2, 80, 1: three buckets alone
    sampler = HFSampler(tiny_model, params=long, seed=9, batch_size=2, decode="static")
    for _ in range(3):
        sampler.generate(prompts + [[4, 5]])  # chunks of 2, 2, 1 rows
    assert len(sampler.decode_graphs.states) == 2
    assert sorted(s.calls for s in sampler.decode_graphs.states.values()) == [3, 6]
