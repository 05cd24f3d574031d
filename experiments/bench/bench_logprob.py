"""GPU benchmark + correctness check of ``triage.kernels.logprob.token_logprobs`` against eager log_softmax.

    python experiments/bench/bench_logprob.py                      # V=151936, H=4096, 8x4096 tokens, bf16
    python experiments/bench/bench_logprob.py --tokens 4096        # smaller
    python experiments/bench/bench_logprob.py --variants "fp32,bf16+C8192+s3,bf16+ov+s2" --profile bf16

Eager = ``torch.log_softmax((h @ W.T).float() / T, -1).gather(-1, y)`` (bf16 logits upcast to fp32, [N, V]).
A variant is ``+``-joined tokens: ``fp32`` | ``bf16`` (``logits_dtype``: fp32, or the input dtype),
``C<int>`` (``chunk_size``; default automatic), ``s<int>`` (``saved_chunks``; default 1), ``ov`` (``overlap``).
Times are ``triton.testing.do_bench`` medians (ms), the best of ``--rounds`` interleaved rounds; "extra GiB" =
peak allocated minus the live inputs (and, for fwd+bwd, minus the two gradient tensors every implementation
must return). "Δ vs eager" compares the full-size outputs: max |Δ log p| and max |ΔdW| / max |dW|.
Writes ``$OUT/bench_logprob.txt`` when ``$OUT`` is set.
"""

from __future__ import annotations

import argparse
import os

import torch
import triton

from triage.kernels import logprob as lp

DEFAULT_VARIANTS = (
    "fp32+C4096+s0,"  # ~ the previous default (fp32 chunks of 512 MiB, no kept chunk)
    "fp32,"  # new default: fp32 logits, 1 GiB chunk (C=8192 here), last chunk kept
    "bf16,"  # bf16 logits, C=16384, 1 chunk kept
    "bf16+C8192,"
    "bf16+C8192+s3,"  # 3 chunks kept (16 % of the recompute GEMM), ~2 GiB peak
    "bf16+C12288+s2,"
    "bf16+ov+s2,"  # side-stream epilogues, 2 x C=8192 buffers, both kept
    "bf16+C12288+ov+s2"
)


def eager(h, w, y, temperature):
    logits = (h @ w.t()).float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)


def parse_variant(spec: str) -> dict:
    kw: dict = {}
    for tok in spec.split("+"):
        if tok == "fp32":
            kw["logits_dtype"] = torch.float32
        elif tok == "bf16":
            kw["logits_dtype"] = torch.bfloat16
        elif tok == "ov":
            kw["overlap"] = True
        elif tok[:1] == "C" and tok[1:].isdigit():
            kw["chunk_size"] = int(tok[1:])
        elif tok[:1] == "s" and tok[1:].isdigit():
            kw["saved_chunks"] = int(tok[1:])
        else:
            raise SystemExit(f"bad variant token {tok!r} in {spec!r}")
    return kw


def ours(h, w, y, temperature, entropy=False, **kw):
    return lp.token_logprobs(h, w, y, temperature, entropy, validate=False, **kw)


def peak_extra_gib(fn, base_bytes):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base_bytes) / 2**30, out


def check(args, variants, log):
    """Correctness at 1024 tokens: each variant vs fp64 eager (and bf16-logit variants vs eager's bf16 logits)."""
    torch.manual_seed(1)
    n = 1024
    h = (torch.randn(n, args.hidden, device="cuda") * 0.5).to(torch.bfloat16)
    w = (torch.randn(args.vocab, args.hidden, device="cuda") * 0.02).to(torch.bfloat16)
    y = torch.randint(0, args.vocab, (n,), device="cuda")
    g = torch.randn(n, device="cuda")
    g_ent = torch.randn(n, device="cuda")

    def run(fn, hh, ww, **kw):
        hh, ww = hh.detach().clone().requires_grad_(True), ww.detach().clone().requires_grad_(True)
        logp, ent = fn(hh, ww, y, 0.9, entropy=True, **kw)
        ((logp * g).sum() + (ent * g_ent).sum()).backward()
        return logp.detach(), ent.detach(), hh.grad.float(), ww.grad.float()

    ref = run(lp.token_logprobs_reference, h.double(), w.double(), compute_dtype=torch.float64)
    ref16 = lp.token_logprobs_reference(h, w, y, 0.9, entropy=True, logits_dtype=torch.bfloat16)
    ok = True
    log(f"check (N={n}): max|Δlogp| max|Δent| vs fp64 [vs eager bf16 logits]; rel max|Δdh|, max|ΔdW| vs fp64")
    for name, kw in variants:
        logp, ent, dh, dw = run(lp.token_logprobs, h, w, **kw)
        e_l, e_e = (logp - ref[0]).abs().max().item(), (ent - ref[1]).abs().max().item()
        r_h = ((dh - ref[2]).abs().max() / ref[2].abs().max()).item()
        r_w = ((dw - ref[3]).abs().max() / ref[3].abs().max()).item()
        line = f"check  {name:<18s} logp {e_l:.2e} ent {e_e:.2e}"
        if kw.get("logits_dtype") == torch.bfloat16:
            b_l, b_e = (logp - ref16[0]).abs().max().item(), (ent - ref16[1]).abs().max().item()
            line += f" [vs bf16 eager {b_l:.2e} {b_e:.2e}]"
            good = b_l < 2e-2 and b_e < 2e-2 and e_l < 0.1
        else:
            good = e_l < 1e-3 and e_e < 1e-3
        good = good and r_h < 3e-2 and r_w < 3e-2
        ok &= good
        log(f"{line}  dh {r_h:.2e} dW {r_w:.2e}  {'ok' if good else 'FAIL'}")
    log(
        f"check  GEMM paths: mm(out_dtype=fp32, out=) {lp._CUDA_MM_INTO}, mm(out_dtype=fp32) {lp._CUDA_OUT_DTYPE}, "
        f"addmm(out_dtype=fp32, out=acc) {lp._CUDA_ADDMM_OUT_DTYPE}"
    )
    log(f"check  {'PASS' if ok else 'FAIL'}")
    return ok


