"""Learner step tokens/s on a Qwen3-architecture model (random init, ~0.6B): NVFP4 vs BF16. CUDA only.

    python experiments/bench/bench_linear.py [--layers 28] [--batch 8] [--seq 1024] [--steps 10] [--compile [MODE]]
        [--compile-scope layers|model] [--capturable] [--compare-share]

One step = forward + backward (mean next-token loss) + AdamW step, bf16 weights. NVFP4 converts every
decoder Linear with ``triage.kernels.convert`` (lm_head and embeddings stay bf16), bf16-backward (and
nvfp4-backward with ``--backward nvfp4-backward``); ``--capturable`` also times it with
``NVFP4LinearConfig(capturable=True)`` (eager, and under ``--compile``'s mode: with ``reduce-overhead`` CUDA
graphs then capture the NVFP4 layers too). ``--compile-scope``: ``layers`` (default) compiles each decoder
layer on its own (regional compilation: the layers share one compiled graph, so compiling takes about one
layer's time; embeddings, lm_head and the loss run eagerly), ``model`` the whole model (one graph of every
layer: minutes to compile at 28 layers). Writes ``$OUT/bench_linear.md`` when OUT is set.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gemm import _ensure_triage  # noqa: E402

_ensure_triage()

import torch  # noqa: E402


def build(layers: int, hidden: int = 1024, intermediate: int = 3072, heads: int = 16):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=151936,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    )
    return Qwen3ForCausalLM(cfg).to("cuda", torch.bfloat16)


class _Echo(list):
    """The report's lines, each printed (flushed) when it is added: a run stopped by its time limit still shows
    what it measured."""

    def append(self, line: str) -> None:
        print(line, flush=True)
        super().append(line)

    def __iadd__(self, more):
        for line in more:
            self.append(line)
        return self


def tokens_per_s(
    model, batch: int, seq: int, steps: int, compile: str | None = None, scope: str = "layers"
) -> float:
    """Tokens/s of ``steps`` training steps after 2 warm-up steps (4 under ``torch.compile(mode=compile)``:
    compilation, and a recompile for the second call's state, stay out of the timed window); no KV cache is
    built. ``"reduce-overhead"`` replays CUDA graphs of the compiled regions (the NVFP4 ops of a cached
    config, tagged cudagraph-unsafe, run eagerly between them; a capturable config's are in the graphs);
    each step is marked as a new graph-tree iteration. ``scope``: ``"layers"`` compiles each decoder layer in
    place (``nn.Module.compile``; undone after the timing), ``"model"`` the whole model."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device="cuda")
    if compile:
        torch._dynamo.reset()
    layers = list(model.model.layers) if compile and scope == "layers" else []
    for layer in layers:
        layer.compile(mode=compile)
    fwd = torch.compile(model, mode=compile) if compile and scope == "model" else model
    warmup = 4 if compile else 2
    try:
        for i in range(steps + warmup):
            if i == warmup:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            if compile == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            fwd(ids, labels=ids, use_cache=False).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return batch * seq * steps / (time.perf_counter() - t0)
    finally:
        for layer in layers:  # back to eager for the next measurement
            layer._compiled_call_impl = None


#: Kernel kinds of :func:`gpu_time_by_kind`, first match of a name fragment (lower case) wins.
KINDS = (
    ("NVFP4 quantize (amax + quantize passes)", ("quantize", "_amax_", "_colwise", "_expand_kernel")),
    ("NVFP4 GEMM (Triton)", ("_gemm_tma_kernel", "_gemm_kernel", "_splitk_reduce", "_decode")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),  # before GEMM: SDPA kernels name cutlass types
    ("cuBLAS / CUTLASS GEMM", ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "sm100_")),
    ("reductions (norms, non-finite checks, loss)", ("reduce", "norm", "softmax", "cross_entropy", "nll")),
    ("optimizer (AdamW)", ("adam", "multi_tensor", "foreach")),
    ("elementwise and copies", ("elementwise", "vectorized", "copy", "fill", "cat", "index", "triton_")),
)


def gpu_time_by_kind(model, batch: int, seq: int) -> dict:
    """GPU time (ms) of one eager training step by kernel kind (:data:`KINDS`, else "other"), from the torch
    profiler's per-kernel self times, after one warm-up step; ``"total"``: every kernel. Eager kernels are the
    compiled step's, but for elementwise work that compilation fuses (the same in both models)."""
    from torch.profiler import ProfilerActivity, profile

    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device="cuda")

    def step():
        model(ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    out: dict = {"total": 0.0}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        us = e.self_cuda_time_total if us is None else us
        if not us:
            continue
        name = e.key.lower()
        kind = next((k for k, frags in KINDS if any(f in name for f in frags)), "other")
        out[kind] = out.get(kind, 0.0) + us / 1e3
        out["total"] += us / 1e3
    return out


def kernel_table(bf16: dict, fp4: dict, label: str) -> str:
    """Markdown table of two :func:`gpu_time_by_kind` results side by side, with the difference."""
    rows = [f"GPU time of one eager step by kernel kind, ms (torch profiler; NVFP4 = the {label} config):", "",
            "| kind | BF16 | NVFP4 | NVFP4 − BF16 |", "|---|---|---|---|"]  # fmt: skip
    for kind in [k for k, _ in KINDS] + ["other", "total"]:
        a, b = bf16.get(kind, 0.0), fp4.get(kind, 0.0)
        if a or b:
            rows.append(f"| {kind} | {a:.2f} | {b:.2f} | {b - a:+.2f} |")
    return "\n".join(rows)


def host_profile(model, batch: int, seq: int, steps: int = 3) -> str:
    """cProfile of ``steps`` training steps (after a warm-up step): where the host time goes."""
    import cProfile
    import io
    import pstats

    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device="cuda")

    def step():
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(45)
    head = f"cProfile of {steps} NVFP4 steps: host {host * 1e3 / steps:.0f} ms/step, wall {wall * 1e3 / steps:.0f} ms/step"
    return head + "\n" + out.getvalue()


