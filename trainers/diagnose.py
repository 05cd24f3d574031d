"""``triage diagnose``: the learner–sampler gap table of a model, and the early warning on a training log.

    triage diagnose --model tiny --output DIR          # trained-ish tiny Qwen3 on CPU (about a minute)
    triage diagnose --model /path/to/model --output DIR [--device cuda]
    triage diagnose --log trainer_state.json            # early warning on a training log

Prints the gap table (rows: the ablation axes; see ``triage.trainers.diagnostics.gap_table``) and
writes ``DIR/gap_table.json``, ``DIR/delta_hist.png`` and ``DIR/layer_divergence.png``.
"""

from __future__ import annotations

import argparse
import sys
import time

DTYPES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """argparse, not ``trl.TrlParser``: the flags pick a model source (``--model``) and/or a log, and only
    two of them (``--train-steps``, ``--seed``) are fields of a config (``TinyDiagnoseConfig``)."""
    parser.add_argument(
        "--model", default=None, help="'tiny' (train a tiny model here) or a local model path"
    )
    parser.add_argument("--output", default=None, help="directory for gap_table.json and the PNGs")
    parser.add_argument(
        "--log", default=None, help="a training log (JSON lines or trainer_state.json): early warning"
    )
    parser.add_argument("--sequences", type=int, default=64, help="sampled completions to score (default 64)")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="completion length cap (default 24)")
    parser.add_argument(
        "--train-steps", type=int, default=None, help="--model tiny: AdamW steps (default 120)"
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="compute dtype of both paths")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--axes", default=None, help="comma-separated axes to run (default: all)")
    parser.add_argument("--tau", type=float, default=0.01, help="class tolerance for the shares (nats)")
    parser.add_argument("--threshold", type=float, default=1e-2, help="layer divergence threshold")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (--model tiny default: 1)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    parser.add_argument("--seed", type=int, default=0)


def _load(args, device):
    import torch

    from triage.trainers.diagnostics.tiny_model import TinyDiagnoseConfig, train_tiny_model

    if args.model == "tiny":
        config = TinyDiagnoseConfig(seed=args.seed)
        if args.train_steps is not None:
            config = TinyDiagnoseConfig(train_steps=args.train_steps, seed=args.seed)
        model, tokenizer = train_tiny_model(config)
        return model.to(device), tokenizer, "tiny"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device).eval()
    model.requires_grad_(False)
    return model, tokenizer, args.model


def _run_table(args) -> int:
    import torch

    from triage.trainers.diagnostics.gap_table import default_rows, format_table, gap_table, write_gap_table
    from triage.trainers.diagnostics.tiny_model import sample_batch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    threads = (
        args.threads
        if args.threads is not None
        else (1 if args.model == "tiny" and device.type == "cpu" else None)
    )
    if threads:
        torch.set_num_threads(threads)
    dtype = getattr(torch, DTYPES[args.dtype])
    start = time.perf_counter()
    model, tokenizer, name = _load(args, device)
    loaded = time.perf_counter() - start
    batch = sample_batch(model, tokenizer, args.sequences, args.max_new_tokens, seed=args.seed)
    rows = default_rows(dtype)
    if args.axes:
        wanted = {a.strip() for a in args.axes.split(",") if a.strip()}
        known = {r.axis for r in rows}
        if wanted - known:
            print(
                f"triage diagnose: unknown axes {sorted(wanted - known)}; known: {sorted(known)}",
                file=sys.stderr,
            )
            return 2
        rows = [r for r in rows if r.axis in wanted]
    table = gap_table(model, batch, rows, tau=args.tau, threshold=args.threshold)
    table.update({"model": name, "dtype": args.dtype, "device": str(device), "model_seconds": loaded})
    print(
        f"model {name} on {device} ({args.dtype}); model ready in {loaded:.1f}s, table in {table['seconds']:.1f}s"
    )
    print(format_table(table))
    written = write_gap_table(table, args.output, plots=not args.no_plots)
    speed = table.get("strict_alignment")
    if speed is None:
        from triage.trainers.diagnostics.gap_table import strict_speed

        speed = strict_speed(table)
    for key, s in (speed or {}).items():
        print(
            f"strict alignment ({key}): mean|δ| {s['mean_abs_delta_default']:.2e} -> {s['mean_abs_delta_strict']:.2e}, "
            f"learner forward x{s['learner_slowdown']:.2f}, sampler decode x{s['sampler_slowdown']:.2f}"
        )
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def run(args) -> int:
    if args.model is None and args.log is None:
        print(
            "triage diagnose: give --model tiny|<model path> (with --output DIR) and/or --log FILE",
            file=sys.stderr,
        )
        return 2
    if args.model is not None and args.output is None:
        print("triage diagnose: --model needs --output DIR", file=sys.stderr)
        return 2
    if args.sequences < 1 or args.max_new_tokens < 1:
        print("triage diagnose: --sequences and --max-new-tokens must be >= 1", file=sys.stderr)
        return 2
    status = 0
    if args.model is not None:
        status = _run_table(args)
    if args.log is not None:
        from triage.early_warning import read_log, scan_log

        report = scan_log(read_log(args.log))
        print(report.summary())
    return status
