"""Each source as the ``rollout_func`` of a plain TRL 1.16 GRPOTrainer: one CPU step on the tiny model."""

from __future__ import annotations

import pytest
from datasets import Dataset
from sampling_fakes import fake_completion
from trainer_testkit import make_trainer

from triage.trainers.sampling import HTTPOptions, encode_prompts, make_sampler

QUESTIONS = ["What is 12 + 35?", "Compute 7 * 8 - 3.", "Find x: 3x + 4 = 19.", "What is 5 + 9?"]
NUM_GENERATIONS = 2
MAX_NEW = 5


def chat(q):
    return [{"role": "user", "content": q}]


class Recorder:
    """Wraps a source; keeps what it returned and what the reward function then received."""

    def __init__(self, source):
        self.source, self.outputs, self.rewarded = source, [], []

    def __call__(self, prompts, trainer):
        assert len(prompts) % NUM_GENERATIONS == 0
        assert all(prompts[i] == prompts[i + 1] for i in range(0, len(prompts), NUM_GENERATIONS))
        out = self.source(prompts, trainer)
        self.outputs.append(out)
        return out

    def reward(self, completions, completion_ids, **kwargs):
        self.rewarded.append([list(c) for c in completion_ids])
        return [float(len(c) % 3) for c in completion_ids]


def offline_store(tokenizer):
    rows = []
    for q in QUESTIONS:
        (pid,) = encode_prompts([chat(q)], tokenizer)
        for k in range(NUM_GENERATIONS):
            ids, lps, _ = fake_completion(pid, k, MAX_NEW)
            rows.append({"prompt": chat(q), "completion_ids": ids, "sampler_logprobs": lps})
    return rows


def grpo_trainer(rollout, reward, model_dir, output_dir, **overrides):
    """A plain TRL ``GRPOTrainer`` for one step over ``QUESTIONS``, ``rollout`` as its ``rollout_func``."""
    from trl import GRPOConfig, GRPOTrainer

    return make_trainer(
        model_dir,
        output_dir,
        rollout=rollout,
        dataset=Dataset.from_list([{"prompt": chat(q)} for q in QUESTIONS]),
        reward=reward,
        trainer_cls=GRPOTrainer,
        config_cls=GRPOConfig,
        **{"max_steps": 1, "num_generations": NUM_GENERATIONS, "max_completion_length": MAX_NEW, **overrides},
    )


@pytest.mark.parametrize("kind", ["hf", "hf-copy", "sglang", "vllm-server", "offline"])
def test_one_grpo_step_per_source(kind, sampling_model_dir, fake_server, tokenizer, tmp_path):
    http = HTTPOptions(timeout_s=10.0, max_retries=0)
    source = {
        "hf": lambda: make_sampler("hf", seed=0),
        "hf-copy": lambda: make_sampler("hf", sampler_model="copy", seed=0),
        "sglang": lambda: make_sampler("sglang", base_url=fake_server.url, http=http),
        "vllm-server": lambda: make_sampler("vllm-server", base_url=fake_server.url, model="tiny", http=http),
        "offline": lambda: make_sampler("offline", data=offline_store(tokenizer)),
    }[kind]()
    recorder = Recorder(source)
    trainer = grpo_trainer(recorder, recorder.reward, sampling_model_dir, tmp_path)
    trainer.train()
    assert trainer.state.global_step == 1
    assert len(recorder.outputs) == 1 and recorder.rewarded == [recorder.outputs[0]["completion_ids"]]
    out = recorder.outputs[0]
    assert len(out["completion_ids"]) == 4 and all(1 <= len(c) <= MAX_NEW for c in out["completion_ids"])
    assert [len(c) for c in out["completion_ids"]] == [len(lp) for lp in out["logprobs"]]
    assert any("loss" in entry for entry in trainer.state.log_history)


def test_hf_sampler_logprobs_equal_trl_learner_logprobs(sampling_model_dir, tmp_path):
    """The HF sampler reports what TRL's learner computes (temperature only): delta = 0 in fp32."""
    import torch

    trainer = grpo_trainer(
        make_sampler("hf", seed=3),
        lambda completions, **kw: [0.0] * len(completions),
        sampling_model_dir,
        tmp_path,
        temperature=0.7,
    )
    prompts = [chat(q) for q in QUESTIONS for _ in range(NUM_GENERATIONS)]
    out = trainer.rollout_func(prompts, trainer)
    for p, c, lp in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"]):
        ids = torch.tensor([p + c])
        with torch.no_grad():
            learner, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, torch.ones_like(ids), len(c)
            )
        torch.testing.assert_close(torch.tensor(lp), learner[0].float(), atol=2e-5, rtol=0)


def test_hf_copy_runs_its_own_weights_not_the_trainers(sampling_model_dir, tmp_path):
    """TRL patches the model's forward with a closure over the original model; the copy must not inherit it."""
    import torch

    source = make_sampler("hf", sampler_model="copy", dtype=torch.bfloat16, seed=3)
    trainer = grpo_trainer(
        source, lambda completions, **kw: [0.0] * len(completions), sampling_model_dir, tmp_path
    )
    assert "forward" in vars(trainer.model)  # TRL's fused-LM-head patch, the reason for this test
    prompts = [chat(q) for q in QUESTIONS for _ in range(NUM_GENERATIONS)]
    out = trainer.rollout_func(prompts, trainer)
    assert next(source.copy.parameters()).dtype == torch.bfloat16 and "forward" not in vars(source.copy)
    reference = type(trainer.model).from_pretrained(sampling_model_dir, dtype=torch.bfloat16).eval()
    gaps = []
    for p, c, lp in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"]):
        ids = torch.tensor([p + c])
        with torch.no_grad():
            bf16 = torch.log_softmax(reference(ids).logits[0, len(p) - 1 : -1].float(), -1)
            learner, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, torch.ones_like(ids), len(c)
            )
        torch.testing.assert_close(
            torch.tensor(lp), bf16.gather(1, torch.tensor(c)[:, None])[:, 0], atol=1e-2, rtol=0
        )
        gaps.append((torch.tensor(lp) - learner[0]).abs())
    assert torch.cat(gaps).mean() > 1e-4  # a bf16 sampler against the fp32 learner: a real gap, not zero
