"""Step-time overhead of TRIAGE in ``TriageGRPOTrainer``: correction "triage" vs "none", same batch, same model.

Model: a random-init Qwen3-0.6B-architecture ``Qwen3ForCausalLM`` in bf16 (no hub: config written here;
``--tiny`` for a CPU smoke run). Rollouts: a ``rollout_func`` that returns random completions of a fixed
length with random sampler log-probs in [−3, 0) (never zeros), so generation costs ~nothing and is identical
in every arm; what differs between arms is only the trainer's TRIAGE work (δ, classes, weights, all-reduced
metrics, quantiles). Rewards are random (non-zero advantages).

Arms (each a fresh trainer from the same initial weights):

* ``grpo``          correction="none", log_mismatch_metrics=False — exactly TRL's GRPOTrainer path
* ``none+metrics``  correction="none", metrics on (δ and the triage/... metrics, loss untouched)
* ``triage``        correction="triage", fixed τ
* ``triage-auto``   correction="triage", tau="auto" (adds the gathered-δ median per optimizer step)

Timing: wall-clock per optimizer step (``torch.cuda.synchronize`` at step begin/end), median over the steps
after ``--warmup``; plus ``triton.testing.do_bench`` (median) of the per-micro-batch TRIAGE math alone on
the same (B, T). Prints a table and writes ``bench_trainer_overhead.json`` (and the log) to ``$OUT`` if set.

    python experiments/bench/bench_trainer_overhead.py                  # H200: Qwen3-0.6B shape
    python experiments/bench/bench_trainer_overhead.py --tiny --steps 3 # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

QWEN3_0_6B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
TINY = dict(QWEN3_0_6B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip

ARMS = {
    "grpo": dict(correction="none", log_mismatch_metrics=False),
    "none+metrics": dict(correction="none"),
    "triage": dict(correction="triage", tau=0.05),
    "triage-auto": dict(correction="triage", tau="auto"),
}


def build_model(shape: dict, dtype: torch.dtype, device: str, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(**shape, bos_token_id=None, eos_token_id=2, pad_token_id=0)
    with torch.device(device):  # random init directly on the GPU (0.6B params: seconds, not a minute)
        model = Qwen3ForCausalLM(config)
    return model.to(dtype=dtype)


class RandomRollout:
    """Fixed-length random completions with random sampler log-probs in [−3, 0); seeded per call."""

    def __init__(self, prompt_len: int, completion_len: int, token_high: int, seed: int = 0):
        self.prompt_len, self.completion_len, self.token_high = prompt_len, completion_len, token_high
        self.calls = 0
        self.seed = seed

    def __call__(self, prompts, trainer):
        g = torch.Generator().manual_seed(self.seed + self.calls)
        self.calls += 1
        n = len(prompts)
        prompt_ids = torch.randint(3, self.token_high, (n, self.prompt_len), generator=g).tolist()
        completion_ids = torch.randint(3, self.token_high, (n, self.completion_len), generator=g).tolist()
        logprobs = (-3.0 * torch.rand(n, self.completion_len, generator=g) - 1e-3).tolist()
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}


def random_reward(completions, **_):
    return torch.rand(len(completions)).tolist()


class StepTimer:
    """Wall-clock per optimizer step, synchronized on CUDA."""

    def __init__(self):
        from transformers import TrainerCallback

        timer = self

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                timer._sync()
                timer._t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                timer._sync()
                timer.times.append(time.perf_counter() - timer._t0)

        self.times: list[float] = []
        self.callback = _Callback()

    @staticmethod
    def _sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()


def run_arm(name: str, opts: argparse.Namespace, shape: dict, device: str, dtype: torch.dtype) -> list[float]:
    from datasets import Dataset

    from triage.trainers.config import TriageGRPOConfig
    from triage.trainers.grpo_trainer import TriageGRPOTrainer
    from triage.trainers.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    model = build_model(shape, dtype, device)
    batch = opts.batch
    dataset = Dataset.from_list([{"prompt": f"p{i}"} for i in range(batch * (opts.steps + 1))])
    args = TriageGRPOConfig(
        output_dir=os.path.join(opts.workdir, name),
        use_cpu=device == "cpu",
        bf16=dtype == torch.bfloat16,
        max_steps=opts.steps,
        per_device_train_batch_size=batch,
        num_generations=opts.num_generations,
        max_completion_length=opts.completion_len,
        gradient_accumulation_steps=1,
        gradient_checkpointing=opts.gradient_checkpointing,
        learning_rate=1e-6,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        **ARMS[name],
    )
    timer = StepTimer()
    trainer = TriageGRPOTrainer(
        model=model,
        reward_funcs=random_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        rollout_func=RandomRollout(opts.prompt_len, opts.completion_len, len(tokenizer)),
        callbacks=[timer.callback],
    )
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    trainer.train()
    del trainer, model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return timer.times


def triage_math_ms(batch: int, length: int, device: str) -> dict[str, float]:
    """do_bench median (ms) of the hook's math on one micro-batch: δ, weights, sums, quantiles."""
    from triage import TriageConfig, delta_quantiles, mismatch_sums, token_gap, token_weights

    g = torch.Generator(device="cpu").manual_seed(0)
    learner = (-3.0 * torch.rand(batch, length, generator=g) - 1e-3).to(device)
    sampler = (learner + 0.05 * torch.randn(batch, length, generator=g).to(device)).clamp(max=0.0)
    mask = torch.ones(batch, length, dtype=torch.long, device=device)
    mask[:, length // 2 :] = (torch.rand(batch, length - length // 2, generator=g) > 0.3).long().to(device)
    adv = torch.randn(batch, generator=g).to(device)
    cfg = TriageConfig()

    def weights_only():
        d = token_gap(learner, sampler, mask)
        return token_weights(d, adv, mask, cfg)

    def with_metrics():
        d = token_gap(learner, sampler, mask)
        w = token_weights(d, adv, mask, cfg)
        sums = mismatch_sums(d, adv, mask, w, cfg)
        delta_quantiles(d, mask)
        return sums

    if device == "cuda":
        from triton.testing import do_bench

        return {"weights_ms": do_bench(weights_only, return_mode="median"),
                "weights+metrics_ms": do_bench(with_metrics, return_mode="median")}  # fmt: skip
    out = {}
    for key, fn in (("weights_ms", weights_only), ("weights+metrics_ms", with_metrics)):
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        out[key] = statistics.median(ts)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model on CPU (smoke run)")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per arm")
    parser.add_argument("--warmup", type=int, default=2, help="steps excluded from the median")
    parser.add_argument("--batch", type=int, default=16, help="completions per micro-batch (per device)")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--completion-len", type=int, default=1024)
    parser.add_argument("--gradient-checkpointing", action="store_true", help="TRL's default is on; off here")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of " + ",".join(ARMS))
    parser.add_argument(
        "--repeats", type=int, default=2, help="rounds over the arms (interleaved: less drift)"
    )
    parser.add_argument("--workdir", default=None, help="trainer output dirs (default: a temporary folder)")
    opts = parser.parse_args(argv)
    if opts.workdir is None:
        import tempfile

        opts.workdir = tempfile.mkdtemp(prefix="triage-bench-trainer-")
    if opts.tiny:
        opts.batch, opts.prompt_len, opts.completion_len = min(opts.batch, 4), 8, 16
        opts.num_generations = min(opts.num_generations, 2)
    device = "cuda" if torch.cuda.is_available() and not opts.tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shape = TINY if opts.tiny else QWEN3_0_6B
    if opts.steps <= opts.warmup:
        parser.error("--steps must exceed --warmup")

    env = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "shape": "tiny" if opts.tiny else "Qwen3-0.6B",
        "batch": opts.batch,
        "prompt_len": opts.prompt_len,
        "completion_len": opts.completion_len,
        "steps": opts.steps,
        "warmup": opts.warmup,
        "gradient_checkpointing": opts.gradient_checkpointing,
    }
    print(json.dumps(env))
    names = opts.arms.split(",")
    unknown = [n for n in names if n not in ARMS]
    if unknown:
        parser.error(f"unknown arms {unknown}; known: {list(ARMS)}")
    kept: dict[str, list[float]] = {n: [] for n in names}
    raw: dict[str, list[list[float]]] = {n: [] for n in names}
    for round_ in range(opts.repeats):
        for name in names:
            times = run_arm(name, opts, shape, device, dtype)
            raw[name].append(times)
            kept[name] += times[opts.warmup :]
            print(
                f"round {round_} {name:<14} median {statistics.median(times[opts.warmup :]) * 1e3:9.1f} ms/step"
            )
    results = {
        n: {"median_s": statistics.median(kept[n]), "min_s": min(kept[n]), "times_s": raw[n]} for n in names
    }
    base = results.get("grpo", {}).get("median_s")
    print(f"\n{'arm':<14} {'median ms/step':>15} {'overhead vs grpo':>18}")
    for name, r in results.items():
        over = f"{(r['median_s'] / base - 1) * 100:+.2f}%" if base else "n/a"
        print(f"{name:<14} {r['median_s'] * 1e3:15.1f} {over:>18}")
    math_ms = triage_math_ms(opts.batch, opts.completion_len, device)
    print(f"\nTRIAGE math per micro-batch ({opts.batch}x{opts.completion_len}): "
          + ", ".join(f"{k} {v:.3f}" for k, v in math_ms.items()))  # fmt: skip
    out = {"env": env, "arms": results, "triage_math": math_ms}
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        path = os.path.join(os.environ["OUT"], "bench_trainer_overhead.json")
        with open(path, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
