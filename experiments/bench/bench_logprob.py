"""GPU benchmark + correctness check of ``triage.kernels.logprob.token_logprobs`` against eager log_softmax.

    python experiments/bench/bench_logprob.py                 # V=151936, H=4096, 8x4096 tokens, bf16
    python experiments/bench/bench_logprob.py --tokens 4096   # smaller

Eager = ``torch.log_softmax((h @ W.T).float() / T, -1).gather(-1, y)`` (fp32 logits, [N, V]).
Times are ``triton.testing.do_bench`` medians (ms); "extra GiB" = peak allocated minus the live inputs
(and, for fwd+bwd, minus the two gradient tensors every implementation must return). Writes
``$OUT/bench_logprob.txt`` when ``$OUT`` is set.
"""

from __future__ import annotations

import argparse
import os

import torch
import triton

from triage.kernels import logprob as lp


def eager(h, w, y, temperature):
    logits = (h @ w.t()).float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)


def ours(h, w, y, temperature, chunk=None):
    return lp.token_logprobs(h, w, y, temperature, chunk_size=chunk, validate=False)


def peak_extra_gib(fn, base_bytes):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base_bytes) / 2**30


def check(args, log):
    """Correctness at a smaller token count vs fp32 eager (values and both gradients)."""
    torch.manual_seed(1)
    n = 1024
    h = (torch.randn(n, args.hidden, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(args.vocab, args.hidden, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_(True)
    y = torch.randint(0, args.vocab, (n,), device="cuda")
    g = torch.randn(n, device="cuda")
    g_ent = torch.randn(n, device="cuda")
    logp, ent = lp.token_logprobs(h, w, y, 0.9, entropy=True)
    ((logp * g).sum() + (ent * g_ent).sum()).backward()
    dh, dw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    hf, wf = h.detach().float().requires_grad_(True), w.detach().float().requires_grad_(True)
    rl, re = lp.token_logprobs_reference(hf, wf, y, 0.9, entropy=True)
    ((rl * g).sum() + (re * g_ent).sum()).backward()
    rows = [
        ("logp max|err|", (logp - rl).abs().max().item()),
        ("entropy max|err|", (ent - re).abs().max().item()),
        ("dh max|err| / max|dh|", ((dh.float() - hf.grad).abs().max() / hf.grad.abs().max()).item()),
        ("dW max|err| / max|dW|", ((dw.float() - wf.grad).abs().max() / wf.grad.abs().max()).item()),
    ]
    for name, val in rows:
        log(f"check  {name:<24s} {val:.3e}")
    ok = rows[0][1] < 1e-3 and rows[1][1] < 1e-3 and rows[2][1] < 2e-2 and rows[3][1] < 2e-2
    log(
        f"check  fp32-output GEMM path: {'torch.mm(out_dtype=fp32)' if lp._CUDA_OUT_DTYPE else 'upcast fallback'}"
    )
    log(f"check  {'PASS' if ok else 'FAIL'}")
    return ok


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=8 * 4096)
    p.add_argument("--chunks", type=str, default="2048,4096,8192")
    p.add_argument("--skip-eager", action="store_true")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)

    log(
        f"# token_logprobs  V={args.vocab} H={args.hidden} N={args.tokens} bf16  {torch.cuda.get_device_name()}"
    )
    ok = check(args, log)
    torch.manual_seed(0)
    n, v, hd, temp = args.tokens, args.vocab, args.hidden, 1.0
    h = (torch.randn(n, hd, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(v, hd, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_(True)
    y = torch.randint(0, v, (n,), device="cuda")
    grads_bytes = h.numel() * 2 + w.numel() * 2
    log(
        f"eager fp32 logits alone: {n * v * 4 / 2**30:.1f} GiB;  budget 1/8 = {n * v * 4 / 2**30 / 8:.2f} GiB"
    )
    log(f"{'impl':<22s} {'fwd ms':>8s} {'fwd+bwd ms':>11s} {'fwd extra GiB':>14s} {'f+b extra GiB':>14s}")
    impls = [] if args.skip_eager else [("eager fp32", lambda: eager(h, w, y, temp))]
    impls += [(f"chunked C={c}", (lambda c=c: ours(h, w, y, temp, int(c)))) for c in args.chunks.split(",")]
    impls += [("chunked C=auto", lambda: ours(h, w, y, temp))]
    results = {}
    for name, fn in impls:
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        with torch.no_grad():
            t_f = triton.testing.do_bench(fn, rep=300)
            m_f = peak_extra_gib(fn, base)

        def fb(fn=fn):
            fn().sum().backward()

        t_fb = triton.testing.do_bench(fb, rep=300, grad_to_none=[h, w])
        h.grad = w.grad = None
        torch.cuda.empty_cache()
        m_fb = peak_extra_gib(fb, base) - grads_bytes / 2**30
        h.grad = w.grad = None
        results[name] = (t_f, t_fb)
        log(f"{name:<22s} {t_f:8.2f} {t_fb:11.2f} {m_f:14.2f} {m_fb:14.2f}")
    if "eager fp32" in results:
        e_f, e_fb = results["eager fp32"]
        for name, (t_f, t_fb) in results.items():
            if name != "eager fp32":
                log(
                    f"speedup vs eager  {name:<18s} fwd {e_f / t_f:5.2f}x   fwd+bwd {e_fb / t_fb:5.2f}x   "
                    f"bwd {(e_fb - e_f) / (t_fb - t_f):5.2f}x"
                )
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_logprob.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
