"""Built-in sampler decode speed: dynamic KV cache vs static cache vs CUDA-graph replay, BF16 vs NVFP4 copies.

    python experiments/bench/bench_decode.py [--shapes testbed,qwen3-4b-width] [--batches 1,16,128] [--new 128]
        [--precisions bf16,nvfp4,w4a16] [--decodes dynamic,static,cuda_graph,kept_graph]

For each model shape, sampler precision and batch size it samples ``--new`` tokens from ``--prompt``-token
prompts (EOS never ends a row) with :func:`triage.trainers.sampling.sample_with_kv_cache` and prints the
median wall time of ``--reps`` calls (after one warm-up call) as tokens/s, beside the peers: BF16 in the
same loop, and the BF16 dynamic-cache loop (transformers' ``DynamicCache``, what the sampler ran before). Correctness first, in the same
run: ``cuda_graph`` must return exactly ``static``'s tokens and log-probs (same generator seed), and
``dynamic`` vs ``static`` token agreement is printed, with whether each loop's ``--reps`` calls (same seed)
returned identical outputs (a loop that differs from itself is nondeterministic, whatever the graph does).

Shapes (random weights, std 0.02, Qwen3 architecture from :mod:`triage.trainers.tiny`):

* ``testbed``: the shape of the mismatch testbed's first pilot (hidden 384, 6 layers, 6 heads of 64, 2 KV
  heads, MLP 1152; the ``testbed`` scale of ``triage ablate`` now trains 4 layers of hidden 448);
* ``qwen3-4b-width``: Qwen3-4B's layer shape (hidden 2560, MLP 9728, 32 heads of 128, 8 KV heads), 4 layers;
* ``qwen3-4b``: the same layers, 36 of them (Qwen3-4B's depth; the tiny tokenizer's vocabulary, so the LM
  head is small).

Precisions: ``bf16``; ``nvfp4``, the sampler copy's W4A4 (:func:`triage.kernels.convert`, per-row outer scales
for weights and activations, compressed-tensors profile), the same conversion ``sampler_kwargs.precision:
nvfp4`` applies; ``nvfp4-unshared``, the same with ``share_inputs=False`` (every Linear quantizes its own
input: the cost of q/k/v and gate/up quantizing one input three and two times); ``w4a16``, NVFP4 weights (the same weight recipe) with bf16 activations
(``NVFP4Config.from_recipe(recipe, frozen="w4a16")``: the decode GEMV at M <= 16, the weight-only route of
QeRL-style rollouts); ``nvfp4-unfused`` / ``w4a16-unfused``: those conversions with every Linear its own
decode launch (``link_siblings(model, fused_groups=())``: q/k/v and gate/up unfused,
:mod:`triage.kernels.siblings`). ``--decodes`` picks the loops: ``dynamic``, ``static``, ``cuda_graph`` (a graph
captured in every call), ``kept_graph`` (the CUDA-graph loop on one ``DecodeGraphs`` kept across two warm-up
calls and the timed calls, as ``HFSampler`` keeps it, with ``graphs.CAPTURE_PREFILL = True``: the timed calls
capture nothing, their prompt's forward and decode steps are replays) and ``kept_eager_prefill`` (the same with
the prompt's forward run eagerly, ``graphs.CAPTURE_PREFILL = False``); ``cuda_graph`` is checked against
``static``, ``kept_graph`` against ``cuda_graph`` and ``kept_eager_prefill``, when both run and each returned the same outputs on its same-seed
calls (else the check prints None: a loop that differs from itself says nothing).

``--compile``: the sampler's ``compile_decode=True`` (:mod:`triage.trainers.sampling.graphs`): each decode step
goes through ``torch.compile`` (inductor, no CUDA graphs of its own: the graph loops capture the compiled step;
prompts stay eager), so that the norms, RoPE, activations and residual adds fuse into fewer kernels; the NVFP4
layers are custom ops, their sibling groups one launch. The compile time (a minute or more per model and
shape) is paid in the warm-up call.

``--replay``: the decode step's graph replays timed inside one call (:func:`replay_step`): GPU and host µs per
replay, against the loop's ms per step, to tell time lost inside the graph from time lost between replays.
``--fixed``: calls of one new token on each loop's state, timed: what a call costs besides its decode steps
(the prompt's forward first of all).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import torch

SHAPES = {
    "testbed": dict(
        hidden_size=384, intermediate_size=1152, num_hidden_layers=6, num_attention_heads=6,
        num_key_value_heads=2, head_dim=64,
    ),
    "qwen3-4b-width": dict(
        hidden_size=2560, intermediate_size=9728, num_hidden_layers=4, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128,
    ),
    "qwen3-4b": dict(
        hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128,
    ),
}


DECODES = ("dynamic", "static", "cuda_graph", "kept_graph", "kept_eager_prefill")
KEPT_LOOPS = ("kept_graph", "kept_eager_prefill")
PRECISIONS = ("bf16", "nvfp4", "nvfp4-unshared", "w4a16", "nvfp4-unfused", "w4a16-unfused")


def build(shape: str, precision: str):
    from triage.kernels import NVFP4Config, convert
    from triage.kernels.nvfp4.recipe import QuantRecipe
    from triage.trainers.tiny import TinyModelSpec, build_model, build_tokenizer

    if precision.endswith("-unfused"):  # the same conversion, each Linear its own decode launch
        from triage.kernels.siblings import link_siblings

        model, tok = build(shape, precision.removesuffix("-unfused"))
        link_siblings(model, fused_groups=())
        return model, tok
    tok = build_tokenizer()
    with torch.device("cuda"):  # initialised on the GPU: seconds, where 36 layers on the CPU take minutes
        model = build_model(tok, TinyModelSpec(**SHAPES[shape]), seed=0).to(torch.bfloat16).eval()
    recipe = QuantRecipe(scale="row", profile="compressed-tensors")
    if precision == "nvfp4":
        convert(model, NVFP4Config.from_recipe(recipe))
    elif precision == "nvfp4-unshared":
        config = NVFP4Config.from_recipe(recipe)
        convert(model, dataclasses.replace(config, linear=dataclasses.replace(config.linear, share_inputs=False)))
    elif precision == "w4a16":
        convert(model, NVFP4Config.from_recipe(recipe, frozen="w4a16"))
    elif precision != "bf16":
        raise ValueError(f"--precisions: unknown precision {precision!r}, expected one of {PRECISIONS}")
    return model, tok


#: ``--compile``: every call's decode step through torch.compile (``compile_decode=True``)
COMPILE = False


def run(model, prompts, new: int, decode: str, seed: int = 0, state=None, cache_width=None):
    """One sampler call; ``decode="kept_graph"``: the CUDA-graph loop on ``state`` (a ``DecodeGraphs`` the
    caller keeps across calls, as ``HFSampler`` does); ``"kept_eager_prefill"``: the same with the prompt's
    forward run eagerly (``graphs.CAPTURE_PREFILL = False``)."""
    from triage.trainers.sampling import SamplingParams, graphs, sample_with_kv_cache

    params = SamplingParams(max_new_tokens=new, temperature=1.0)
    g = torch.Generator("cuda").manual_seed(seed)
    kept = decode in KEPT_LOOPS
    capture_prefill = graphs.CAPTURE_PREFILL
    graphs.CAPTURE_PREFILL = decode != "kept_eager_prefill"
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = sample_with_kv_cache(
            model, prompts, params, [-1], generator=g, pad_id=0, decode="cuda_graph" if kept else decode,
            decode_state=state if kept else None, compile_decode=COMPILE, cache_width=cache_width,
        )  # fmt: skip
        torch.cuda.synchronize()
    finally:
        graphs.CAPTURE_PREFILL = capture_prefill
    return out, time.perf_counter() - t0


def _equal(outs: dict, rerun: dict, a: str, b: str) -> bool | None:
    """Loop ``a``'s output == loop ``b``'s, where both ran and each reproduced itself across its same-seed calls
    (a loop that differs from itself makes the comparison say nothing: None)."""
    if not {a, b} <= outs.keys() or rerun[a] is False or rerun[b] is False:
        return None
    return outs[a] == outs[b]


def profile_call(model, prompts, new: int, decode: str, title: str, top: int = 12) -> None:
    """Print the ``top`` GPU kernels by total device time of one ``run`` (launch counts included)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(model, prompts, new, decode)
    events = [e for e in prof.key_averages() if e.device_time_total > 0 and e.cpu_time_total == 0] or [
        e for e in prof.key_averages() if e.device_time_total > 0
    ]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in events)
    print(f"  profile ({title}, {decode}, {new} tokens): GPU kernel time {total / 1e3:.1f} ms")
    spans = [
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    ]
    if spans:
        g = kernel_gaps(spans)
        print(f"    GPU timeline: {g['span'] / 1e3:.1f} ms from first kernel start to last kernel end, "
              f"{g['busy'] / 1e3:.1f} ms busy; idle between kernels {g['short'] / 1e3:.1f} ms in "
              f"{g['n_short']} gaps < {GAP_US:.0f} µs, {g['long'] / 1e3:.1f} ms in {g['n_long']} longer ones "
              "(the GPU waiting for the host)")  # fmt: skip
    for e in events[:top]:
        print(f"    {e.device_time_total / 1e3:8.2f} ms  {e.count:6d}×  {e.key[:90]}")


