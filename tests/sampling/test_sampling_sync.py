"""HFSampler copy sync: built once, then refreshed in place; each refresh equals a fresh rebuild bit for bit.

The NVFP4 layers run their torch twins (``TRITON_INTERPRET=0``: byte-identical to the Triton kernels and fast on
CPU); what is under test is the sync and the layers' weight caches, which are the same on both paths.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from sampling_fakes import NoAccelerator, make_fake_trainer
from trainer_testkit import tiny_moe_model

from triage.kernels import NVFP4Config, convert
from triage.trainers.grpo_trainer import resolve_sampler_kwargs
from triage.trainers.sampling import HFSampler, SamplingParams, sample_with_kv_cache

TE = {"block": "1x16", "scale": "tensor", "rounding": "nearest", "profile": "te"}
ROW = {"block": "1x16", "scale": "row", "rounding": "nearest", "profile": "compressed-tensors"}
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
PARAMS = SamplingParams(max_new_tokens=6, temperature=1.0)

# learner dtype, learner NVFP4 recipe (None: high precision), sampler_kwargs (the YAML form)
CASES = {
    "bf16-copy-of-fp32": (torch.float32, None, {"precision": "bf16"}),
    "bf16-copy-of-bf16": (torch.bfloat16, None, {"precision": "bf16"}),
    "nvfp4-copy-of-bf16": (torch.bfloat16, None, {"precision": "nvfp4", "quant_recipe": ROW}),
    "nvfp4-copy-of-nvfp4": (torch.bfloat16, TE, {"precision": "nvfp4", "quant_recipe": ROW}),
}


@pytest.fixture(autouse=True)
def _torch_twins(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _learner(tokenizer, tiny_model, dtype, recipe, moe=False):
    from triage.trainers.config import quant_recipe_from

    model = (tiny_moe_model(tokenizer) if moe else copy.deepcopy(tiny_model)).to(dtype)
    if recipe is not None:
        convert(model, NVFP4Config.from_recipe(quant_recipe_from(recipe)))
    return model


def _trainer(tokenizer, model):
    trainer = make_fake_trainer(tokenizer, model)
    trainer.model_wrapped = model
    trainer.accelerator = NoAccelerator()
    return trainer


def _optimizer(kind, model):
    if kind == "adamw-fused":  # writes the parameters without bumping their _version
        return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def _train_step(model, optimizer, step):
    model.train()
    ids = torch.randint(3, 400, (4, 10), generator=torch.Generator().manual_seed(step))
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _counting_builds(sampler):
    """Count ``sampler._build_copy`` calls; returns the count list and a fresh (uncounted) rebuild, made the
    way a sync makes it (under ``no_grad``)."""
    calls, build = [], sampler._build_copy

    def counted(source):
        calls.append(source)
        return build(source)

    def rebuild(source):
        with torch.no_grad():
            return build(source)

    sampler._build_copy = counted
    return calls, rebuild


def _assert_same_as_rebuild(sampler, rebuilt, eos):
    """The in-place-refreshed copy and a freshly rebuilt one: same state, same logits, same samples (seeded)."""
    mine, theirs = sampler.copy.state_dict(), rebuilt.state_dict()
    assert mine.keys() == theirs.keys()
    for key in mine:
        assert mine[key].dtype == theirs[key].dtype and torch.equal(mine[key], theirs[key]), key
    ids = torch.tensor([PROMPTS[0] + PROMPTS[2]])
    with torch.no_grad():
        assert torch.equal(sampler.copy(ids).logits, rebuilt(ids).logits)
    runs = [
        sample_with_kv_cache(m, PROMPTS, PARAMS, eos, generator=torch.Generator().manual_seed(11), pad_id=0)
        for m in (sampler.copy, rebuilt)
    ]
    assert runs[0] == runs[1]  # token ids and float log-probs, exactly
    return runs[0]


def _run_steps(tokenizer, learner, sampler, optimizer_kind, steps=3):
    """Sync after each of ``steps`` optimizer steps; each time the copy must equal a fresh rebuild."""
    trainer = _trainer(tokenizer, learner)
    optimizer = _optimizer(optimizer_kind, learner)
    calls, build = _counting_builds(sampler)
    eos = [tokenizer.eos_token_id]
    samples = []
    for step in range(steps + 1):
        if step:
            _train_step(learner, optimizer, step)
            trainer.state.global_step = step
        sampler.maybe_sync_weights(trainer)
        samples.append(_assert_same_as_rebuild(sampler, build(learner), eos))
    assert samples[0] != samples[-1]  # the weights moved: the copy really followed them
    return calls


@pytest.mark.parametrize("optimizer_kind", ["adamw-fused", "sgd"])
@pytest.mark.parametrize("case", list(CASES))
def test_in_place_refresh_equals_a_rebuild_after_each_step(tokenizer, tiny_model, case, optimizer_kind):
    dtype, recipe, sampler_kwargs = CASES[case]
    learner = _learner(tokenizer, tiny_model, dtype, recipe)
    sampler = HFSampler(seed=0, **resolve_sampler_kwargs("hf", sampler_kwargs))
    calls = _run_steps(tokenizer, learner, sampler, optimizer_kind)
    assert len(calls) == 1  # built at the first sync, refreshed in place after every later step
    if sampler_kwargs["precision"] == "nvfp4":
        from triage.kernels import NVFP4Linear

        layers = [m for m in sampler.copy.modules() if isinstance(m, NVFP4Linear)]
        assert layers and all(m.config.weight.scale == "row" for m in layers)


@pytest.mark.parametrize("learner_recipe", [None, TE], ids=["bf16-learner", "nvfp4-learner"])
def test_moe_copy_is_refreshed_in_place(tokenizer, tiny_model, learner_recipe):
    from triage.kernels import NVFP4MoeExperts

    learner = _learner(tokenizer, tiny_model, torch.bfloat16, learner_recipe, moe=True)
    sampler = HFSampler(seed=0, **resolve_sampler_kwargs("hf", {"precision": "nvfp4", "quant_recipe": ROW}))
    calls = _run_steps(tokenizer, learner, sampler, "adamw-fused", steps=2)
    assert len(calls) == 1
    assert sum(isinstance(m, NVFP4MoeExperts) for m in sampler.copy.modules()) == 2


def test_weights_written_outside_an_optimizer_step_reach_the_copy(tokenizer, tiny_model):
    """No optimizer step, so no weight-generation bump: the copy's NVFP4 caches must see the in-place write
    (its ``_version`` bump) and re-quantize, never sample with the previous step's quantized weights."""
    learner = _learner(tokenizer, tiny_model, torch.float32, None)
    sampler = HFSampler(seed=0, **resolve_sampler_kwargs("hf", {"precision": "nvfp4", "dtype": "float32"}))
    trainer = _trainer(tokenizer, learner)
    calls, build = _counting_builds(sampler)
    eos = [tokenizer.eos_token_id]
    sampler.maybe_sync_weights(trainer)
    before = _assert_same_as_rebuild(sampler, build(learner), eos)
    with torch.no_grad():
        for p in learner.parameters():
            p.mul_(1.5)
    trainer.state.global_step = 1
    sampler.maybe_sync_weights(trainer)
    assert _assert_same_as_rebuild(sampler, build(learner), eos) != before
    assert len(calls) == 1


