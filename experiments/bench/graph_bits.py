"""Which ops give other bits inside a CUDA graph than eagerly, at the sampler's decode shapes.

    python experiments/bench/graph_bits.py [--batches 1,16,128]

``bench_decode.py`` found the CUDA-graph decode loop's tokens and log-probs bit-identical to the eager static
loop at some batch sizes and not at others. This script runs each op of a decode step alone, at Qwen3-4B's
widths (hidden 2560, MLP 9728, 32 query / 8 KV heads of 128) and M = batch tokens, once eagerly and once as
the replay of a ``torch.cuda.graph`` capture of the same call on the same inputs, and prints whether the two
outputs have the same bits (and each eager call's agreement with a second eager call, to tell a graph effect
from run-to-run nondeterminism):

* bf16 ``F.linear`` (cuBLAS) at the q, k/v, o, gate/up, down and an LM-head shape;
* the NVFP4 W4A4 and W4A16 layers (:func:`triage.kernels.convert`, the sampler copy's recipe) at gate/up;
* the model's SDPA attention (transformers' ``sdpa_attention_forward``, as the sampler's static decode calls
  it: one query token per row, 32 query heads over 8 KV heads, a 4-D mask over a 160-slot cache).

It covers the matmuls and the attention of a decode step, not the embedding, norms, RoPE, activations or
the sampling ops.

``--model``: instead, the whole sampler loop (``sample_with_kv_cache``, ``decode="static"``, eager) twice with
the same seed on a 4-layer BF16 model of that width, every module's output recorded by forward hooks over the
prompt pass and the first ``--steps`` decode steps; prints the first module call whose output bits differ
between the two runs (the loop's own run-to-run nondeterminism, if any, and where it starts).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import torch.nn.functional as F


def graph_vs_eager(fn, *inputs):
    """(eager == graph replay, eager == eager again) for ``fn(*inputs)``: bitwise, NaN-aware."""
    eager = fn(*inputs).clone()
    again = fn(*inputs).clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up on the capture stream (lazy workspaces, autotuning)
            fn(*inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*inputs)
    graph.replay()
    torch.cuda.synchronize()
    return _same_bits(eager, out), _same_bits(eager, again)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN == NaN with the same payload), for any dtype: compared as integers of its width."""
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return bool(torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int)))


def first_divergence(batch: int, steps: int) -> str:
    """Run the static eager sampler loop twice (same seed) with hooks on every module; the first differing call."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_decode import build

    from triage.trainers.sampling import SamplingParams, sample_with_kv_cache

    model, tok = build("qwen3-4b-width", "bf16")
    prompts = torch.randint(10, len(tok) - 1, (batch, 32), generator=torch.Generator().manual_seed(batch)).tolist()
    records: list[list] = []

    def hook(name):
        def record(module, args, out):
            t = out[0] if isinstance(out, tuple) else getattr(out, "logits", out)
            if isinstance(t, torch.Tensor):
                records[-1].append((name, t.detach().clone()))

        return record

    handles = [m.register_forward_hook(hook(n or "model")) for n, m in model.named_modules()]
    outs = []
    for _ in range(2):
        records.append([])
        params = SamplingParams(max_new_tokens=steps + 1, temperature=1.0)
        g = torch.Generator("cuda").manual_seed(0)
        outs.append(sample_with_kv_cache(model, prompts, params, [-1], generator=g, decode="static"))
    for h in handles:
        h.remove()
    per_call = len(records[0]) // (steps + 1)
    for i, ((name, a), (_, b)) in enumerate(zip(*records)):
        if a.shape != b.shape or not _same_bits(a, b):
            return (f"B={batch}: first differing output: module call {i} ({name}, forward {i // per_call}: "
                    f"0 = prompt pass) of {len(records[0])}; tokens equal: "
                    f"{outs[0]['completion_ids'] == outs[1]['completion_ids']}")  # fmt: skip
    return f"B={batch}: all {len(records[0])} module outputs identical; outputs equal: {outs[0] == outs[1]}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,16,128")
    ap.add_argument("--model", action="store_true", help="the whole static loop twice (module doc)")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    if args.model:
        for b in (int(b) for b in args.batches.split(",")):
            print(first_divergence(b, args.steps), flush=True)
        return 0
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from triage.kernels import NVFP4Config, convert
    from triage.kernels.nvfp4.recipe import QuantRecipe

    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    h, i, hd, nq, nkv = 2560, 9728, 128, 32, 8
    linears = {"q": (h, nq * hd), "k/v": (h, nkv * hd), "o": (nq * hd, h), "gate/up": (h, i), "down": (i, h),
               "lm_head": (h, 32768)}
    weights = {k: torch.randn(n, kk, device="cuda", dtype=torch.bfloat16) * 0.02 for k, (kk, n) in linears.items()}
    recipe = QuantRecipe(scale="row", profile="compressed-tensors")
    nvfp4 = {}
    for name, frozen in (("w4a4", None), ("w4a16", "w4a16")):
        layer = torch.nn.Sequential(torch.nn.Linear(h, i, bias=False)).to("cuda", torch.bfloat16)
        layer[0].weight.data.copy_(weights["gate/up"])
        config = NVFP4Config.from_recipe(recipe, frozen=frozen)
        # one layer run on one x again and again: every call quantizes x (no shared input quantization)
        config = dataclasses.replace(config, linear=dataclasses.replace(config.linear, share_inputs=False))
        if config.frozen is not None:
            config = dataclasses.replace(config, frozen=dataclasses.replace(config.frozen, share_inputs=False))
        nvfp4[name] = convert(layer, config).eval()
    attention = torch.nn.Module()
    attention.num_key_value_groups, attention.is_causal = nq // nkv, True  # what Qwen3Attention holds

    def attn(q, k, v, mask):
        out, _ = sdpa_attention_forward(attention, q, k, v, mask, dropout=0.0, scaling=hd**-0.5)
        return out

    print("| op | M | eager == graph | eager == eager |\n|---|---|---|---|")
    for m in (int(b) for b in args.batches.split(",")):
        for name, w in weights.items():
            x = torch.randn(m, w.shape[1], device="cuda", dtype=torch.bfloat16)
            print(f"| bf16 linear {name} {w.shape[1]}→{w.shape[0]} | {m} | %s | %s |" % graph_vs_eager(F.linear, x, w))
        x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            for name, layer in nvfp4.items():
                print(f"| NVFP4 {name} gate/up | {m} | %s | %s |" % graph_vs_eager(layer, x))
        q = torch.randn(m, nq, 1, hd, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(m, nkv, 160, hd, device="cuda", dtype=torch.bfloat16)
        mask = torch.ones(m, 1, 1, 160, device="cuda", dtype=torch.bool)
        mask[..., 100:] = False  # the unwritten tail of the static cache
        print(f"| SDPA attention, 1 query over a 160-slot cache | {m} | %s | %s |" % graph_vs_eager(attn, q, kv, kv.clone(), mask))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