def replay_step(model, prompts, new: int, title: str) -> dict:
    """The decode step's CUDA graph replays inside one ``cuda_graph`` call: each replay of the call timed on the
    GPU (CUDA events around ``graph.replay()``) and on the host (the ``replay()`` call itself); prints the
    median GPU µs per replay and host µs per ``replay()``. Against the loop's marginal ms per step
    (``--marginal``): a step slower than its replay loses the difference outside the graph (the sampling
    ops between replays, the host); a replay's GPU time is its kernels plus the gaps between them."""
    from triage.trainers.sampling import graphs

    timed, original = [], graphs.GraphStep

    class _Timed(original):
        def __call__(self):
            if self.graph is None:
                return super().__call__()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            self.graph.replay()
            host = time.perf_counter() - t0
            end.record()
            timed.append((start, end, host))
            return self.logits

    graphs.GraphStep = _Timed
    try:
        run(model, prompts, new, "cuda_graph")
    finally:
        graphs.GraphStep = original
    torch.cuda.synchronize()
    if not timed:
        raise RuntimeError(f"--replay ({title}): the decode step was not captured")
    gpu_us = statistics.median(s.elapsed_time(e) * 1e3 for s, e, _ in timed)
    host_us = statistics.median(h * 1e6 for _, _, h in timed)
    print(f"  replay ({title}): {gpu_us:.1f} µs GPU per replay, host {host_us:.1f} µs per replay() call "
          f"(medians over the call's {len(timed)} replays)")
    return dict(gpu_us=gpu_us, host_us=host_us, replays=len(timed))