def _scale_norm(model):  # changes a weight's value: the copy is no longer the trainer's weights cast
    model.model.norm.weight.mul_(2.0)
    return model


def _wrap_q_proj(model):  # renames a weight: model.layers.0.self_attn.q_proj.0.weight
    attn = model.model.layers[0].self_attn
    attn.q_proj = torch.nn.Sequential(attn.q_proj)
    return model


@pytest.mark.parametrize(
    "prepare, reason",
    [
        (_scale_norm, "'model.norm.weight' of the copy is not the trainer model's 'model.norm.weight' cast"),
        (_wrap_q_proj, "state_dict keys differ from the trainer model's: only in the copy"),
    ],
    ids=["rewrites-a-weight", "renames-a-weight"],
)
def test_a_copy_that_is_not_a_cast_is_rebuilt_with_one_warning(tokenizer, tiny_model, prepare, reason):
    learner = _learner(tokenizer, tiny_model, torch.float32, None)
    sampler = HFSampler(sampler_model="copy", prepare_model=prepare, seed=0)
    trainer = _trainer(tokenizer, learner)
    calls, build = _counting_builds(sampler)
    optimizer = _optimizer("sgd", learner)
    with pytest.warns(RuntimeWarning, match="cannot be refreshed in place") as caught:
        for step in range(3):
            if step:
                _train_step(learner, optimizer, step)
                trainer.state.global_step = step
            sampler.maybe_sync_weights(trainer)
            _assert_same_as_rebuild(sampler, build(learner), [tokenizer.eos_token_id])
    assert len(calls) == 3  # rebuilt at every sync, as before
    messages = [str(w.message) for w in caught if "refreshed in place" in str(w.message)]
    assert len(messages) == 1 and reason in messages[0]


