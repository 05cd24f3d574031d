"""Helpers shared by the trainer tests (imported by name: this folder is on sys.path under pytest)."""

from __future__ import annotations

import torch
from datasets import Dataset


def arithmetic_dataset(n: int = 8) -> Dataset:
    rows = [
        {"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
        for a, b in [(i, (3 * i) % 5) for i in range(n)]
    ]
    return Dataset.from_list(rows)


def length_reward(completions, completion_ids, **kwargs):
    """A deterministic reward with within-group variance: completion length mod 3."""
    return [float(len(ids) % 3) for ids in completion_ids]


class PerturbedRollout:
    """A deterministic ``rollout_func``: random completions, sampler log-probs = learner log-probs + noise.

    The learner log-probs are computed with the trainer's current model (temperature 1), so δ = −noise
    exactly (up to fp32 rounding) — a controlled engine mismatch. Randomness is seeded by the trainer's
    ``global_step`` and the call index within the step, so a resumed run sees the same rollouts.
    ``corrupt(out)`` may edit the output dict (bad-input tests).
    """

    def __init__(self, noise: float = 0.3, max_len: int = 6, corrupt=None, seed: int = 0):
        self.noise, self.max_len, self.corrupt, self.seed = noise, max_len, corrupt, seed
        self.calls: dict[int, int] = {}

    def __call__(self, prompts, trainer):
        tok = trainer.processing_class
        model = trainer.accelerator.unwrap_model(trainer.model)
        step = int(trainer.state.global_step)
        call = self.calls.get(step, 0)
        self.calls[step] = call + 1
        rank = trainer.accelerator.process_index
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1009 + call * 101 + rank)
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for prompt in prompts:
            pid = tok.apply_chat_template(
                prompt, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            n = int(torch.randint(1, self.max_len, (1,), generator=g))
            cid = torch.randint(3, len(tok), (n,), generator=g).tolist() + [tok.eos_token_id]
            with torch.no_grad():
                logits = model(torch.tensor([pid + cid])).logits[0, len(pid) - 1 : -1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(cid)[:, None])[:, 0]
            lp = (lp + self.noise * torch.randn(lp.shape, generator=g)).clamp(max=0.0)
            out["prompt_ids"].append(pid)
            out["completion_ids"].append(cid)
            out["logprobs"].append(lp.tolist())
        if self.corrupt is not None:
            self.corrupt(out)
        return out


def tiny_moe_model(tokenizer, seed: int = 0):
    """A random 2-layer Qwen3-MoE (4 experts, 2 per token) over ``tokenizer``'s vocabulary."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config)


def make_args(output_dir, config_cls=None, **overrides):
    """A 2-step CPU run's config (``config_cls``: ``TriageGRPOConfig`` by default, or TRL's ``GRPOConfig``)."""
    from triage.trainers import TriageGRPOConfig

    values = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=False,
        max_steps=2,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        learning_rate=1e-3,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    values.update(overrides)
    return (config_cls or TriageGRPOConfig)(**values)


def make_trainer(
    model,
    output_dir,
    rollout="perturbed",
    dataset=None,
    reward=length_reward,
    trainer_cls=None,
    config_cls=None,
    trainer_kwargs=None,
    **args,
):
    """``trainer_cls`` (``TriageGRPOTrainer`` by default) over ``model`` (a path or a module) with
    :func:`make_args` ``(output_dir, config_cls, **args)``; ``trainer_kwargs`` go to the trainer as they are
    (``processing_class``, ``peft_config``, ``callbacks``)."""
    from triage.trainers import TriageGRPOTrainer

    trainer_cls = trainer_cls or TriageGRPOTrainer
    return trainer_cls(
        model=model,
        reward_funcs=reward,
        args=make_args(output_dir, config_cls, **args),
        train_dataset=dataset if dataset is not None else arithmetic_dataset(),
        rollout_func=PerturbedRollout() if rollout == "perturbed" else rollout,
        **(trainer_kwargs or {}),
    )


#: A ``triage train`` recipe of 2 CPU steps on the tiny model (``base.yaml`` is layered under it by
#: ``load_recipe``): the built-in HF sampler on a bf16 copy of the fp32 learner.
TINY_RECIPE = {
    "model_name_or_path": "tiny",
    "dataset": {"source": "synthetic", "n": 8, "difficulty": 1},
    "reward_funcs": ["dapo_accuracy", {"soft_overlong": {"cache_length": 4}}],
    "learner_precision": "bf16",
    "quant_recipe": None,
    "use_cpu": True,
    "bf16": False,
    "gradient_checkpointing": False,
    "max_steps": 2,
    "per_device_train_batch_size": 4,
    "num_generations": 2,
    "max_completion_length": 8,
    "save_strategy": "no",
    "sampler": "hf",
    "sampler_kwargs": {"seed": 0, "precision": "bf16"},
    "tau": "auto",
}
