"""LoRA on NVFP4 (the QeRL setting) vs LoRA on BF16: correctness, memory, step time, decode, δ.

    python experiments/bench/bench_lora.py                       # GPU: Qwen3-0.6B shapes, random init
    python experiments/bench/bench_lora.py --tiny --sections delta   # CPU: the δ table on a tiny Qwen3

Sections (``--sections``, comma-separated; default all that the device supports):

* ``check`` (CUDA): ``FrozenNVFP4Linear`` with the default backends (Triton/cuBLAS) against its torch
  reference twin on real layer shapes, forward (W4A4, W4A16) and input gradient, max relative error.
* ``memory`` (CUDA): per variant, the bytes of the decoder Linear weights (frozen NVFP4 base vs bf16), the
  memory allocated after building, and the peak and median step time (``triton.testing.do_bench``) of one
  LoRA training step: forward + backward (mean next-token loss on ``--batch × --seq`` random tokens) +
  AdamW on the adapters.
* ``decode`` (CUDA): tokens/s of the built-in sampler's decode loop (``sample_with_kv_cache``, KV cache,
  prompt 128 tokens, ``--new`` new tokens, no EOS) with the shared base, per batch size.
* ``delta``: δ = log π_learner − log π_sampler (``triage.token_gap``) when the sampler and the learner share
  the model: sampled with the KV-cache decode loop, recomputed with one full forward (equal-length prompts,
  no padding: only precision and kernel paths differ). LoRA settings use random non-zero adapters.

Needs peft (a pure-Python wheel; not trl). Writes ``$OUT/bench_lora.md`` and ``$OUT/bench_lora.json`` when
OUT is set.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gemm import _ensure_triage  # noqa: E402

_ensure_triage()

import torch  # noqa: E402

try:
    import peft  # noqa: F401
except ImportError:  # pragma: no cover
    sys.exit("bench_lora.py needs peft: install it (pip install peft==0.21.2)")

from peft import LoraConfig, get_peft_model  # noqa: E402

from triage import token_gap  # noqa: E402
from triage.kernels import NVFP4Config, NVFP4LinearConfig, convert  # noqa: E402
from triage.kernels.frozen_linear import FrozenNVFP4Linear, NVFP4FrozenConfig, base_nbytes  # noqa: E402
from triage.kernels.nvfp4 import QuantRecipe  # noqa: E402
from triage.trainers.peft_nvfp4 import nvfp4_lora  # noqa: E402

SHAPES = {
    "0.6b": dict(
        hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8, head_dim=128
    ),
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16
    ),
}
LORA_VARIANTS = ("bf16-lora", "nvfp4-lora-w4a16", "nvfp4-lora-w4a4")


def build(shape: str, layers: int, vocab: int, dtype, device):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=vocab,
        num_hidden_layers=layers,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        **SHAPES[shape],
    )
    return Qwen3ForCausalLM(cfg).to(device, dtype)


def variant(name: str, model, rank: int, *, cache: bool = False, random_adapters: bool = False):
    """A model for one setting. LoRA variants are PEFT models over ``model``'s decoder Linears."""
    lora = LoraConfig(r=rank, lora_alpha=rank, target_modules="all-linear")
    row = QuantRecipe(scale="row")
    if name.startswith("full-nvfp4"):
        linear = NVFP4LinearConfig(activation=row) if name.endswith("-row") else NVFP4LinearConfig()
        return convert(model, NVFP4Config(linear=linear, moe=None))
    if name == "bf16-lora":
        peft_model = get_peft_model(model, lora)
    else:
        mode = "w4a16" if "w4a16" in name else "w4a4"
        base = NVFP4FrozenConfig(
            compute=mode, cache_expanded=cache, activation=row if name.endswith("-row") else QuantRecipe()
        )
        model, lora = nvfp4_lora(model, lora, NVFP4Config(moe=None, frozen=base))
        peft_model = get_peft_model(model, lora)
    if random_adapters:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for n, p in peft_model.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return peft_model


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------- check