def test_a_learner_whose_state_changed_shape_gets_a_rebuilt_copy(tokenizer, tiny_model):
    """The in-place load fails (a key the copy lacks): one rebuild, with a warning; in place again after."""
    learner = _learner(tokenizer, tiny_model, torch.float32, None)
    sampler = HFSampler(seed=0, **resolve_sampler_kwargs("hf", {"precision": "nvfp4", "dtype": "float32"}))
    trainer = _trainer(tokenizer, learner)
    calls, build = _counting_builds(sampler)
    sampler.maybe_sync_weights(trainer)
    learner.model.norm.register_buffer("offset", torch.ones(4))
    trainer.state.global_step = 1
    with pytest.warns(
        RuntimeWarning, match=r"loading the trainer model.s state failed \(.*model\.norm\.offset"
    ):
        sampler.maybe_sync_weights(trainer)
    assert len(calls) == 2 and torch.equal(sampler.copy.model.norm.offset, torch.ones(4))
    with torch.no_grad():
        learner.model.norm.offset.fill_(3.0)
    trainer.state.global_step = 2
    sampler.maybe_sync_weights(trainer)
    assert len(calls) == 2 and torch.equal(sampler.copy.model.norm.offset, torch.full((4,), 3.0))
    _assert_same_as_rebuild(sampler, build(learner), [tokenizer.eos_token_id])


def test_refresh_rebuild_rebuilds_at_every_sync_without_warning(tokenizer, tiny_model, recwarn):
    learner = _learner(tokenizer, tiny_model, torch.float32, None)
    kwargs = resolve_sampler_kwargs("hf", {"precision": "nvfp4", "dtype": "float32"})
    sampler = HFSampler(seed=0, refresh="rebuild", **kwargs)
    trainer = _trainer(tokenizer, learner)
    calls, _ = _counting_builds(sampler)
    first = None
    for step in range(3):
        trainer.state.global_step = step
        sampler.maybe_sync_weights(trainer)
        first = first or sampler.copy
    assert len(calls) == 3 and sampler.copy is not first
    assert not [w for w in recwarn if "refreshed in place" in str(w.message)]
    with pytest.raises(ValueError, match="refresh must be 'in_place' or 'rebuild'"):
        HFSampler(sampler_model="copy", refresh="lazy")
    with pytest.raises(ValueError, match="pass sampler_model='copy'"):
        HFSampler(refresh="rebuild")


def test_refresh_keeps_rope_inv_freq_at_the_source_precision(tokenizer, tiny_model):
    learner = _learner(tokenizer, tiny_model, torch.float32, None)
    sampler = HFSampler(seed=0, **resolve_sampler_kwargs("hf", {"precision": "nvfp4"}))  # a bf16 copy
    trainer = _trainer(tokenizer, learner)
    for step in range(2):
        trainer.state.global_step = step
        sampler.maybe_sync_weights(trainer)
    source = dict(learner.named_buffers())
    inv_freq = {n: b for n, b in sampler.copy.named_buffers() if n.endswith("inv_freq")}
    assert inv_freq and next(sampler.copy.parameters()).dtype == torch.bfloat16
    for name, buf in inv_freq.items():
        assert buf.dtype == torch.float32 and torch.equal(buf, source[name]), name


