"""Context dependence of a tensor-wide activation amax, and strict alignment with the built-in sampler."""

import pytest
import torch

from triage.kernels.frozen_linear import FrozenNVFP4Linear
from triage.kernels.nvfp4 import QuantRecipe, quantize
from triage.trainers.diagnostics.pairs import compare_paths
from triage.trainers.diagnostics.paths import ExecutionPath, TokenBatch, prepare_model, run_path
from triage.trainers.diagnostics.precision import Precision
from triage.trainers.diagnostics.strict import STRICT_ATTENTION, check_strict_pair, strict_alignment
from triage.trainers.sampling.base import SamplingParams
from triage.trainers.sampling.hf import sample_with_kv_cache


def _activations(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(12, 64, generator=g)
    return x * torch.logspace(-1, 1, 12)[:, None]  # rows of very different magnitude, as tokens are


def test_tensor_amax_makes_a_token_depend_on_its_context():
    x = _activations()
    whole = quantize(x, QuantRecipe(scale="tensor"), backend="torch").dequantize(torch.float32)
    changed = 0
    for t in range(x.shape[0]):
        alone = quantize(x[t : t + 1], QuantRecipe(scale="tensor"), backend="torch").dequantize(torch.float32)
        changed += int(not torch.equal(alone[0], whole[t]))
    assert changed >= x.shape[0] // 2  # decoding a token alone quantizes it differently


def test_per_token_scale_removes_the_context_effect():
    x = _activations()
    whole = quantize(x, QuantRecipe(scale="row"), backend="torch")
    for t in range(x.shape[0]):
        alone = quantize(x[t : t + 1], QuantRecipe(scale="row"), backend="torch")
        assert torch.equal(alone.data[0], whole.data[t]) and torch.equal(alone.scale[0], whole.scale[t])
        assert torch.equal(alone.dequantize(torch.float32)[0], whole.dequantize(torch.float32)[t])


def test_context_effect_on_the_model(trained, batch):
    """Same recipe on both paths, batch-invariant kernels: only the activation scale domain differs."""
    model, _ = trained
    tensor = Precision("w4a4", "tensor")
    pair = compare_paths(
        model,
        ExecutionPath("learner", tensor, torch.float32),
        ExecutionPath("sampler", tensor, torch.float32),
        batch,
    )
    assert pair.mean_abs_delta > 1e-3
    token = Precision("w4a4", "token")
    strict = compare_paths(
        model,
        ExecutionPath("learner", token, torch.float32, strict=True),
        ExecutionPath("sampler", token, torch.float32, strict=True),
        batch,
    )
    assert strict.mean_abs_delta <= 1e-6


@pytest.mark.parametrize(
    "dtype,precision",
    [
        (torch.float32, Precision("w4a4", "token")),
        (torch.bfloat16, Precision()),
        (torch.bfloat16, Precision("w4a4", "token")),
    ],
)
def test_strict_learner_reproduces_the_builtin_sampler(trained, batch, dtype, precision):
    """HFSampler's own decode loop (left padding, finished rows fed pad) vs the learner's forward."""
    model, tokenizer = trained
    path = ExecutionPath("learner", precision, dtype, strict=True)
    engine = prepare_model(model, path)
    prompts = [
        batch.input_ids[i, : batch.prompt_width][
            batch.attention_mask[i, : batch.prompt_width].bool()
        ].tolist()
        for i in range(6)
    ]
    params = SamplingParams(max_new_tokens=12)
    gen = torch.Generator().manual_seed(3)
    with strict_alignment(engine):
        out = sample_with_kv_cache(
            engine, prompts, params, [tokenizer.eos_token_id], generator=gen, pad_id=tokenizer.pad_token_id
        )
    sampled = TokenBatch.from_lists(prompts, out["completion_ids"], tokenizer.pad_token_id)
    sampler_logps = torch.zeros(sampled.completion_mask.shape)
    for i, lp in enumerate(out["logprobs"]):
        sampler_logps[i, : len(lp)] = torch.tensor(lp)
    learner = run_path(engine, path, sampled).logps
    delta = (learner - sampler_logps)[sampled.completion_mask]
    assert delta.abs().mean() <= 1e-6
    assert engine.config._attn_implementation != STRICT_ATTENTION  # restored on exit


def test_strict_kernels_compute_the_same_function(trained, batch):
    """Strict mode changes the reduction order (fp64), not the model: fp32 log-probs agree to ~1e-6."""
    model, _ = trained
    engine = prepare_model(model, ExecutionPath("learner", Precision(), torch.float32))
    default = run_path(engine, ExecutionPath("learner", Precision(), torch.float32), batch).logps
    strict = run_path(engine, ExecutionPath("learner", Precision(), torch.float32, strict=True), batch).logps
    assert (default - strict).abs().max() < 1e-4
    assert torch.allclose(default, strict, atol=1e-5, rtol=0) or (default - strict).abs().mean() < 1e-6


@pytest.mark.parametrize(
    "kind,precision",
    [
        ("learner", Precision("w4a4", "token")),
        ("sampler", Precision("w4a4", "token")),
        ("sampler", Precision("w4a16")),
    ],
)
def test_strict_alignment_restores_the_model(trained, kind, precision):
    model, _ = trained
    engine = prepare_model(model, ExecutionPath(kind, precision, torch.float32))
    before = {name: dict(m.__dict__).get("forward") for name, m in engine.named_modules()}
    configs = {name: getattr(m, "config", None) for name, m in engine.named_modules()}
    attn = engine.config._attn_implementation
    with strict_alignment(engine):
        assert engine.config._attn_implementation == STRICT_ATTENTION
        assert any("forward" in m.__dict__ for m in engine.modules())
    assert engine.config._attn_implementation == attn
    assert {name: dict(m.__dict__).get("forward") for name, m in engine.named_modules()} == before
    assert all(getattr(m, "config", None) is configs[name] for name, m in engine.named_modules())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strict_weight_only_engine_layer_is_fp64_and_batch_invariant(trained, dtype):
    """A weight-only FrozenNVFP4Linear under strict alignment: ``RN(x·Ŵᵀ)`` from an fp64 product, for fp32
    activations too (its own fp32 path is an fp32 matmul), the same for a row alone or inside a batch."""
    model, _ = trained
    engine = prepare_model(model, ExecutionPath("sampler", Precision("w4a16"), dtype))
    layer = engine.get_submodule("model.layers.0.mlp.down_proj")
    assert isinstance(layer, FrozenNVFP4Linear)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(12, layer.in_features, generator=g) * torch.logspace(-1, 1, 12)[:, None]).to(dtype)
    w = layer.quantized_weight()
    exact = (x.double() @ (w.block_values().double() * w.global_scale.double())[:, : layer.in_features].T).to(
        dtype
    )
    with strict_alignment(engine):
        batched = layer(x)
        alone = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])
    assert torch.equal(batched, exact) and torch.equal(alone, exact)


def test_check_strict_pair_names_what_differs():
    token = Precision("w4a4", "token")
    check_strict_pair(token, token)
    with pytest.raises(ValueError, match="act_scale"):
        check_strict_pair(token, Precision("w4a4", "static"))
    with pytest.raises(ValueError, match="context dependence"):
        check_strict_pair(Precision("w4a4", "tensor"), Precision("w4a4", "tensor"))
    with pytest.raises(ValueError, match="KV cache"):
        check_strict_pair(token, token, kv_cache="fp8")
    with pytest.raises(ValueError, match="profile"):
        check_strict_pair(token, Precision("w4a4", "token", profile="modelopt"))