def section_check(lines: list[str], results: dict) -> None:
    from triage.kernels.nvfp4 import quantize

    lines += ["", "## check: FrozenNVFP4Linear (default backends) vs torch reference", ""]
    lines += ["| mode | N×K | M | fwd max rel err | dgrad max rel err |", "|---|---|---|---|---|"]
    out = []
    for n, k in ((3072, 1024), (1024, 3072)):
        w = torch.randn(n, k, device="cuda") * 0.02
        wq = quantize(w, QuantRecipe())
        for mode in ("w4a4", "w4a16"):
            fast = FrozenNVFP4Linear.from_quantized(wq, None, NVFP4FrozenConfig(compute=mode))
            ref = FrozenNVFP4Linear.from_quantized(
                wq, None, NVFP4FrozenConfig(compute=mode, gemm_backend="reference", quant_backend="torch")
            )
            for m in (1, 16, 64, 4096):
                x = (torch.randn(m, k, device="cuda") * 2).bfloat16().requires_grad_(True)
                y = fast(x)
                yr = ref(x.detach())
                dy = torch.randn_like(y)
                y.backward(dy)
                dxr = (dy.double() @ wq.dequantize(torch.float64)).to(x.dtype)
                e_f = ((y.float() - yr.float()).abs().max() / yr.float().abs().max()).item()
                e_b = ((x.grad.float() - dxr.float()).abs().max() / dxr.float().abs().max()).item()
                lines.append(f"| {mode} | {n}×{k} | {m} | {e_f:.2e} | {e_b:.2e} |")
                out.append(dict(mode=mode, n=n, k=k, m=m, fwd_rel_err=e_f, dgrad_rel_err=e_b))
    results["check"] = out


# ------------------------------------------------------------------------------------------ memory/step


def section_memory(args, lines: list[str], results: dict) -> None:
    lines += ["", f"## memory and step time: {args.batch}×{args.seq} tokens, LoRA r={args.rank}, AdamW", ""]
    lines += [
        "| variant | decoder Linear weights | allocated after build | peak in step | step (median) | tok/s |",
        "|---|---|---|---|---|---|",
    ]
    out = []
    names = [*LORA_VARIANTS, "nvfp4-lora-w4a16+cache", "nvfp4-lora-w4a4+cache"]
    for name in names:
        free()
        model = build("0.6b", args.layers, args.vocab, torch.bfloat16, "cuda")
        if name == "bf16-lora":
            linear_bytes = sum(
                m.weight.numel() * m.weight.element_size()
                for n, m in model.named_modules()
                if isinstance(m, torch.nn.Linear) and "lm_head" not in n
            )
        pm = variant(name.split("+")[0], model, args.rank, cache=name.endswith("+cache"))
        if name != "bf16-lora":
            linear_bytes = base_nbytes(pm)[0]
        if args.checkpointing:
            pm.gradient_checkpointing_enable()
            pm.enable_input_require_grads()
        free()
        allocated = torch.cuda.memory_allocated()
        peak, ms = _step_peak_and_time(pm, args)
        tok_s = args.batch * args.seq / (ms / 1e3)
        lines.append(
            f"| {name} | {linear_bytes / 2**20:,.0f} MiB | {allocated / 2**30:.2f} GiB | {peak / 2**30:.2f} GiB | "
            f"{ms:.1f} ms | {tok_s:,.0f} |"
        )
        out.append(dict(variant=name, linear_bytes=linear_bytes, allocated=allocated, peak=peak, step_ms=ms))
        del pm, model
    results["memory"] = out