def test_a_compiled_learner_gets_an_eager_copy_refreshed_in_place(tokenizer, tiny_model):
    """``torch_compile=True``: accelerate's unwrap keeps the ``torch.compile`` wrapper (keys ``_orig_mod.*``,
    an instance ``forward`` bound to the learner's module). The copy is built from the module it wraps."""
    learner = _learner(tokenizer, tiny_model, torch.float32, None)
    trainer = _trainer(tokenizer, learner)
    trainer.model_wrapped = torch.compile(learner, backend="eager")
    sampler = HFSampler(seed=0, **resolve_sampler_kwargs("hf", {"precision": "bf16"}))
    calls, build = _counting_builds(sampler)
    optimizer = _optimizer("sgd", learner)
    eos = [tokenizer.eos_token_id]
    samples = []
    for step in range(2):
        if step:
            _train_step(learner, optimizer, step)
            trainer.state.global_step = step
        sampler.maybe_sync_weights(trainer)
        assert not any(k.startswith("_orig_mod.") for k in sampler.copy.state_dict())
        samples.append(_assert_same_as_rebuild(sampler, build(learner), eos))
    assert len(calls) == 1 and samples[0] != samples[1]


# -- calibrated static activation scales (activation_scale="calibrated": a served checkpoint's) ------------------
SERVED = {
    "precision": "nvfp4",
    "quant_recipe": {**TE, "profile": "modelopt"},
    "activation_scale": "calibrated",
}


def _calibrated(tokenizer, tiny_model, sampler_kwargs=SERVED):
    """An fp32 learner, a trainer over it, and a calibrated sampler built by its first rollout call."""
    from triage.trainers.sampling.base import trainer_prompt_ids

    learner = _learner(tokenizer, tiny_model, torch.float32, None)
    trainer = _trainer(tokenizer, learner)
    sampler = HFSampler(seed=0, **resolve_sampler_kwargs("hf", sampler_kwargs))
    prompts = ["What is 2+3?", "What is 12-7?", "What is 2+3?"]
    sampler(prompts, trainer)
    return learner, trainer, sampler, trainer_prompt_ids(prompts, trainer)


