"""H200: the learner–sampler gap table on a Qwen3-architecture model, and the cost of strict alignment.

    python experiments/bench/bench_diagnose.py                       # Qwen3-0.6B shapes, random init
    python experiments/bench/bench_diagnose.py --model /path/to/qwen3 # local weights, if present
    python experiments/bench/bench_diagnose.py --quick                # 4 layers, fewer tokens (smoke)

Random init (``--init-std``, larger than the usual 0.02 so next-token distributions are not near-uniform)
unless ``--model`` names a local checkpoint. Tokens: random prompts, completions sampled at temperature 1
from the fp32 master with the built-in KV-cache sampler. Then every row of
``triage.trainers.diagnostics.gap_table.default_rows(bf16)`` (learner forward vs sampler decode on the GPU
kernels: Triton quantizer, Triton/cuBLAS NVFP4 GEMM, SDPA) and checks:

* orderings: w4a4 ≥ w4a16 ≥ bf16 and kv fp8 ≥ kv bf16 (printed PASS/FAIL);
* strict alignment: mean |δ| ≤ 1e-6 for the W4A4 per-token and the bf16 pairs (PASS/FAIL);
* speed: learner forward, default vs strict, ``triton.testing.do_bench`` median (ms), same recipe.

Writes ``$OUT/gap_table.json``, ``$OUT/delta_hist.png``, ``$OUT/layer_divergence.png`` and
``$OUT/bench_diagnose.txt`` when ``$OUT`` is set.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import triton

from triage.trainers.diagnostics.gap_table import default_rows, format_table, gap_table, write_gap_table
from triage.trainers.diagnostics.paths import ExecutionPath, TokenBatch, prepare_model
from triage.trainers.diagnostics.precision import Precision
from triage.trainers.diagnostics.strict import strict_alignment
from triage.trainers.sampling.base import SamplingParams
from triage.trainers.sampling.hf import sample_with_kv_cache


def build_model(args):
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        return model.cuda().eval().requires_grad_(False), args.model
    layers = 4 if args.quick else args.layers
    config = Qwen3Config(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        initializer_range=args.init_std,
    )
    torch.manual_seed(args.seed)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(config)
    return model.eval().requires_grad_(
        False
    ), f"qwen3-0.6b-shapes ({layers} layers, random init std {args.init_std})"


def sample(model, args) -> TokenBatch:
    g = torch.Generator(device="cuda").manual_seed(args.seed)
    vocab = model.config.vocab_size
    prompts = [
        torch.randint(0, vocab, (args.prompt_len,), generator=g, device="cuda").tolist()
        for _ in range(args.sequences)
    ]
    out = sample_with_kv_cache(
        model,
        prompts,
        SamplingParams(max_new_tokens=args.new_tokens),
        eos_ids=[],
        generator=g,
        pad_id=0,
    )
    return TokenBatch.from_lists(prompts, out["completion_ids"], pad_id=0)


def learner_speed(master, batch, precision, log) -> dict:
    path = ExecutionPath("learner", precision, torch.bfloat16)
    model = prepare_model(master, path)
    b = batch.to("cuda")
    kw = dict(
        input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids, use_cache=False
    )

    def fwd():
        with torch.no_grad():
            model(**kw)

    default = triton.testing.do_bench(fwd, warmup=3, rep=20, return_mode="median")
    with strict_alignment(model):
        strict = triton.testing.do_bench(fwd, warmup=3, rep=20, return_mode="median")
    name = precision.label()
    log(
        f"learner forward {name:<28} default {default:9.2f} ms   strict {strict:9.2f} ms   x{strict / default:.2f}"
    )
    return {"precision": name, "default_ms": default, "strict_ms": strict, "slowdown": strict / default}


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--init-std", type=float, default=0.05)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.sequences, args.new_tokens = 8, 32
    assert torch.cuda.is_available(), "bench_diagnose.py needs a CUDA GPU"
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    out_dir = os.environ.get("OUT")
    lines = []

    def log(msg=""):
        print(msg, flush=True)
        lines.append(msg)

    log(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    t0 = time.perf_counter()
    master, name = build_model(args)
    batch = sample(master, args)
    ent = batch.completion_mask.sum().item()
    log(
        f"model: {name}; {args.sequences} sequences, {ent} completion tokens; ready in {time.perf_counter() - t0:.1f}s"
    )
    table = gap_table(master, batch, default_rows(torch.bfloat16), tau=0.01, threshold=1e-2)
    table.update({"model": name, "dtype": "bf16", "device": torch.cuda.get_device_name()})
    log(format_table(table))
    log(f"table: {table['seconds']:.1f}s")

    def gap(axis, setting):
        return next(
            r["mean_abs_delta"] for r in table["rows"] if r["axis"] == axis and r["setting"] == setting
        )

    checks = {
        "w4a4 >= w4a16 >= bf16": gap("precision", "w4a4")
        >= gap("precision", "w4a16")
        >= gap("precision", "bf16"),
        "kv fp8 >= kv bf16": gap("kv_cache", "fp8") >= gap("kv_cache", "bf16"),
        "strict W4A4 per-token mean|d| <= 1e-6": gap("alignment", "strict") <= 1e-6,
        "strict bf16 mean|d| <= 1e-6": gap("alignment", "bf16 strict") <= 1e-6,
    }
    for k, ok in checks.items():
        log(f"{'PASS' if ok else 'FAIL'}  {k}")
    speed = [learner_speed(master, batch, p, log) for p in (Precision("w4a4", "token"), Precision())]
    table["strict_speed_do_bench"] = speed
    table["checks"] = checks
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        write_gap_table(table, out_dir)
        with open(os.path.join(out_dir, "bench_diagnose.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(os.path.join(out_dir, "bench_diagnose_speed.json"), "w") as f:
            json.dump({"speed": speed, "checks": checks}, f, indent=2)


if __name__ == "__main__":
    main()
