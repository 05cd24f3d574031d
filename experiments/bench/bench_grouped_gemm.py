"""GPU benchmark + correctness check of the grouped NVFP4 MoE GEMM (``triage.kernels.moe``).

    python experiments/bench/bench_grouped_gemm.py            # E=128, top-8, hidden 2048, expert 768, 16k tokens

Shapes (Qwen3-30B-A3B-like): gate_up [R, 2048] x [E, 1536, 2048]ᵀ and down [R, 768] x [E, 2048, 768]ᵀ with
R = tokens x top_k rows routed by a random top-k (uneven counts). Compared side by side: a loop of bf16
matmuls, ``torch._grouped_mm`` (bf16), and the NVFP4 backends (activation quantization included, weights
quantized once outside the timing as in training). "tokens+gather": the NVFP4 path as the MoE layer runs it —
the T un-routed tokens quantized once (with ``emit_expanded``), the top-k gather done inside the GEMM.
fwd+bwd: autograd of each path (NVFP4 = straight-through ``bf16-backward``, the default; the
"nvfp4-backward" row quantizes dgrad and wgrad). "wgrad ..." rows: the nvfp4-backward weight gradient alone
(2 columnwise quantizations straight into the padded token layout + 1 grouped ragged-K launch; the baseline
that materializes and transposes the layout first, with a bitwise comparison; and the grouped launch by
itself on pre-quantized operands) next to the bf16 ``torch._grouped_mm`` wgrad of bf16-backward. Times:
``triton.testing.do_bench`` medians in ms. Writes ``$OUT/bench_grouped_gemm.txt`` when ``$OUT`` is set.
"""

# ruff: noqa: B023  (the timed closures run inside the loop iteration that defines them)

from __future__ import annotations

import argparse
import os
from dataclasses import replace

import torch
import triton

from triage.kernels.moe import grouped_gemm, grouped_gemm_reference, offsets_from_expert_ids
from triage.kernels.moe.experts import NVFP4MoEConfig, _WeightCache, grouped_nvfp4_linear, nvfp4_wgrad
from triage.kernels.moe.grouped_gemm import (
    expand_experts,
    grouped_mm,
    grouped_wgrad,
    grouped_wgrad_reference,
    pad_segments,
    padded_segments,
)
from triage.kernels.moe.grouped_triton import GROUPED_CONFIG, launch_grouped_gemm, launch_grouped_wgrad
from triage.kernels.nvfp4.api import quantize
from triage.kernels.nvfp4.recipe import QuantRecipe

W_RECIPE = QuantRecipe(scale="expert")
W16_RECIPE = QuantRecipe(scale="expert", block="16x16")

#: The persistent TMA kernel's tiles timed against the pointer kernel ("kernel alone" rows; their SASS:
#: sass_grouped.py).
TMA_TILES = (
    dict(GROUPED_CONFIG, TMA=True),
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4, TMA=True),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4, TMA=True),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4, TMA=True),
    dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4, TMA=True),
)


def routing(tokens, experts, top_k, device):
    logits = torch.randn(tokens, experts, device=device)
    idx = logits.topk(top_k, dim=-1).indices
    order, offsets = offsets_from_expert_ids(idx, experts)
    return order // top_k, offsets