def _static_amax(model):
    from triage.kernels import NVFP4Linear

    layers = {n: m for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    assert layers and all(m.config.activation.scale_source == "static" for m in layers.values())
    assert all(
        m.config.weight.scale_source == "dynamic" for m in layers.values()
    )  # weights: per-tensor, live
    return {n: m.config.activation.static_amax for n, m in layers.items()}


def test_calibrated_sampler_layers_carry_the_calibration_batch_amax(tokenizer, tiny_model):
    from triage.kernels.calibration import calibrate_activation_amax

    learner, _, sampler, prompt_ids = _calibrated(tokenizer, tiny_model)
    dup = copy.deepcopy(learner).to(torch.bfloat16).eval()  # the copy as cast, before its NVFP4 conversion
    for name, buf in learner.named_buffers():  # with RoPE's inv_freq in fp32, as the copy serves it
        if name.endswith("inv_freq"):
            module, _, attr = name.rpartition(".")
            dup.get_submodule(module)._buffers[attr] = buf.detach().clone()
    expected = {}
    for prompt in prompt_ids:  # each prompt alone (no padding), max over the batch
        ids = torch.tensor([prompt])
        one = calibrate_activation_amax(dup, ids, torch.ones_like(ids), torch.arange(len(prompt))[None])
        expected = {n: max(expected.get(n, 0.0), v) for n, v in one.items()}
    amax = _static_amax(sampler.copy)
    assert amax == expected == sampler.activation_amax
    assert len(set(amax.values())) > 1  # one amax per layer


def test_calibrated_amax_stay_fixed_across_refresh_while_weights_change(tokenizer, tiny_model):
    learner, trainer, sampler, _ = _calibrated(tokenizer, tiny_model)
    calls, _ = _counting_builds(sampler)
    before = _static_amax(sampler.copy)
    layer = sampler.copy.get_submodule("model.layers.0.self_attn.q_proj")
    weight_before = layer.weight.detach().clone()
    codes_before = layer.quantized_weight().data.clone()  # the layer's cached W_q before the refresh
    optimizer = _optimizer("adamw-fused", learner)
    _train_step(learner, optimizer, 1)
    trainer.state.global_step = 1
    sampler(["What is 9+9?"], trainer)  # other prompts: calibration is not repeated
    assert calls == []  # refreshed in place
    assert sampler.copy.get_submodule("model.layers.0.self_attn.q_proj") is layer
    assert _static_amax(sampler.copy) == before == sampler.activation_amax
    assert not torch.equal(layer.weight.detach(), weight_before)  # the weights followed the learner
    assert not torch.equal(layer.quantized_weight().data, codes_before)  # and so do the layer's NVFP4 codes


def test_calibrated_sampler_logprobs_differ_from_dynamic_scales(tokenizer, tiny_model):
    learner, _, served, _ = _calibrated(tokenizer, tiny_model)
    dynamic_kwargs = {k: v for k, v in SERVED.items() if k != "activation_scale"}
    _, _, dynamic, _ = _calibrated(tokenizer, tiny_model, dynamic_kwargs)
    eos = [tokenizer.eos_token_id]
    runs = [
        sample_with_kv_cache(m, PROMPTS, PARAMS, eos, generator=torch.Generator().manual_seed(3), pad_id=0)
        for m in (served.copy, dynamic.copy)
    ]
    assert runs[0]["logprobs"] != runs[1]["logprobs"]
    # the same sampler rebuilt with its amax gives the same numbers: the difference is the static scales
    rebuilt = served._build_copy(learner)
    again = sample_with_kv_cache(
        rebuilt, PROMPTS, PARAMS, eos, generator=torch.Generator().manual_seed(3), pad_id=0
    )
    assert again == runs[0]


def test_calibrated_amax_survive_a_sampler_checkpoint(tokenizer, tiny_model):
    _, _, sampler, _ = _calibrated(tokenizer, tiny_model)
    resumed = HFSampler(seed=0, **resolve_sampler_kwargs("hf", SERVED))
    resumed.load_state_dict(sampler.state_dict())
    assert resumed.activation_amax == sampler.activation_amax
    _, trainer, _, _ = _calibrated(tokenizer, tiny_model)
    resumed(["What is 9+9?"], trainer)  # other prompts: the restored amax are used, not a new calibration
    assert _static_amax(resumed.copy) == sampler.activation_amax


_BAD_ACTIVATION_SCALE = [
    ({"precision": "bf16", "activation_scale": "calibrated"}, "precision: nvfp4"),
    ({"activation_scale": "calibrated"}, "precision: nvfp4"),
    (
        {"precision": "nvfp4", "quant_recipe": ROW, "activation_scale": "calibrated"},
        "quant_recipe.scale: tensor",
    ),
    ({"precision": "nvfp4", "activation_scale": "static"}, "activation_scale must be one of"),
    (
        {"precision": "nvfp4", "quant_recipe": {"hadamard": True}, "activation_scale": "calibrated"},
        "quant_recipe.hadamard: false",
    ),
]


def test_hf_sampler_refuses_calibration_without_an_nvfp4_copy(tokenizer, tiny_model):
    with pytest.raises(ValueError, match="sampler_model='copy'"):
        HFSampler(activation_scale="calibrated")
    with pytest.raises(ValueError, match="activation_scale must be one of"):
        HFSampler(activation_scale="per-token")
    # a per-row activation recipe reaching the sampler directly: refused at the build, naming the layer
    kwargs = {"precision": "nvfp4", "quant_recipe": ROW}
    sampler = HFSampler(seed=0, activation_scale="calibrated", **resolve_sampler_kwargs("hf", kwargs))
    trainer = _trainer(tokenizer, _learner(tokenizer, tiny_model, torch.float32, None))
    with pytest.raises(ValueError, match=r"layer 'model\.layers\.0\..*scale='tensor'"):
        sampler(["What is 2+3?"], trainer)


def test_static_activation_recipe_refuses_a_hadamard_recipe():
    """Calibration measures max|x|; a Hadamard recipe scales the rotated H·x: no static scale from it."""
    from triage.kernels.calibration import static_activation_recipe
    from triage.kernels.nvfp4 import QuantRecipe

    assert static_activation_recipe(QuantRecipe(), 3.0).static_amax == 3.0
    with pytest.raises(ValueError, match="hadamard=False"):
        static_activation_recipe(QuantRecipe(hadamard=True), 3.0)


# -- fused_weight_scale="shared": vLLM's one weight outer scale per fused q/k/v and gate/up layer ----------------
SHARED = {**SERVED, "fused_weight_scale": "shared"}
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
OWN = (("self_attn", "o_proj"), ("mlp", "down_proj"))  # not fused: each keeps its own dynamic scale


def _shard_layers(model, layer=0):
    """``{group: {shard: NVFP4Linear}}`` of decoder layer ``layer``."""
    from triage.kernels import NVFP4Linear

    out = {}
    for group in GROUPS:
        parent = "self_attn" if group[0] == "q_proj" else "mlp"
        out[group] = {n: model.get_submodule(f"model.layers.{layer}.{parent}.{n}") for n in group}
        assert all(isinstance(m, NVFP4Linear) for m in out[group].values())
    return out


def _assert_group_scales(model):
    """Every fused group's shards quantize with ONE outer scale, that of the max of their current weight amax;
    returns the group amax by (layer, group)."""
    from triage.kernels.nvfp4 import quantize

    found = {}
    for i in range(model.config.num_hidden_layers):
        for group, shards in _shard_layers(model, i).items():
            own = {n: float(m.weight.detach().abs().amax()) for n, m in shards.items()}
            assert len(set(own.values())) > 1  # the shards' own amax differ: sharing is visible
            amax = max(own.values())
            scales = set()
            for name, m in shards.items():
                assert m.config.weight.scale_source == "static" and m.config.weight.static_amax == amax
                q = m.quantized_weight()  # what the layer's forward uses (its weight cache)
                assert float(q.amax) == amax
                scales.add(float(q.global_scale))
                recipe = dataclasses.replace(m.config.weight, scale_source="static", static_amax=amax)
                expected = quantize(m.weight.detach(), recipe, backend="torch")
                assert torch.equal(q.data, expected.data)
                assert torch.equal(_bits(q.scale), _bits(expected.scale))
                if own[name] < amax:  # a smaller shard: its own scale would differ from the group's
                    alone = dataclasses.replace(recipe, scale_source="dynamic", static_amax=None)
                    assert float(quantize(m.weight.detach(), alone).global_scale) != float(q.global_scale)
            assert len(scales) == 1
            found[(i, group)] = amax
        for parent, name in OWN:
            m = model.get_submodule(f"model.layers.{i}.{parent}.{name}")
            assert m.config.weight.scale_source == "dynamic" and m.config.weight.static_amax is None
            assert float(m.quantized_weight().amax) == float(m.weight.detach().abs().amax())
    return found


def _bits(t):
    from triage.trainers.sampling.hf import _bits as bits

    return bits(t)


def test_shared_fused_scale_is_the_group_amax_and_other_layers_keep_their_own(tokenizer, tiny_model):
    _, _, sampler, _ = _calibrated(tokenizer, tiny_model, SHARED)
    assert sampler.fused_weight_scale == "shared"
    _assert_group_scales(sampler.copy)
    # the calibrated activation scales are untouched by the weight scales
    assert all(
        m.config.activation.scale_source == "static"
        for shards in _shard_layers(sampler.copy).values()
        for m in shards.values()
    )


def test_independent_fused_scales_stay_per_shard(tokenizer, tiny_model):
    _, _, sampler, _ = _calibrated(tokenizer, tiny_model)
    assert sampler.fused_weight_scale == "independent"
    for shards in _shard_layers(sampler.copy).values():
        scales = {float(m.quantized_weight().global_scale) for m in shards.values()}
        assert all(m.config.weight.scale_source == "dynamic" for m in shards.values())
        assert len(scales) == len(shards)  # one scale per shard


@pytest.mark.parametrize("refresh", ["in_place", "rebuild"])
def test_shared_fused_scale_follows_the_weights_at_every_sync(tokenizer, tiny_model, refresh):
    learner, trainer, sampler, _ = _calibrated(tokenizer, tiny_model, {**SHARED, "refresh": refresh})
    calls, _ = _counting_builds(sampler)
    before = _assert_group_scales(sampler.copy)
    q_proj = _shard_layers(sampler.copy)[GROUPS[0]]["q_proj"]
    codes_before = q_proj.quantized_weight().data.clone()
    optimizer = _optimizer("adamw-fused", learner)
    for step in (1, 2):
        _train_step(learner, optimizer, step)
        trainer.state.global_step = step
        sampler(["What is 9+9?"], trainer)
    assert len(calls) == (0 if refresh == "in_place" else 2)
    after = _assert_group_scales(sampler.copy)  # the group amax of the new weights, re-quantized with it
    assert all(after[k] != before[k] for k in before)
    if refresh == "in_place":
        assert _shard_layers(sampler.copy)[GROUPS[0]]["q_proj"] is q_proj
        assert not torch.equal(q_proj.quantized_weight().data, codes_before)


def test_shared_fused_scale_in_place_refresh_equals_a_rebuild(tokenizer, tiny_model):
    learner = _learner(tokenizer, tiny_model, torch.float32, None)
    kwargs = {
        "precision": "nvfp4",
        "quant_recipe": {**TE, "profile": "modelopt"},
        "fused_weight_scale": "shared",
    }
    sampler = HFSampler(seed=0, **resolve_sampler_kwargs("hf", kwargs))
    calls = _run_steps(tokenizer, learner, sampler, "adamw-fused")
    assert len(calls) == 1
    _assert_group_scales(sampler.copy)


_BAD_FUSED_WEIGHT_SCALE = [
    (
        {"precision": "bf16", "fused_weight_scale": "shared"},
        "fused_weight_scale: shared needs .*precision: nvfp4",
    ),
    ({"fused_weight_scale": "shared"}, "fused_weight_scale: shared needs .*precision: nvfp4"),
    (
        {"precision": "nvfp4", "quant_recipe": ROW, "fused_weight_scale": "shared"},
        "fused_weight_scale: shared needs .*quant_recipe.scale: tensor",
    ),
    (
        {"precision": "nvfp4", "quant_recipe": {"hadamard": True}, "fused_weight_scale": "shared"},
        "fused_weight_scale: shared needs .*quant_recipe.hadamard: false",
    ),
    (
        {
            "precision": "nvfp4",
            "quant_recipe": {"scale_source": "static", "static_amax": 2.0},
            "fused_weight_scale": "shared",
        },
        "fused_weight_scale: shared needs .*quant_recipe.scale_source: dynamic",
    ),
    ({"precision": "nvfp4", "fused_weight_scale": "fused"}, "fused_weight_scale must be one of"),
]


@pytest.mark.parametrize(
    "option, sampler_kwargs, message",
    [("activation_scale", *case) for case in _BAD_ACTIVATION_SCALE]
    + [("fused_weight_scale", *case) for case in _BAD_FUSED_WEIGHT_SCALE],
)
def test_sampler_numerics_options_refuse_bad_combinations(option, sampler_kwargs, message):
    """``activation_scale: calibrated`` and ``fused_weight_scale: shared`` need an NVFP4 copy with one dynamic,
    unrotated outer scale per tensor: anything else is refused at config time, naming the field."""
    from triage.trainers.config import check_sampler_kwargs

    with pytest.raises(ValueError, match=message) as err:
        check_sampler_kwargs("hf", sampler_kwargs, "sampler_kwargs")
    assert f"sampler_kwargs.{option}" in str(err.value)


def test_hf_sampler_refuses_shared_fused_scales_without_a_per_tensor_nvfp4_copy(tokenizer, tiny_model):
    with pytest.raises(ValueError, match="fused_weight_scale='shared'.*sampler_model='copy'"):
        HFSampler(fused_weight_scale="shared")
    with pytest.raises(ValueError, match="fused_weight_scale must be one of"):
        HFSampler(fused_weight_scale="max")
    # a per-row weight recipe reaching the sampler directly: refused at the build, naming the layer
    sampler = HFSampler(
        seed=0,
        fused_weight_scale="shared",
        **resolve_sampler_kwargs("hf", {"precision": "nvfp4", "quant_recipe": ROW}),
    )
    trainer = _trainer(tokenizer, _learner(tokenizer, tiny_model, torch.float32, None))
    with pytest.raises(
        ValueError, match=r"fused_weight_scale='shared'.*layer 'model\.layers\.0\..*scale='tensor'"
    ):
        sampler(["What is 2+3?"], trainer)


def test_shared_weight_recipe_fixes_a_valid_group_amax_else_keeps_the_dynamic_scale():
    """The group amax becomes a static weight amax; 0, NaN or Inf keep the shard's own dynamic scale."""
    from triage.kernels.calibration import shared_weight_recipe
    from triage.kernels.nvfp4 import QuantRecipe

    assert shared_weight_recipe(QuantRecipe(), 2.0).static_amax == 2.0
    with pytest.raises(ValueError, match="scale_source='dynamic'"):  # a given static scale is not replaced
        shared_weight_recipe(QuantRecipe(scale_source="static", static_amax=1.0), 2.0)
    for bad in (0.0, float("nan"), float("inf")):  # no valid static amax: the shard's own (dynamic) scale
        assert shared_weight_recipe(QuantRecipe(), bad) == QuantRecipe()
    with pytest.raises(ValueError, match="hadamard=False"):
        shared_weight_recipe(QuantRecipe(hadamard=True), 2.0)


def test_set_static_activation_scales_sets_each_layers_config_or_changes_nothing():
    """Only ``layer.config`` changes (module, parameters and weight recipe stay); a missing amax or a per-row
    activation recipe is an error naming the layer, with every config left as it was."""
    from triage.kernels import NVFP4Linear, NVFP4LinearConfig
    from triage.kernels.calibration import set_static_activation_scales
    from triage.kernels.nvfp4 import QuantRecipe

    model = torch.nn.ModuleDict({n: NVFP4Linear(16, 16) for n in ("a", "b")})
    before = {n: (m, m.weight, m.config) for n, m in model.items()}
    with pytest.raises(ValueError, match=r"no calibrated amax for the NVFP4 layers \['b'\]"):
        set_static_activation_scales(model, {"a": 2.0})
    model["b"].config = NVFP4LinearConfig(activation=QuantRecipe(scale="row"))
    with pytest.raises(ValueError, match="layer 'b'.*scale='tensor'"):
        set_static_activation_scales(model, {"a": 2.0, "b": 3.0})
    assert model["a"].config == before["a"][2]
    model["b"].config = before["b"][2]
    assert set_static_activation_scales(model, {"a": 2.0, "b": 3.0}) is model
    for name, amax in (("a", 2.0), ("b", 3.0)):
        layer, weight, config = before[name]
        assert model[name] is layer and layer.weight is weight and layer.config.weight == config.weight
        assert layer.config.activation == QuantRecipe(scale_source="static", static_amax=amax)


def test_set_fused_weight_scales_refuses_a_model_without_fused_shards():
    from triage.kernels import NVFP4Linear, NVFP4LinearConfig
    from triage.kernels.calibration import set_fused_weight_scales

    model = torch.nn.ModuleDict({"q_proj": torch.nn.ModuleDict({"base_layer": torch.nn.Linear(16, 16)})})
    with pytest.raises(ValueError, match="no NVFP4Linear layer"):
        set_fused_weight_scales(model)
    layer = NVFP4Linear.from_linear(model["q_proj"]["base_layer"], NVFP4LinearConfig())
    model["q_proj"]["base_layer"] = layer
    with pytest.raises(ValueError, match="'q_proj.base_layer' is a wrapped fused shard"):
        set_fused_weight_scales(model)
    model = torch.nn.ModuleDict({"o_proj": NVFP4Linear(16, 16)})
    with pytest.raises(ValueError, match="no NVFP4Linear layer of the model is a fused shard.*o_proj"):
        set_fused_weight_scales(model)


def test_set_fused_weight_scales_starts_from_the_layers_own_recipe_at_every_call():
    """A second call (the next weight sync) derives from the recipe before the first, not from the static
    group scale the first one set; a layer given a static weight scale of its own is refused, named."""
    from triage.kernels import NVFP4Linear, NVFP4LinearConfig
    from triage.kernels.calibration import set_fused_weight_scales
    from triage.kernels.nvfp4 import QuantRecipe

    attn = torch.nn.ModuleDict({n: NVFP4Linear(16, 16) for n in ("q_proj", "k_proj")})
    model = torch.nn.ModuleDict({"self_attn": attn})
    with torch.no_grad():
        attn["k_proj"].weight.mul_(4)
    set_fused_weight_scales(model)
    first = attn["q_proj"].config.weight
    assert first.scale_source == "static" and first.static_amax == float(attn["k_proj"].weight.abs().amax())
    with torch.no_grad():
        attn["k_proj"].weight.mul_(0.5)
    set_fused_weight_scales(model)
    assert attn["q_proj"].config.weight.static_amax == float(attn["k_proj"].weight.abs().amax())
    assert attn["q_proj"]._unshared_weight_recipe.scale_source == "dynamic"
    static = NVFP4LinearConfig(weight=QuantRecipe(block="16x16", scale_source="static", static_amax=1.0))
    attn["q_proj"] = NVFP4Linear(16, 16, config=static)
    with pytest.raises(ValueError, match="layer 'self_attn.q_proj'.*scale_source='dynamic'"):
        set_fused_weight_scales(model)
