"""GPU check of the HF sampler (a script, not a pytest module): KV-cache log-probs vs a full re-forward, and speed.

Builds a random ~0.2B-parameter Qwen3 locally (no hub, no tokenizer: random prompt ids), samples a left-padded
batch with :func:`triage.trainers.sampling.sample_with_kv_cache` and compares every reported log-prob with
``log_softmax(logits / T)`` from one unpadded, cache-free forward of prompt + completion, per row:

* fp32 (TF32 off): the two paths must agree to ~1e-5 (asserted < 1e-3);
* bf16: the gap is reported, not asserted: it is a real sampler/learner mismatch (different kernels and
  reduction shapes for a 1-token decode step vs a full-sequence forward).

Then times the decode loop against ``model.generate`` (same sampling, EOS off so both run max_new tokens) with
``triton.testing.do_bench`` (median), for two batch sizes. Writes ``$OUT/hf_sampler_check.json`` when ``$OUT`` is
set. Usage: ``pip install -q --no-deps -e . && python tests/sampling/gpu_hf_sampler_check.py``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch


def build(dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=32768,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to("cuda", dtype).eval()
    # random init logits are nearly flat; widen them so sampling is not uniform noise
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(8.0)
    return model


def random_prompts(n, vocab, lo=16, hi=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (m,), generator=g).tolist() for m in lengths]


@torch.no_grad()
def reforward_gap(model, prompts, out, temperature):
    gaps = []
    for p, c, lp in zip(prompts, out["completion_ids"], out["logprobs"]):
        ids = torch.tensor([p + c], device="cuda")
        logits = model(ids, use_cache=False).logits[0, len(p) - 1 : -1].float() / temperature
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(c, device="cuda")[:, None])[:, 0]
        gaps.append((torch.tensor(lp, device="cuda") - ref).abs())
    gaps = torch.cat(gaps)
    return gaps.max().item(), gaps.mean().item(), gaps.numel()


def main():
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    import triton.testing

    from triage.trainers.sampling import SamplingParams, sample_with_kv_cache

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    temperature, max_new = 0.8, 128
    params = SamplingParams(max_new_tokens=max_new, temperature=temperature)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    print(f"{report['device']}  torch {torch.__version__}")

    print(
        f"\ncorrectness: KV-cache vs full re-forward log-probs, 16 left-padded prompts, T={temperature}, {max_new} new"
    )
    print(f"{'dtype':>8} {'tokens':>7} {'max|gap|':>10} {'mean|gap|':>10} {'same seed same out':>19}")
    for dtype in (torch.float32, torch.bfloat16):
        model = build(dtype)
        prompts = random_prompts(16, model.config.vocab_size)
        runs = []
        for _ in range(2):
            g = torch.Generator(device="cuda").manual_seed(1234)
            runs.append(sample_with_kv_cache(model, prompts, params, eos_ids=[2], generator=g, pad_id=0))
        gmax, gmean, n = reforward_gap(model, prompts, runs[0], temperature)
        same = runs[0]["completion_ids"] == runs[1]["completion_ids"]
        name = str(dtype).replace("torch.", "")
        print(f"{name:>8} {n:>7} {gmax:>10.2e} {gmean:>10.2e} {str(same):>19}")
        report["rows"].append(
            {
                "check": "reforward",
                "dtype": name,
                "tokens": n,
                "max_gap": gmax,
                "mean_gap": gmean,
                "deterministic": same,
            }
        )
        if dtype == torch.float32:
            assert gmax < 1e-3, f"fp32 KV-cache log-probs differ from the re-forward by {gmax}"
        del model
        torch.cuda.empty_cache()

    print(f"\nspeed: bf16, {max_new} new tokens (EOS off), prompts 16-96 tokens; median of do_bench")
    print(f"{'batch':>6} {'kv loop ms':>11} {'generate ms':>12} {'kv tok/s':>10} {'gen tok/s':>10}")
    model = build(torch.bfloat16)
    for batch in (16, 64):
        prompts = random_prompts(batch, model.config.vocab_size, seed=batch)
        width = max(map(len, prompts))
        ids = torch.zeros((batch, width), dtype=torch.long, device="cuda")
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, device="cuda")
            mask[i, width - len(p) :] = 1
        g = torch.Generator(device="cuda").manual_seed(0)

        def loop(prompts=prompts, g=g):
            return sample_with_kv_cache(model, prompts, params, eos_ids=[], generator=g, pad_id=0)

        def gen(ids=ids, mask=mask):
            return model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                pad_token_id=0,
                eos_token_id=None,
            )

        t0 = time.perf_counter()
        loop_ms = triton.testing.do_bench(loop, warmup=200, rep=3000, return_mode="median")
        gen_ms = triton.testing.do_bench(gen, warmup=200, rep=3000, return_mode="median")
        toks = batch * max_new
        print(
            f"{batch:>6} {loop_ms:>11.1f} {gen_ms:>12.1f} {toks / loop_ms * 1e3:>10.0f} {toks / gen_ms * 1e3:>10.0f}"
        )
        report["rows"].append(
            {
                "check": "speed",
                "batch": batch,
                "kv_loop_ms": loop_ms,
                "generate_ms": gen_ms,
                "bench_s": time.perf_counter() - t0,
            }
        )

    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "hf_sampler_check.json")
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
