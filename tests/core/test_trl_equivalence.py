"""policy_loss equals TRL 1.16's GRPOTrainer._compute_loss bit for bit when all weights are 1.

TRL's real method runs on a stand-in ``self`` whose model returns the given log-probs, so the reference is
TRL's own code, not a re-typed copy.
"""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from trl import GRPOTrainer

from triage import TriageConfig, policy_loss, token_gap, token_weights


class _SingleProcess:
    num_processes = 1
    sync_gradients = True

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather

    @staticmethod
    def reduce(x, reduction="sum"):
        return x


def trl_loss(
    logps,
    old,
    adv,
    mask,
    *,
    loss_type,
    eps_low=0.2,
    eps_high=0.28,
    level="token",
    delta=None,
    max_len=None,
    num_items=None,
    is_ratio=None,
):
    args = SimpleNamespace(delta=delta, use_bias_correction_kl=True, steps_per_generation=1)
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=level,
        beta=0.0,
        loss_type=loss_type,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        args=args,
        use_vllm=is_ratio is not None,
        vllm_importance_sampling_correction=is_ratio is not None,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=max_len,
        accelerator=_SingleProcess(),
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics={"train": defaultdict(list)},
    )
    inputs = {
        "prompt_ids": torch.zeros(logps.shape[0], 1, dtype=torch.long),
        "prompt_mask": torch.ones(logps.shape[0], 1, dtype=torch.long),
        "completion_ids": torch.zeros(logps.shape, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "num_items_in_batch": torch.tensor(float(num_items if num_items is not None else mask.sum())),
    }
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    return GRPOTrainer._compute_loss(fake, None, inputs)


def _batch(seed, B=6, T=9):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 4
    logps = (old + 0.3 * torch.randn(B, T, generator=g)).clamp(max=0.0)
    adv = torch.randn(B, generator=g)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    return logps, old, adv, mask


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("seed", [0, 1])
def test_unit_weights_match_trl_exactly(loss_type, level, seed):
    logps, old, adv, mask = _batch(seed)
    kwargs = dict(
        loss_type=loss_type,
        epsilon_low=0.2,
        epsilon_high=0.28,
        importance_sampling_level=level,
        max_completion_length=12,
        num_items_in_batch=mask.sum(),
    )
    expected = trl_loss(logps, old, adv, mask, loss_type=loss_type, level=level, max_len=12)
    assert torch.equal(policy_loss(logps, old, adv, mask, None, **kwargs), expected)
    ones = torch.ones_like(logps)
    assert torch.equal(policy_loss(logps, old, adv, mask, ones, **kwargs), expected)
    none_weights = token_weights(token_gap(old, old - 0.01, mask), adv, mask, TriageConfig(correction="none"))
    assert torch.equal(policy_loss(logps, old, adv, mask, none_weights, **kwargs), expected)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_weights_act_like_trl_importance_ratio(loss_type):
    """A TIS weight through policy_loss equals TRL's own token_truncate IS ratio path (same multiply)."""
    logps, old, adv, mask = _batch(3)
    sampler = (old - 0.2 * torch.rand(old.shape)).clamp(max=0.0)
    w = token_weights(token_gap(old, sampler, mask), adv, mask, TriageConfig(correction="tis", is_cap=2.0))
    trl_ratio = torch.exp((old - sampler) * mask).clamp(max=2.0)
    expected = trl_loss(logps, old, adv, mask, loss_type=loss_type, is_ratio=trl_ratio, max_len=12)
    got = policy_loss(
        logps, old, adv, mask, w, loss_type=loss_type, epsilon_high=0.28, num_items_in_batch=mask.sum()
    )
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


def test_gradients_match_trl():
    logps, old, adv, mask = _batch(5)
    a = logps.clone().requires_grad_()
    b = logps.clone().requires_grad_()
    trl_loss(a, old, adv, mask, loss_type="dapo").backward()
    policy_loss(b, old, adv, mask, torch.ones_like(b), loss_type="dapo", epsilon_high=0.28).backward()
    assert torch.equal(a.grad, b.grad)
