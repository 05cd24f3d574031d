"""Short end-to-end runs: every correction, every sampler source, TRL's batching knobs, all loss types."""

from __future__ import annotations

import math

import pytest
import torch
from sampling_fakes import FakeEngineServer
from trainer_testkit import PerturbedRollout, arithmetic_dataset, make_trainer, tiny_moe_model

from triage import CORRECTIONS


def _train(trainer):
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == trainer.args.max_steps
    for h in logs:
        assert math.isfinite(h["loss"])
    return logs


@pytest.mark.parametrize("correction", CORRECTIONS)
def test_two_steps_for_each_correction(tiny_model_dir, tmp_path, correction):
    trainer = make_trainer(tiny_model_dir, tmp_path, correction=correction)
    logs = _train(trainer)
    for h in logs:
        assert h["triage/tokens"] > 0
        shares = sum(h[f"triage/{c}/share"] for c in ("inert", "consistent", "amplify_down", "correct_up"))
        shares += h["triage/amplify_up/share"] + h["triage/correct_down/share"]
        assert shares == pytest.approx(1.0)


@pytest.mark.parametrize(
    "knobs",
    [
        dict(gradient_accumulation_steps=2),  # steps_per_generation = 2, aligned: δ from the live forward
        dict(steps_per_generation=2),  # misaligned: TRL computes old log-probs, δ uses them
        dict(num_iterations=2, gradient_accumulation_steps=2, steps_per_generation=1),
    ],
    ids=["grad-accum", "steps-per-generation", "num-iterations"],
)
def test_batching_knobs_update_tau_once_per_optimizer_step(tiny_model_dir, tmp_path, knobs):
    trainer = make_trainer(tiny_model_dir, tmp_path, tau="auto", per_device_train_batch_size=2, **knobs)
    _train(trainer)
    assert trainer.adaptive_tau.steps == trainer.args.max_steps
    assert trainer.adaptive_tau.value != trainer.triage_config.tau_init


@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "luspo", "vespo"])
def test_other_trl_loss_types_are_weighted_too(tiny_model_dir, tmp_path, loss_type):
    trainer = make_trainer(tiny_model_dir, tmp_path, loss_type=loss_type, max_steps=1)
    _train(trainer)


def _offline_store(dataset, tmp_path):
    g = torch.Generator().manual_seed(0)
    rows = []
    for row in dataset:
        for _ in range(2):
            n = int(torch.randint(1, 5, (1,), generator=g))
            ids = torch.randint(3, 440, (n,), generator=g).tolist() + [2]  # tiny vocab: 450
            rows.append(
                {
                    "prompt": row["prompt"],
                    "completion_ids": ids,
                    "sampler_logprobs": (-torch.rand(n + 1, generator=g) * 3).tolist(),
                }
            )
    return rows


@pytest.fixture
def fake_server():
    with FakeEngineServer() as server:
        yield server


@pytest.mark.parametrize(
    "source",
    ["hf-shared", "hf-bf16-copy", "offline", "sglang", "vllm-server"],
)
def test_two_steps_for_each_sampler_source(tiny_model_dir, tmp_path, dataset, source, request):
    """TriageGRPOConfig.sampler builds the source through make_sampler; 2 TRIAGE steps run on its log-probs."""
    kwargs = {}
    if source == "hf-shared":
        kind, kwargs = "hf", {"seed": 0}
    elif source == "hf-bf16-copy":  # the realistic local mismatch: the sampler runs in another precision
        kind, kwargs = "hf", {"seed": 0, "sampler_model": "copy", "dtype": "bfloat16"}
    elif source == "offline":
        kind, kwargs = "offline", {"data": _offline_store(dataset, tmp_path)}
    else:
        server = request.getfixturevalue("fake_server")
        kind = source
        kwargs = {"base_url": server.url, "seed": 0}
        if source == "vllm-server":
            kwargs["model"] = "tiny"
    trainer = make_trainer(
        tiny_model_dir, tmp_path, sampler=kind, sampler_kwargs=kwargs, rollout=None, dataset=dataset
    )
    from triage.trainers.sampling import SamplerSource

    assert isinstance(trainer.rollout_func, SamplerSource)  # built from the config by make_sampler
    logs = _train(trainer)
    assert all(h["triage/tokens"] > 0 for h in logs)
    if source == "hf-shared":  # same weights, same numerics: the only gap is kernel-level noise
        assert logs[0]["triage/mean_abs_delta"] < 1e-4
    if source == "hf-bf16-copy":
        assert logs[0]["triage/mean_abs_delta"] > 1e-4


def test_the_one_line_swap_trains_with_the_builtin_sampler(tiny_model_dir, tmp_path):
    """GRPOConfig(...) -> TriageGRPOConfig(...) with nothing else: no sampler, no rollout_func, use_vllm off.
    The correction needs sampler log-probs, so the built-in HF sampler (the learner's own weights) supplies them."""
    from triage.trainers.sampling import HFSampler

    trainer = make_trainer(tiny_model_dir, tmp_path, rollout=None, max_steps=1)
    source = trainer._sampler_source()
    assert isinstance(source, HFSampler) and source.sampler_model == "shared"
    logs = _train(trainer)
    assert (
        logs[0]["triage/tokens"] > 0 and logs[0]["triage/mean_abs_delta"] < 1e-4
    )  # same weights: noise only
    # correction="none" without any sampler log-probs is plain GRPOTrainer: it trains, logs no triage/...
    trainer = make_trainer(tiny_model_dir, tmp_path, rollout=None, correction="none", max_steps=1)
    assert trainer.rollout_func is None
    logs = _train(trainer)
    assert not any(k.startswith("triage/") for k in logs[0])