def _step_peak_and_time(pm, args) -> tuple[int, float]:
    """(peak bytes, median ms) of one LoRA step: forward + backward + AdamW on the trainable parameters."""
    import triton

    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-5)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda")

    def step():
        pm(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    torch.cuda.reset_peak_memory_stats()
    step()
    peak = torch.cuda.max_memory_allocated()
    return peak, triton.testing.do_bench(step, warmup=200, rep=1000, return_mode="median")


# ---------------------------------------------------------------------------------------------- decode


def section_decode(args, lines: list[str], results: dict) -> None:
    from triage.trainers.sampling.base import SamplingParams

    lines += ["", f"## decode: prompt 128 + {args.new} new tokens, KV cache (HF sampler loop), tokens/s", ""]
    batches = (1, 16, 64)
    lines += [
        "| variant | " + " | ".join(f"batch {b}" for b in batches) + " |",
        "|---|" + "---|" * len(batches),
    ]
    params = SamplingParams(max_new_tokens=args.new)
    out = []
    for name in LORA_VARIANTS:
        free()
        pm = variant(name, build("0.6b", args.layers, args.vocab, torch.bfloat16, "cuda"), args.rank).eval()
        row = []
        for b in batches:
            ms = _decode_ms(pm, b, args, params)
            tps = b * args.new / (ms / 1e3)
            row.append(f"{tps:,.0f}")
            out.append(dict(variant=name, batch=b, ms=ms, tokens_per_s=tps))
        lines.append(f"| {name} | " + " | ".join(row) + " |")
        del pm
    results["decode"] = out


def _decode_ms(pm, batch: int, args, params) -> float:
    """Median ms of one generation (``do_bench``; a few whole generations) of ``batch`` random prompts."""
    import triton

    from triage.trainers.sampling.hf import sample_with_kv_cache

    prompts = torch.randint(0, args.vocab, (batch, 128)).tolist()
    gen = torch.Generator(device="cuda").manual_seed(0)
    return triton.testing.do_bench(
        lambda: sample_with_kv_cache(pm, prompts, params, [], generator=gen),
        warmup=1,
        rep=1,
        return_mode="median",
    )


# ----------------------------------------------------------------------------------------------- delta


@torch.no_grad()
def learner_sampler_gap(model, prompts: list[list[int]], new: int, seed: int = 0) -> dict[str, float]:
    """Sample with the KV-cache loop, recompute with one full forward, return |δ| statistics."""
    from triage.trainers.sampling.base import SamplingParams
    from triage.trainers.sampling.hf import sample_with_kv_cache

    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    model.eval()
    out = sample_with_kv_cache(model, prompts, SamplingParams(max_new_tokens=new), [], generator=gen)
    comp = torch.tensor(out["completion_ids"], device=device)
    sampler = torch.tensor(out["logprobs"], device=device, dtype=torch.float32)
    ids = torch.cat([torch.tensor(prompts, device=device), comp], dim=1)
    p = len(prompts[0])
    logits = model(input_ids=ids).logits[:, p - 1 : -1].float()
    learner = torch.log_softmax(logits, -1).gather(-1, comp[..., None])[..., 0]
    mask = torch.ones_like(learner, dtype=torch.bool)
    d = token_gap(learner, sampler, mask).abs().flatten()
    return dict(
        tokens=d.numel(),
        mean_abs=d.mean().item(),
        p99_abs=d.quantile(0.99).item(),
        max_abs=d.max().item(),
    )


def section_delta(args, lines: list[str], results: dict) -> None:
    cuda = torch.cuda.is_available() and not args.tiny
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    shape, layers, vocab = ("0.6b", args.layers, args.vocab) if not args.tiny else ("tiny", 2, 512)
    lines += ["", f"## δ, shared sampler/learner: {shape} shapes, {str(dtype)[6:]} model on {device}", ""]
    lines += ["| setting | tokens | mean \\|δ\\| | p99 \\|δ\\| | max \\|δ\\| |", "|---|---|---|---|---|"]
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (args.delta_batch, 32), generator=g).tolist()
    names = [
        "bf16-lora",
        "nvfp4-lora-w4a16",
        "nvfp4-lora-w4a4",
        "nvfp4-lora-w4a4-row",
        "full-nvfp4",
        "full-nvfp4-row",
    ]
    out = []
    for name in names:
        free()
        model = variant(name, build(shape, layers, vocab, dtype, device), args.rank, random_adapters=True)
        stats = learner_sampler_gap(model, prompts, args.delta_new)
        lines.append(
            f"| {name} | {stats['tokens']} | {stats['mean_abs']:.2e} | {stats['p99_abs']:.2e} | {stats['max_abs']:.2e} |"
        )
        out.append(dict(setting=name, **stats))
        del model
    lines += [
        "",
        "`-row`: activations quantized with a per-token outer scale (`QuantRecipe(scale='row')`) instead of one",
        "per tensor; a per-tensor dynamic scale depends on which tokens share the GEMM (decode step vs full sequence).",
    ]
    results["delta"] = out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sections", default=None, help="comma-separated: check,memory,decode,delta")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--new", type=int, default=64, help="decode: new tokens per sequence")
    p.add_argument("--delta-batch", type=int, default=16)
    p.add_argument("--delta-new", type=int, default=48)
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing in the step")
    p.add_argument("--tiny", action="store_true", help="δ on a tiny Qwen3 (runs on CPU)")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    default = "check,memory,decode,delta" if cuda and not args.tiny else "delta"
    sections = (args.sections or default).split(",")
    if not cuda and set(sections) - {"delta"}:
        sys.exit(f"sections {sorted(set(sections) - {'delta'})} need CUDA")
    if cuda:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    lines = [f"# LoRA on NVFP4 vs LoRA on BF16 ({torch.cuda.get_device_name() if cuda else 'CPU'})"]
    results: dict = {"args": vars(args)}
    for s in sections:
        {"check": lambda: section_check(lines, results),
         "memory": lambda: section_memory(args, lines, results),
         "decode": lambda: section_decode(args, lines, results),
         "delta": lambda: section_delta(args, lines, results)}[s]()  # fmt: skip
        print("\n".join(lines), flush=True) if s == sections[-1] else None
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_lora.md").write_text("\n".join(lines) + "\n")
        Path(os.environ["OUT"], "bench_lora.json").write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