def check(log, experts, top_k, k, n):
    """Small-size correctness of every NVFP4 backend vs the fp64 per-expert loop (incl. empty experts)."""
    torch.manual_seed(1)
    token, offsets = routing(512, experts, top_k, "cuda")
    offsets[1:9] = 0  # experts 0..7 empty: their rows now belong to expert 8
    x = torch.randn(512, k, device="cuda", dtype=torch.bfloat16)[token]
    w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16)
    a, wq = quantize(x), quantize(w, W_RECIPE)
    ref = grouped_gemm_reference(a, wq, offsets, out_dtype=torch.float32)
    ok = True
    for b in ("triton", "triton_expanded", "grouped_mm"):
        y = grouped_gemm(a, wq, offsets, out_dtype=torch.float32, backend=b)
        err = ((y - ref).abs().max() / ref.abs().max()).item()
        good = err < (1e-2 if b == "grouped_mm" else 1e-5)
        ok &= good
        log(f"check  {b:<16s} max|err|/max|ref| = {err:.2e}  {'ok' if good else 'FAIL'}")
    # tokens quantized once, gathered inside the kernel: same result as gathering first
    xt = torch.randn(512, k, device="cuda", dtype=torch.bfloat16)
    at = quantize(xt, emit_expanded=torch.bfloat16)
    ref = grouped_gemm_reference(quantize(xt[token]), wq, offsets, out_dtype=torch.float32)
    for b in ("triton", "triton_expanded"):
        y = grouped_gemm(at, wq, offsets, out_dtype=torch.float32, backend=b, a_rows=token)
        err = ((y - ref).abs().max() / ref.abs().max()).item()
        good = err < 1e-5
        ok &= good
        log(f"check  {b:<16s} a_rows gather: max|err|/max|ref| = {err:.2e}  {'ok' if good else 'FAIL'}")
    # grouped wgrad (ragged K) on the padded token layout, experts 0..7 empty
    dy = torch.randn(x.shape[0], n, device="cuda", dtype=torch.bfloat16)
    padded, dest, length = padded_segments(offsets, x.shape[0])
    recipe = QuantRecipe(hadamard=True, pad=True)
    aq = quantize(pad_segments(dy, dest, length).t().contiguous(), recipe, emit_expanded=torch.bfloat16)
    bq = quantize(pad_segments(x, dest, length).t().contiguous(), recipe, emit_expanded=torch.bfloat16)
    ref = grouped_wgrad_reference(aq, bq, padded)
    for b in ("triton", "triton_expanded", "grouped_mm"):
        y = grouped_wgrad(aq, bq, padded, backend=b)
        err = ((y - ref).abs().max() / ref.abs().max()).item()
        good = err < (1e-2 if b == "grouped_mm" else 1e-5) and bool((y[:8] == 0).all())
        ok &= good
        log(f"check  {b:<16s} wgrad: max|err|/max|ref| = {err:.2e}  {'ok' if good else 'FAIL'}")
    return ok


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--expert-dim", type=int, default=768)
    p.add_argument("--sweep", action="store_true", help="also time a few Triton tile configs")
    p.add_argument("--skip-fused", action="store_true", help="skip the (slow) fused-unpack backend")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)

    E, k_top, H, I = args.experts, args.top_k, args.hidden, args.expert_dim
    log(
        f"# grouped GEMM  E={E} top-{k_top} hidden={H} expert={I} tokens={args.tokens}  {torch.cuda.get_device_name()}"
    )
    ok = check(log, E, k_top, H, 2 * I)
    torch.manual_seed(0)
    token, offsets = routing(args.tokens, E, k_top, "cuda")
    rows = token.numel()
    counts = (offsets[1:] - offsets[:-1]).tolist()
    log(f"rows={rows}  per-expert rows min/mean/max = {min(counts)}/{rows / E:.0f}/{max(counts)}")
    log(f"{'gemm':<8s} {'impl':<26s} {'fwd ms':>8s} {'fwd+bwd ms':>11s} {'fwd TFLOP/s':>12s}")
    for name, K, N in (("gate_up", H, 2 * I), ("down", I, H)):
        x = (torch.randn(rows, K, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_(True)
        w = (torch.randn(E, N, K, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_(True)
        dy = torch.randn(rows, N, device="cuda", dtype=torch.bfloat16)
        flops = 2 * rows * N * K
        host_offs = offsets.tolist()
        ends = offsets[1:].to(torch.int32)

        def bf16_loop():
            out = x.new_empty(rows, N)
            for e in range(E):
                lo, hi = host_offs[e], host_offs[e + 1]
                if hi > lo:
                    out[lo:hi] = x[lo:hi] @ w[e].t()
            return out

        def bf16_loop_autograd():
            return torch.cat([x[host_offs[e] : host_offs[e + 1]] @ w[e].t() for e in range(E)])

        def bf16_grouped():
            return torch._grouped_mm(x, w.transpose(1, 2), ends)

        def bf16_gather_grouped():  # the bf16 MoE layer's view: the top-k gather is its own copy
            src = x_tok if gather is not None else x.detach()
            rows_in = src[gather] if gather is not None else src
            return torch._grouped_mm(rows_in, w.detach().transpose(1, 2), ends)

        wq = quantize(w.detach(), W_RECIPE)
        wbf = expand_experts(wq, torch.bfloat16)
        cache = _WeightCache()
        # the MoE layer's view: T un-routed tokens, rows = token[order]
        n_tok = rows // k_top if name == "gate_up" else rows
        x_tok = x.detach()[:n_tok].contiguous()
        gather = token if name == "gate_up" else None

        def nvfp4(backend, w_exp=None):
            return lambda: grouped_gemm(
                quantize(x.detach()), wq, offsets, backend=backend, w_expanded=w_exp, validate=False
            )

        def nvfp4_tokens():
            return grouped_gemm(
                quantize(x_tok, emit_expanded=torch.bfloat16), wq, offsets, backend="triton_expanded",
                w_expanded=wbf, a_rows=gather, validate=False,
            )  # fmt: skip

        def nvfp4_autograd(backend, backward="bf16-backward"):
            recipe = W_RECIPE if backward != "nvfp4-backward" else QuantRecipe(scale="expert", block="16x16")
            cfg = NVFP4MoEConfig(gemm_backend=backend, backward=backward, weight=recipe)
            return lambda: grouped_nvfp4_linear(x, w, offsets, cfg, None, cache)

        impls = [
            ("bf16 loop", bf16_loop, bf16_loop_autograd),
            ("bf16 torch._grouped_mm", bf16_grouped, bf16_grouped),
            ("bf16 gather + _grouped_mm", bf16_gather_grouped, None),
            ("nvfp4 triton (fused)", nvfp4("triton"), nvfp4_autograd("triton")),
            ("nvfp4 triton_expanded", nvfp4("triton_expanded", wbf), nvfp4_autograd("triton_expanded")),
            ("nvfp4 tokens+gather (exp)", nvfp4_tokens, None),
            ("nvfp4 grouped_mm", nvfp4("grouped_mm", wbf), nvfp4_autograd("grouped_mm")),
            ("nvfp4 nvfp4-backward", nvfp4("triton_expanded", wbf), nvfp4_autograd("auto", "nvfp4-backward")),
        ]
        for label, fwd, fwd_ag in impls:
            if args.skip_fused and "fused" in label:
                continue
            with torch.no_grad():
                t_f = triton.testing.do_bench(fwd, rep=100)

            def fb(fwd_ag=fwd_ag):
                fwd_ag().backward(dy)

            t_fb = f"{'-':>11s}"
            try:
                if fwd_ag is not None:
                    t_fb = f"{triton.testing.do_bench(fb, rep=100, grad_to_none=[x, w]):11.3f}"
            except Exception as exc:  # noqa: BLE001 - e.g. no autograd formula in this torch
                t_fb = f"{'n/a':>11s}"
                log(f"  ({label} fwd+bwd failed: {type(exc).__name__}: {str(exc)[:100]})")
            x.grad = w.grad = None
            log(f"{name:<8s} {label:<26s} {t_f:8.3f} {t_fb} {flops / t_f / 1e9:12.1f}")
        # the forward kernel alone on the expanded operands (tokens + in-kernel gather): pointer kernel vs the
        # persistent TMA kernel (TMA=True), bits compared, a few TMA tiles
        xq_tok = quantize(x_tok, emit_expanded=torch.bfloat16)
        xa = xq_tok.expanded.reshape(x_tok.shape[0], K)
        g_a, g_w = xq_tok.global_scale.reshape(1).float(), wq.global_scale.reshape(E).float()
        base_out = torch.empty(rows, N, device="cuda", dtype=torch.bfloat16)

        def kernel(cfg, out):
            return lambda: launch_grouped_gemm(xa, None, wbf, None, K, offsets, out, g_a, g_w, rows=gather, config=cfg)

        kernel(GROUPED_CONFIG, base_out)()
        t_ptr = triton.testing.do_bench(kernel(GROUPED_CONFIG, base_out), rep=100)
        log(f"{name:<8s} {'kernel alone: pointer':<26s} {t_ptr:8.3f} {'-':>11s} {flops / t_ptr / 1e9:12.1f}")
        for cfg in TMA_TILES:
            out = torch.empty_like(base_out)
            same_tiles = all(cfg[key] == GROUPED_CONFIG[key] for key in GROUPED_CONFIG)
            try:
                kernel(cfg, out)()
                t = triton.testing.do_bench(kernel(cfg, out), rep=100)
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory for a tile
                log(f"  (TMA {cfg}: {type(exc).__name__}: {str(exc)[:100]})")
                continue
            bits = "same bits" if torch.equal(out, base_out) else ("DIFFERENT BITS" if same_tiles else "other tiles")
            tile = f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} w{cfg['num_warps']}s{cfg['num_stages']}"
            log(f"{name:<8s} {'kernel alone: TMA ' + tile:<26s} {t:8.3f} {'-':>11s} {flops / t / 1e9:12.1f}  "
                f"pointer / TMA {t_ptr / t:.2f}, {bits}")  # fmt: skip
        # the nvfp4-backward wgrad alone: whole (layout + 2 quantizations + 1 launch), then the launch alone
        wcfg = NVFP4MoEConfig(backward="nvfp4-backward", weight=W16_RECIPE)
        padded, dest, length = padded_segments(offsets, rows)
        xd = x.detach()
        for b in ("triton_expanded", "triton"):
            bcfg = replace(wcfg, gemm_backend=b)
            emit = torch.bfloat16 if b == "triton_expanded" else None
            t_w = triton.testing.do_bench(
                lambda: nvfp4_wgrad(dy, xd, offsets, bcfg, 1, out_dtype=torch.bfloat16), rep=100
            )

            def old_operands():  # before quantize_columnwise: padded layout materialized + transposed
                a = quantize(
                    pad_segments(dy, dest, length).t().contiguous(), wcfg.wgrad, seed=1, emit_expanded=emit
                )
                c = quantize(
                    pad_segments(xd, dest, length).t().contiguous(),
                    replace(wcfg.wgrad, rounding="nearest"),
                    emit_expanded=emit,
                )
                return a, c

            dq, xq = old_operands()
            t_l = triton.testing.do_bench(
                lambda: grouped_wgrad(dq, xq, padded, out_dtype=torch.bfloat16, backend=b, validate=False),
                rep=100,
            )

            def old_wgrad():  # the old path whole: the two quantizations, then the launch
                return grouped_wgrad(
                    *old_operands(), padded, out_dtype=torch.bfloat16, backend=b, validate=False
                )

            same = torch.equal(nvfp4_wgrad(dy, xd, offsets, bcfg, 1, out_dtype=torch.bfloat16), old_wgrad())
            ok &= same
            t_o = triton.testing.do_bench(old_wgrad, rep=100)
            log(f"{name:<8s} {'wgrad nvfp4 ' + b:<26s} {t_w:8.3f} {'':>11s} {flops / t_w / 1e9:12.1f}")
            log(
                f"{name:<8s} {'  (old: layout copy+T)':<26s} {t_o:8.3f} {'':>11s} {flops / t_o / 1e9:12.1f}"
                f"  bitwise same as new: {'yes' if same else 'NO'}"
            )
            log(f"{name:<8s} {'  (grouped launch only)':<26s} {t_l:8.3f} {'':>11s} {flops / t_l / 1e9:12.1f}")
            if args.sweep and b == "triton_expanded":  # wgrad tiles on the expansions ([E, N, K] bf16 out)
                w_out = torch.empty(E, N, K, device="cuda", dtype=torch.bfloat16)
                g_d, g_x = dq.global_scale.float().reshape(1), xq.global_scale.float().reshape(1)
                for bm, bn, bk, gm, warps, stages in [
                    (128, 256, 64, 8, 8, 3),
                    (128, 256, 64, 8, 8, 4),
                    (128, 128, 64, 8, 8, 4),
                    (128, 128, 64, 8, 4, 4),
                    (256, 128, 64, 8, 8, 3),
                    (128, 256, 32, 8, 8, 4),
                ]:
                    wc = dict(
                        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, num_warps=warps, num_stages=stages
                    )
                    try:
                        t = triton.testing.do_bench(
                            lambda: launch_grouped_wgrad(
                                dq.expanded, None, xq.expanded, None, padded, w_out, g_d, g_x, config=wc
                            ),
                            rep=100,
                        )
                        log(
                            f"{name:<8s} sweep wgrad expanded {bm}x{bn}x{bk} g{gm} w{warps} s{stages}: "
                            f"{t:.3f} ms  {flops / t / 1e9:.1f} TFLOP/s"
                        )
                    except Exception as exc:  # noqa: BLE001 - report and keep sweeping
                        log(
                            f"{name:<8s} sweep wgrad {bm}x{bn}x{bk}: failed ({type(exc).__name__}: {str(exc)[:80]})"
                        )
        t_bw = triton.testing.do_bench(lambda: grouped_mm(dy.t(), xd, offsets), rep=100)
        log(f"{name:<8s} {'wgrad bf16 _grouped_mm':<26s} {t_bw:8.3f} {'':>11s} {flops / t_bw / 1e9:12.1f}")
        t_q = triton.testing.do_bench(lambda: quantize(x_tok, emit_expanded=torch.bfloat16), rep=100)
        xq_tok = quantize(x_tok, emit_expanded=torch.bfloat16)
        t_g = triton.testing.do_bench(
            lambda: grouped_gemm(xq_tok, wq, offsets, backend="triton_expanded", w_expanded=wbf, a_rows=gather,
                                 validate=False), rep=100)  # fmt: skip
        log(f"{name:<8s} {'  (token quantize+expanded)':<26s} {t_q:8.3f}")
        log(f"{name:<8s} {'  (expanded GEMM+gather)':<26s} {t_g:8.3f} {'':>11s} {flops / t_g / 1e9:12.1f}")
        if args.sweep:
            out = torch.empty(rows, N, device="cuda", dtype=torch.bfloat16)
            K2 = xq_tok.data.shape[-1] * 2
            g_a = xq_tok.global_scale.float().reshape(1)
            g_w = wq.global_scale.float().reshape(E)
            xe = xq_tok.expanded
            for bm, bn, bk, warps, stages in [
                (128, 128, 64, 8, 4),
                (128, 256, 64, 8, 3),
                (128, 128, 64, 4, 4),
                (64, 256, 64, 8, 4),
                (128, 128, 128, 8, 3),
            ]:
                cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
                try:
                    t = triton.testing.do_bench(
                        lambda: launch_grouped_gemm(
                            xe, None, wbf, None, K2, offsets, out, g_a, g_w, rows=gather, config=cfg
                        ),
                        rep=100,
                    )
                    log(
                        f"{name:<8s} sweep expanded {bm}x{bn}x{bk} w{warps} "
                        f"s{stages}: {t:.3f} ms  {flops / t / 1e9:.1f} TFLOP/s"
                    )
                except Exception as exc:  # noqa: BLE001 - report and keep sweeping
                    log(f"{name:<8s} sweep {bm}x{bn}x{bk}: failed ({type(exc).__name__}: {str(exc)[:80]})")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_grouped_gemm.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