@pytest.mark.parametrize(
    "train, eval_, match",
    [
        ("question", None, r"train_dataset has no 'prompt' column \(columns: \['question', 'answer'\]\)"),
        ("prompt", "question", r"eval_dataset has no 'prompt' column"),
        ("prompt", {"aime": "question"}, r"eval_dataset\['aime'\] has no 'prompt' column"),
    ],
)
def test_a_dataset_without_the_prompt_column_is_refused_at_construction(
    tiny_model_dir, tmp_path, train, eval_, match
):
    def dataset(column):
        if isinstance(column, dict):
            return {key: dataset(value) for key, value in column.items()}
        if column in (None, "prompt"):
            return None if column is None else arithmetic_dataset()
        return arithmetic_dataset().rename_column("prompt", column)

    with pytest.raises(ValueError, match=match):
        make_trainer(
            tiny_model_dir,
            tmp_path,
            rollout=None,
            dataset=dataset(train),
            trainer_kwargs={"eval_dataset": dataset(eval_)},
        )


def test_rollout_wrapper_keeps_perturbed_rollout_deterministic(tiny_model_dir, tmp_path):
    """Two identical runs give identical losses (the basis of the resume test)."""
    a = _train(make_trainer(tiny_model_dir, tmp_path / "a", rollout=PerturbedRollout()))
    b = _train(make_trainer(tiny_model_dir, tmp_path / "b", rollout=PerturbedRollout()))
    assert [h["loss"] for h in a] == [h["loss"] for h in b]


def _nvfp4_learner(model_dir, output_dir, **args):
    """One-step trainer: NVFP4 learner, built-in HF sampler (``sampler_kwargs`` picks its numerics)."""
    values = dict(
        max_steps=1, per_device_train_batch_size=2, max_completion_length=3, learner_precision="nvfp4"
    )
    return make_trainer(model_dir, output_dir, sampler="hf", rollout=None, **values, **args)


def test_nvfp4_learner_and_nvfp4_sampler_copy(tiny_model_dir, tmp_path, monkeypatch):
    """learner_precision='nvfp4' converts the learner's Linears; the recipes' hf sampler keys build an NVFP4 copy.

    The kernels' torch reference twins run here (interpreter off): the Triton kernels have their own tests.
    """
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from triage.kernels import NVFP4Linear

    trainer = _nvfp4_learner(
        tiny_model_dir,
        tmp_path,
        quant_recipe={"block": "1x16", "scale": "tensor", "profile": "te"},
        sampler_kwargs={"seed": 0, "precision": "nvfp4", "quant_recipe": {"scale": "row"}},
    )
    assert any(isinstance(m, NVFP4Linear) for m in trainer.model.modules())
    logs = _train(trainer)
    copy = trainer.rollout_func.copy
    layers = [m for m in copy.modules() if isinstance(m, NVFP4Linear)]
    # the copy is converted from the learner's high-precision weights with the sampler's own recipe
    assert layers and all(m.config.activation.scale == "row" for m in layers)
    assert "forward" not in copy.__dict__  # runs its own (NVFP4) forward, not the learner's patched one
    assert logs[0]["triage/mean_abs_delta"] > 1e-3  # two different NVFP4 recipes disagree
    # the trainer's (fused by default) optimizer step made every cached W_q stale: the next forward re-quantizes
    from triage.kernels.linear import weight_key

    cached = [m for m in trainer.model.modules() if isinstance(m, NVFP4Linear) and m._weight_cache.key]
    assert cached and all(m._weight_cache.key[:-1] != weight_key(m.weight) for m in cached)


def test_bf16_sampler_copy_of_an_nvfp4_learner_is_bf16(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from triage.kernels import NVFP4Linear

    trainer = _nvfp4_learner(tiny_model_dir, tmp_path, sampler_kwargs={"seed": 0, "precision": "bf16"})
    _train(trainer)
    copy = trainer.rollout_func.copy
    assert not any(isinstance(m, NVFP4Linear) for m in copy.modules())
    assert any(isinstance(m, NVFP4Linear) for m in trainer.model.modules())  # the learner stays NVFP4
    assert next(copy.parameters()).dtype == torch.bfloat16


def test_sequence_level_importance_sampling_and_trl_opsm_compose(tiny_model_dir, tmp_path):
    """importance_sampling_level='sequence' ((B,1) surrogate × (B,T) weights) and TRL's own OPSM with TRIAGE."""
    trainer = make_trainer(
        tiny_model_dir,
        tmp_path,
        max_steps=1,
        importance_sampling_level="sequence",
        off_policy_mask_threshold=0.1,
    )
    _train(trainer)


def test_nvfp4_learner_converts_fused_moe_experts(tmp_path, monkeypatch):
    """A Qwen3-MoE learner: the fused experts become NVFP4MoeExperts (one outer scale per expert), the router
    stays high precision; a bf16 sampler copy gets the original experts back."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from triage.kernels import NVFP4MoeExperts
    from triage.trainers.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    model_dir = tmp_path / "moe"
    tiny_moe_model(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    trainer = _nvfp4_learner(
        str(model_dir), tmp_path / "out", sampler_kwargs={"seed": 0, "precision": "bf16"}
    )
    experts = [m for m in trainer.model.modules() if isinstance(m, NVFP4MoeExperts)]
    assert len(experts) == 2 and all(m.config.weight.scale == "expert" for m in experts)
    _train(trainer)
    copy = trainer.rollout_func.copy
    assert not any(isinstance(m, NVFP4MoeExperts) for m in copy.modules())
    assert type(copy.model.layers[0].mlp.experts).__name__ == "Qwen3MoeExperts"