#: Idle gaps between GPU kernels shorter than this (µs) count as launch / graph-node gaps, longer ones as the
#: GPU waiting for the host (:func:`kernel_gaps`).
GAP_US = 20.0


def kernel_gaps(spans: list[tuple[float, float]]) -> dict:
    """The GPU timeline of kernel ``(start, end)`` spans (µs, one stream): ``span`` (first start to last end),
    ``busy`` (the union of the spans), and the idle time between them: ``short`` (gaps < :data:`GAP_US`, in
    ``n_short`` gaps) and ``long`` (the rest, ``n_long``)."""
    spans = sorted(spans)
    busy = short = long_ = 0.0
    n_short = n_long = 0
    cur_start, cur_end = spans[0]
    for start, end in spans[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            gap = start - cur_end
            if gap < GAP_US:
                short, n_short = short + gap, n_short + 1
            else:
                long_, n_long = long_ + gap, n_long + 1
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    span = max(end for _, end in spans) - spans[0][0]
    return dict(span=span, busy=busy, short=short, n_short=n_short, long=long_, n_long=n_long)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="testbed,qwen3-4b-width")
    ap.add_argument("--batches", default="1,16,128")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--precisions", default="bf16,nvfp4", help=f"comma list of {PRECISIONS}")
    ap.add_argument("--decodes", default="dynamic,static,cuda_graph")
    ap.add_argument("--compile", action="store_true", help="torch.compile each model's decode step (module doc)")
    ap.add_argument(
        "--marginal",
        action="store_true",
        help="also time each loop at --new/2 tokens and print the marginal ms per decode step (all rows), "
        "(t(new) - t(new/2)) / (new/2): the cost of a step without the fixed costs of a call (prefill, cache "
        "set-up, graph capture). The static cache is sized to each call and attended over whole, so this "
        "difference also carries the growth of attention with the cache (new/2 more slots)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="after the timings of each shape, precision and batch: the top GPU kernels (torch.profiler, "
        "kernels inside graph replays included) of one call of the last loop in --decodes, and its GPU "
        "timeline: busy time and the idle gaps between kernels (kernel_gaps)",
    )
    ap.add_argument(
        "--replay",
        action="store_true",
        help="after the timings of each shape, precision and batch: the GPU and host µs of each decode-step "
        "graph replay inside one cuda_graph call (replay_step)",
    )
    ap.add_argument(
        "--fixed",
        action="store_true",
        help="after the timings of each shape, precision and batch: the median wall time of --reps calls of each "
        "loop in --decodes with ONE new token (after a warm-up call; a kept loop on its own state, the cache as "
        "long as the timed calls'): what a call costs besides its decode steps (the cache set-up, the prompt's "
        "forward, one draw, the results' copy to the host)",
    )
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "bench_decode.json"))
    args = ap.parse_args(argv)
    global COMPILE
    COMPILE = args.compile
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.cuda.get_device_name()}, "
          f"compiled decode step: {args.compile}")  # fmt: skip
    rows, ok, replays, fixed = [], True, {}, {}
    decodes = args.decodes.split(",")
    unknown = set(decodes) - set(DECODES)
    if unknown:
        raise SystemExit(f"--decodes: unknown {sorted(unknown)}, expected {', '.join(DECODES)}")
    unknown = set(args.precisions.split(",")) - set(PRECISIONS)
    if unknown:
        raise SystemExit(f"--precisions: unknown {sorted(unknown)}, expected {', '.join(PRECISIONS)}")
    for shape in args.shapes.split(","):
        for precision in args.precisions.split(","):
            model, tok = build(shape, precision)
            for batch in (int(b) for b in args.batches.split(",")):
                gen = torch.Generator().manual_seed(batch)
                prompts = torch.randint(10, len(tok) - 1, (batch, args.prompt), generator=gen).tolist()
                outs, times, rerun, marginal, warm, kept_states = {}, {}, {}, {}, {}, {}
                for decode in decodes:
                    from triage.trainers.sampling.graphs import DecodeGraphs

                    state = DecodeGraphs()  # a kept loop's, across its warm-up and timed calls
                    # warm-up (autotune, lazy allocations; with --compile the compilation); a kept loop's second
                    # call captures its prefill (the first runs it eagerly)
                    warm[decode] = run(model, prompts, args.new, decode, state=state)[1]
                    if decode in KEPT_LOOPS:
                        run(model, prompts, args.new, decode, state=state)
                    kept_states[decode] = state
                    reps = [run(model, prompts, args.new, decode, state=state) for _ in range(args.reps)]
                    outs[decode] = reps[0][0]
                    times[decode] = statistics.median(t for _, t in reps)
                    # the same loop again with the same seed: tells a graph-vs-eager difference from run-to-run
                    # nondeterminism of the loop itself
                    rerun[decode] = all(out == reps[0][0] for out, _ in reps[1:]) if len(reps) > 1 else None
                    if args.marginal:
                        run(model, prompts, args.new // 2, decode, state=state)  # warm-up at this length
                        half = statistics.median(
                            run(model, prompts, args.new // 2, decode, state=state)[1]
                            for _ in range(args.reps)
                        )
                        marginal[decode] = (times[decode] - half) / (args.new - args.new // 2)
                same = _equal(outs, rerun, "cuda_graph", "static")
                kept = _equal(outs, rerun, "kept_graph", "cuda_graph")
                prefill = _equal(outs, rerun, "kept_graph", "kept_eager_prefill")
                ok &= all(c is not False for c in (same, kept, prefill))
                agree = (
                    sum(
                        a == b
                        for ra, rb in zip(outs["dynamic"]["completion_ids"], outs["static"]["completion_ids"])
                        for a, b in zip(ra, rb)
                    ) / (batch * args.new)
                    if {"dynamic", "static"} <= outs.keys() else float("nan")
                )
                for decode, t in times.items():
                    rows.append(dict(shape=shape, precision=precision, batch=batch, decode=decode,
                                     seconds=t, tok_s=batch * args.new / t, reruns_identical=rerun[decode],
                                     warmup_seconds=warm[decode],
                                     marginal_ms_per_step=marginal[decode] * 1e3 if decode in marginal else None))
                print(
                    f"{shape:15s} {precision:5s} B={batch:<4d} "
                    + "  ".join(f"{d} {batch * args.new / t:9.0f} tok/s" for d, t in times.items())
                    + f"  | graph==static: {same}, kept==graph: {kept}, prefill graph==eager: {prefill}"
                    + f", dynamic/static token agreement {agree:.3f}"
                    + ", reruns identical: " + ", ".join(f"{d} {r}" for d, r in rerun.items())
                    + ", warm-up call s: " + ", ".join(f"{d} {w:.1f}" for d, w in warm.items())
                    + "".join(f"\n    {d}: marginal {m * 1e3:.3f} ms/step ({batch / m:.0f} tok/s), fixed per call "
                              f"{(times[d] - m * args.new) * 1e3:.1f} ms" for d, m in marginal.items())
                )
                if args.replay:
                    try:
                        replays[(shape, precision, batch)] = replay_step(
                            model, prompts, args.new, f"{shape} {precision} B={batch}"
                        )
                    except Exception as err:  # noqa: BLE001 - a study: report and keep the timings
                        print(f"  replay ({shape} {precision} B={batch}) failed: {type(err).__name__}: {err}")
                for decode in decodes if args.fixed else ():
                    # one new token on the loop's own state, its cache as long as the timed calls' (the same
                    # state: no new capture or compilation; a cold state's first call would time those)
                    from triage.trainers.sampling.graphs import prefill_width, static_cache_length

                    timed = static_cache_length(prefill_width(args.prompt), args.new)  # the timed calls' length
                    # the widest cache_width whose one-token calls get that length (or none: a new state)
                    fits = [w for w in range(args.prompt, timed) if static_cache_length(prefill_width(w), 1) == timed]
                    width = fits[-1] if fits else None
                    same = bool(fits)
                    state = kept_states.get(decode)
                    run(model, prompts, 1, decode, state=state, cache_width=width)
                    t1 = statistics.median(
                        run(model, prompts, 1, decode, state=state, cache_width=width)[1] for _ in range(args.reps)
                    )
                    fixed[(shape, precision, batch, decode)] = t1
                    print(f"  fixed per call ({shape} {precision} B={batch}, {decode}, one new token: cache set-up, "
                          f"prompt forward, one draw{'' if same else '; NOT the timed calls cache length'}): "
                          f"{t1 * 1e3:.1f} ms")  # fmt: skip
                if args.profile:
                    profile_call(model, prompts, args.new, decodes[-1], f"{shape} {precision} B={batch}")
            del model
            torch.cuda.empty_cache()
    # ratios against the peers: BF16 in the same loop (the target: NVFP4 vs BF16, both in graphs), and BF16 with
    # the dynamic cache (the loop before the static/graph path) when it ran
    bf16 = {(r["shape"], r["batch"], r["decode"]): r["tok_s"] for r in rows if r["precision"] == "bf16"}
    print("\nspeed-up vs BF16 in the same loop | vs the BF16 dynamic-cache loop (same shape, batch):")
    for r in rows:
        same_loop = bf16.get((r["shape"], r["batch"], r["decode"]))
        dynamic = bf16.get((r["shape"], r["batch"], "dynamic"))
        r["vs_bf16_same_decode"] = r["tok_s"] / same_loop if same_loop else None
        r["vs_bf16_dynamic"] = r["tok_s"] / dynamic if dynamic else None
        cells = [f"{v:6.2f}x" if v else "     -" for v in (r["vs_bf16_same_decode"], r["vs_bf16_dynamic"])]
        print(f"  {r['shape']:15s} {r['precision']:5s} B={r['batch']:<4d} {r['decode']:10s} {cells[0]} | {cells[1]}")
    with open(args.json, "w") as f:
        json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "args": vars(args),
                   "graph_equals_static_and_kept": ok, "rows": rows,
                   "replays": [dict(shape=k[0], precision=k[1], batch=k[2], **v) for k, v in replays.items()],
                   "fixed_seconds": [dict(shape=k[0], precision=k[1], batch=k[2], decode=k[3], seconds=v)
                                     for k, v in fixed.items()]},
                  f, indent=1)  # fmt: skip
    print(f"\nCORRECT (graph == static, kept graph == graph, wherever both loops reproduce themselves): {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