def main() -> None:
    from triage.kernels import NVFP4Config, NVFP4Linear, NVFP4LinearConfig, convert

    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=28)
    p.add_argument(
        "--hidden", type=int, default=1024, help="4096 with --intermediate 12288 --heads 32: Qwen3-8B"
    )
    p.add_argument("--intermediate", type=int, default=3072)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--backward", default="bf16-backward", help="NVFP4LinearConfig.backward")
    p.add_argument(
        "--profile",
        action="store_true",
        help="GPU time of one eager step by kernel kind, BF16 beside NVFP4 (the capturable config with --capturable)",
    )
    p.add_argument(
        "--cprofile",
        action="store_true",
        help="cProfile (host time) of 3 NVFP4 steps: top functions by own time",
    )
    p.add_argument(
        "--compile",
        nargs="?",
        const="default",
        default=None,
        choices=("default", "reduce-overhead", "max-autotune-no-cudagraphs"),
        help="also time both models under torch.compile(mode=...) (NVFP4Linear runs as the "
        "triage::nvfp4_linear op); the flag alone: mode 'default'",
    )
    p.add_argument(
        "--compile-scope",
        default="layers",
        choices=("layers", "model"),
        help="what --compile compiles: each decoder layer on its own (regional; default) or the whole model",
    )
    p.add_argument(
        "--capturable",
        action="store_true",
        help="also time the NVFP4 learner with NVFP4LinearConfig(capturable=True): W quantized on the device "
        "at every forward, no host reads, an op CUDA graphs capture (eager, and under --compile's mode)",
    )
    p.add_argument(
        "--compare-share",
        action="store_true",
        help="also time NVFP4 with share_inputs=False (q/k/v and gate/up each quantize their input)",
    )
    p.add_argument(
        "--compare-launch",
        action="store_true",
        help="also time NVFP4 with Triton's own launch path (no fast launch)",
    )
    p.add_argument(
        "--compare-sync",
        action="store_true",
        help="also time with SYNC_FREE_MAX_FLOP(_TMA)=0 (cuBLAS alpha + a sync)",
    )
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    lines = _Echo()
    lines.append(
        f"# learner step, Qwen3 arch {args.layers} layers h{args.hidden} i{args.intermediate}, "
        f"{args.batch}×{args.seq} tokens"
    )
    model = build(args.layers, args.hidden, args.intermediate, args.heads)
    n = sum(p.numel() for p in model.parameters())
    lines.append(f"params: {n / 1e9:.2f}B")
    bf16 = tokens_per_s(model, args.batch, args.seq, args.steps)
    lines.append(f"| BF16 | {bf16:,.0f} tok/s | 1.00 |")
    kernels_bf16 = gpu_time_by_kind(model, args.batch, args.seq) if args.profile else None
    if args.compile:
        bf16_c = tokens_per_s(model, args.batch, args.seq, args.steps, args.compile, args.compile_scope)
        lines.append(f"| BF16, torch.compile ({args.compile}) | {bf16_c:,.0f} tok/s | {bf16_c / bf16:.2f} |")
    convert(model, NVFP4Config(linear=NVFP4LinearConfig(backward=args.backward), moe=None))
    fp4 = tokens_per_s(model, args.batch, args.seq, args.steps)
    lines.append(f"| NVFP4 ({args.backward}) | {fp4:,.0f} tok/s | {fp4 / bf16:.2f} |")
    if args.compile:
        fp4_c = tokens_per_s(model, args.batch, args.seq, args.steps, args.compile, args.compile_scope)
        lines.append(
            f"| NVFP4 ({args.backward}), torch.compile ({args.compile}) | {fp4_c:,.0f} tok/s | {fp4_c / bf16:.2f} "
            f"(/ compiled BF16: {fp4_c / bf16_c:.2f}) |"
        )
    if args.capturable:
        config = NVFP4LinearConfig(backward=args.backward, capturable=True)
        for m in model.modules():
            if isinstance(m, NVFP4Linear):
                m.config = config
        name = f"NVFP4 ({args.backward}), capturable"
        cap = tokens_per_s(model, args.batch, args.seq, args.steps)
        lines.append(f"| {name} | {cap:,.0f} tok/s | {cap / bf16:.2f} (/ cached NVFP4: {cap / fp4:.2f}) |")
        if args.compile:
            cap_c = tokens_per_s(model, args.batch, args.seq, args.steps, args.compile, args.compile_scope)
            lines.append(
                f"| {name}, torch.compile ({args.compile}) | {cap_c:,.0f} tok/s | {cap_c / bf16:.2f} "
                f"(/ compiled BF16: {cap_c / bf16_c:.2f}; / compiled cached NVFP4: {cap_c / fp4_c:.2f}) |"
            )
    if args.profile:  # the capturable config where it was timed, else the cached one
        kernels_fp4 = gpu_time_by_kind(model, args.batch, args.seq)
        lines += ["", kernel_table(kernels_bf16, kernels_fp4, "capturable" if args.capturable else "cached")]
    if args.capturable:
        for m in model.modules():  # the sections below time the cached config
            if isinstance(m, NVFP4Linear):
                m.config = NVFP4LinearConfig(backward=args.backward)
    if args.compare_share:
        for m in model.modules():
            if isinstance(m, NVFP4Linear):
                m.config = NVFP4LinearConfig(backward=args.backward, share_inputs=False)
        unshared = tokens_per_s(model, args.batch, args.seq, args.steps)
        lines.append(
            f"| NVFP4 ({args.backward}), share_inputs=False | {unshared:,.0f} tok/s | {unshared / bf16:.2f} "
            f"(shared / unshared: {fp4 / unshared:.2f}) |"
        )
        for m in model.modules():
            if isinstance(m, NVFP4Linear):
                m.config = NVFP4LinearConfig(backward=args.backward)
    if args.compare_launch:
        from launch_overhead import all_launchers, with_fast

        plain = with_fast(
            all_launchers(), False, lambda: tokens_per_s(model, args.batch, args.seq, args.steps)
        )
        lines.append(
            f"| NVFP4 ({args.backward}), Triton's own launch path | {plain:,.0f} tok/s | {plain / bf16:.2f} |"
        )
    if args.cprofile:
        lines += ["", host_profile(model, args.batch, args.seq)]
    if args.compare_sync:
        from triage.kernels import linear as linear_mod
        from triage.kernels.nvfp4 import matmul as gemm_mod

        old = gemm_mod.SYNC_FREE_MAX_FLOP, gemm_mod.SYNC_FREE_MAX_FLOP_TMA
        gemm_mod.SYNC_FREE_MAX_FLOP = gemm_mod.SYNC_FREE_MAX_FLOP_TMA = 0.0
        gemm_mod._GEMM_PLANS.clear()  # plans (and the layers' call plans) read the limits when they are built
        linear_mod._PLANS.clear()
        sync = tokens_per_s(model, args.batch, args.seq, args.steps)
        gemm_mod.SYNC_FREE_MAX_FLOP, gemm_mod.SYNC_FREE_MAX_FLOP_TMA = old
        gemm_mod._GEMM_PLANS.clear()
        linear_mod._PLANS.clear()
        lines.append(
            f"| NVFP4 ({args.backward}), cuBLAS alpha + sync per GEMM | {sync:,.0f} tok/s | {sync / bf16:.2f} |"
        )
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_linear.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
