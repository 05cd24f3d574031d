"""The HF sampler copy in a real TriageGRPOTrainer run: built once, refreshed in place after every optimizer step
(TRL's default fused AdamW), and each refresh equals a fresh rebuild of the copy bit for bit."""

from __future__ import annotations

import pytest
import torch
from trainer_testkit import make_trainer


def _index_reward(completions, **kwargs):
    """Within-group variance whatever the completions are (non-zero advantages, so the weights move)."""
    return [float(i) for i in range(len(completions))]


@pytest.mark.parametrize("learner_precision", ["bf16", "nvfp4"])
def test_nvfp4_sampler_copy_is_refreshed_in_place_every_step(
    tiny_model_dir, tmp_path, monkeypatch, learner_precision
):
    monkeypatch.setenv(
        "TRITON_INTERPRET", "0"
    )  # the kernels' torch twins (the Triton kernels have their own tests)
    from triage.trainers.sampling import HFSampler

    trainer = make_trainer(
        tiny_model_dir,
        tmp_path,
        rollout=None,
        reward=_index_reward,
        sampler="hf",
        max_steps=3,
        per_device_train_batch_size=2,
        max_completion_length=8,
        learning_rate=5e-2,
        learner_precision=learner_precision,
        quant_recipe={"block": "1x16", "scale": "tensor", "profile": "te"}
        if learner_precision == "nvfp4"
        else None,
        sampler_kwargs={"seed": 0, "precision": "nvfp4", "quant_recipe": {"scale": "row"}},
    )
    sampler = trainer.rollout_func
    assert isinstance(sampler, HFSampler)
    builds, checked = [], []
    build, sync = sampler._build_copy, sampler.sync_weights

    def counted_build(source):
        builds.append(trainer.state.global_step)
        return build(source)

    def checked_sync(t):
        sync(t)
        with sampler._unwrapped(t) as source, torch.no_grad():
            rebuilt = build(source)
        mine, theirs = sampler.copy.state_dict(), rebuilt.state_dict()
        assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
        ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
        with torch.no_grad():
            assert torch.equal(sampler.copy(ids).logits, rebuilt(ids).logits)
        checked.append({k: v.clone() for k, v in mine.items()})

    sampler._build_copy, sampler.sync_weights = counted_build, checked_sync
    assert trainer.args.optim.startswith("adamw_torch_fused")
    trainer.train()
    assert builds == [0] and len(checked) == 3  # one build, then one in-place refresh per optimizer step
    assert any(not torch.equal(checked[0][k], checked[-1][k]) for k in checked[0])  # it followed the training