def profile(name, fb, grads, log, top=14):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    fb()
    torch.cuda.synchronize()
    for t in grads:
        t.grad = None
    with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
        fb()
        torch.cuda.synchronize()
    log(f"# profile of one fwd+bwd: {name}")
    for row in prof.key_averages().table(sort_by="device_time_total", row_limit=top).splitlines():
        log(row)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=8 * 4096)
    p.add_argument("--variants", type=str, default=DEFAULT_VARIANTS)
    p.add_argument("--rounds", type=int, default=2, help="interleaved timing rounds (best of)")
    p.add_argument("--rep", type=int, default=800, help="do_bench rep (ms) per measurement")
    p.add_argument("--profile", type=str, default="", help="comma-separated variants to profile once")
    p.add_argument("--skip-eager", action="store_true")
    p.add_argument("--skip-check", action="store_true")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)

    variants = [(v, parse_variant(v)) for v in args.variants.split(",") if v]
    log(
        f"# token_logprobs  V={args.vocab} H={args.hidden} N={args.tokens} bf16  {torch.cuda.get_device_name()}  "
        f"torch {torch.__version__} triton {triton.__version__}"
    )
    ok = True if args.skip_check else check(args, variants, log)
    torch.manual_seed(0)
    n, v, hd, temp = args.tokens, args.vocab, args.hidden, 1.0
    h = (torch.randn(n, hd, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(v, hd, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_(True)
    y = torch.randint(0, v, (n,), device="cuda")
    grads_bytes = h.numel() * 2 + w.numel() * 2
    budget = n * v * 4 / 2**30 / 8
    log(f"eager fp32 logits alone: {n * v * 4 / 2**30:.1f} GiB;  budget 1/8 = {budget:.2f} GiB")
    impls = [] if args.skip_eager else [("eager", lambda: eager(h, w, y, temp))]
    impls += [(name, (lambda kw=kw: ours(h, w, y, temp, **kw))) for name, kw in variants]

    def fb_of(fn):
        def fb():
            fn().sum().backward()

        return fb

    # memory + full-size outputs (one call each), then timing rounds
    mem, delta, ref = {}, {}, None
    for name, fn in impls:
        h.grad = w.grad = None
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        with torch.no_grad():
            m_f, _ = peak_extra_gib(fn, base)
        torch.cuda.empty_cache()
        m_fb, _ = peak_extra_gib(lambda fn=fn: fn().sum().backward(), base)
        m_fb -= grads_bytes / 2**30
        with torch.no_grad():
            logp = fn()
        mem[name] = (m_f, m_fb)
        if ref is None and name == "eager":
            ref = (logp, w.grad.float().abs().max(), w.grad.clone())
        elif ref is not None:
            d_l = (logp - ref[0]).abs().max().item()
            d_w = ((w.grad - ref[2]).float().abs().max() / ref[1]).item()
            delta[name] = (d_l, d_w)
        del logp
    h.grad = w.grad = None
    torch.cuda.empty_cache()
    times: dict = {name: [] for name, _ in impls}
    for _ in range(max(1, args.rounds)):
        for name, fn in impls:
            with torch.no_grad():
                t_f = triton.testing.do_bench(fn, rep=args.rep)
            t_fb = triton.testing.do_bench(fb_of(fn), rep=args.rep, grad_to_none=[h, w])
            h.grad = w.grad = None
            times[name].append((t_f, t_fb))
            torch.cuda.empty_cache()
    for name in [s for s in args.profile.split(",") if s]:
        kw = parse_variant(name)
        profile(name, fb_of(lambda kw=kw: ours(h, w, y, temp, **kw)), [h, w], log)
        h.grad = w.grad = None
    best = {k: (min(t[0] for t in ts), min(t[1] for t in ts)) for k, ts in times.items()}
    e = best.get("eager")
    log("")
    log(
        "| impl | fwd ms | fwd+bwd ms | fwd × eager | f+b × eager | fwd GiB | f+b GiB | Δlogp vs eager | ΔdW vs eager |"
    )
    log("|---|---|---|---|---|---|---|---|---|")
    for name, _ in impls:
        t_f, t_fb = best[name]
        sp = f"{e[0] / t_f:.3f} | {e[1] / t_fb:.3f}" if e else "- | -"
        dl = f"{delta[name][0]:.1e} | {delta[name][1]:.1e}" if name in delta else "- | -"
        flag = "" if mem[name][1] <= budget or name == "eager" else " (over budget)"
        log(
            f"| {name} | {t_f:.2f} | {t_fb:.2f} | {sp} | {mem[name][0]:.2f} | {mem[name][1]:.2f}{flag} | {dl} |"
        )
    spread = {k: max(t[1] for t in ts) - min(t[1] for t in ts) for k, ts in times.items()}
    log(f"(fwd+bwd spread across rounds, ms: {', '.join(f'{k} {s:.1f}' for k, s in spread.items())})")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_logprob.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
