"""Weight-sync time of the HF sampler copy per RL step: rebuild (peer) vs in-place refresh (ours), beside the step.

One step of online RL with the built-in sampler, on a random-init Qwen3-architecture model (no hub):

1. sync: the sampler copy takes the learner's new weights. Peer: ``HFSampler(refresh="rebuild")`` (deep copy →
   back to high precision → cast → NVFP4 conversion, every step). Ours: ``refresh="in_place"`` (the copy built
   once; each sync ``load_state_dict`` into it, cast to its dtype). Both copies are built before timing.
2. re-quantize: the copy's NVFP4 layers quantize their new weights (lazily, in the first decode forward after
   a sync; timed here by forcing it: ``NVFP4Linear.quantized_weight()``). Peer and ours pay the same.
3. generate: ``HFSampler.generate`` with the in-place copy, ``--batch`` prompts of ``--prompt-len`` random tokens,
   ``--completion-len`` new tokens each (no EOS; CUDA-graph decode on a GPU).
4. train: the learner's forward + backward over the same sequences (micro-batches of ``--micro-batch``), one
   fused AdamW step.

step = sync (ours) + re-quantize + generate + train (``--sync-only``: the first two alone); the table gives each part (median over ``--steps`` steps
after one warm-up step) and the share of the step that sync and re-quantization take. Pairs (``--pairs``):
``nvfp4-row``: bf16 learner, NVFP4 sampler copy (per-row scales); ``pair``: NVFP4 learner (TE, tensor scale),
NVFP4 sampler copy (per-row); ``bf16-sampler``: bf16 learner, bf16 copy (no conversion).

    python experiments/bench/bench_sync.py                              # H200: Qwen3-0.6B and 4B widths
    python experiments/bench/bench_sync.py --shapes small --cpu --batch 4 --completion-len 8 --steps 2
    python experiments/bench/bench_sync.py --shapes 0.6b --cpu --sync-only --pairs nvfp4-row,bf16-sampler
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from types import SimpleNamespace

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

_COMMON = dict(
    max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True
)
SHAPES = {
    "0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, **_COMMON),
    "4b": dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, **_COMMON),
    "small": dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, **_COMMON),
}  # fmt: skip
TE = {"block": "1x16", "scale": "tensor", "scale_source": "dynamic", "rounding": "nearest", "profile": "te"}
ROW = {
    "block": "1x16",
    "scale": "row",
    "scale_source": "dynamic",
    "rounding": "nearest",
    "profile": "compressed-tensors",
}
# pair: (learner NVFP4 recipe or None, sampler_kwargs), as the levels of experiments/recipes/levels/ set them
PAIRS = {
    "nvfp4-row": (None, {"precision": "nvfp4", "quant_recipe": ROW}),
    "pair": (TE, {"precision": "nvfp4", "quant_recipe": ROW}),
    "bf16-sampler": (None, {"precision": "bf16"}),
}


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def build_learner(shape: dict, recipe: dict | None, device: torch.device, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from triage.kernels import NVFP4Config, convert
    from triage.trainers.config import quant_recipe_from

    torch.manual_seed(seed)
    config = Qwen3Config(**shape, bos_token_id=None, eos_token_id=2, pad_token_id=0)
    with device:
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.generation_config.pad_token_id = 0
    if recipe is not None:
        convert(model, NVFP4Config.from_recipe(quant_recipe_from(recipe)))
    return model


def requantize(model) -> None:
    """Quantize every NVFP4 weight of ``model`` now (what its next forward would do)."""
    from triage.kernels import NVFP4Linear

    for m in model.modules():
        if isinstance(m, NVFP4Linear):
            m.quantized_weight()


def train_step(model, optimizer, ids: torch.Tensor, micro_batch: int) -> None:
    model.train()
    for chunk in ids.split(micro_batch):
        (model(chunk, labels=chunk).loss * chunk.shape[0] / ids.shape[0]).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def bench_pair(shape_name: str, pair: str, args, device: torch.device) -> dict:
    from accelerate import Accelerator

    from triage.trainers.grpo_trainer import resolve_sampler_kwargs
    from triage.trainers.sampling import HFSampler, SamplingParams

    recipe, sampler_kwargs = PAIRS[pair]
    shape = SHAPES[shape_name]
    learner = build_learner(shape, recipe, device)
    trainer = SimpleNamespace(
        model=learner,
        model_wrapped=learner,
        accelerator=Accelerator(cpu=device.type == "cpu"),  # one process: unwrap is the identity
        args=SimpleNamespace(),
        state=SimpleNamespace(global_step=0),
    )
    kwargs = resolve_sampler_kwargs("hf", sampler_kwargs)
    ours = HFSampler(seed=0, refresh="in_place", **kwargs)
    peer = HFSampler(seed=0, refresh="rebuild", **kwargs)
    for s in (ours, peer):
        s.sync_weights(trainer)  # the first build: the same for both, not timed
    optimizer = torch.optim.AdamW(learner.parameters(), lr=1e-6, fused=True)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, shape["vocab_size"], (args.batch, args.prompt_len), generator=g).tolist()
    params = SamplingParams(max_new_tokens=args.completion_len, temperature=1.0)
    rows = []
    for step in range(args.steps + 1):
        t0 = _clock(device)
        if not args.sync_only:
            out = ours.generate(prompts, params, eos_ids=[], model=ours.copy)
        t1 = _clock(device)
        if not args.sync_only:
            ids = torch.tensor([p + c for p, c in zip(prompts, out["completion_ids"])], device=device)
            train_step(learner, optimizer, ids, args.micro_batch)
        t2 = _clock(device)
        trainer.state.global_step = step + 1
        peer.sync_weights(trainer)
        t3 = _clock(device)
        requantize(peer.copy)
        t4 = _clock(device)
        ours.sync_weights(trainer)
        t5 = _clock(device)
        requantize(ours.copy)
        t6 = _clock(device)
        if step:  # the first step warms up (kernels, graphs, allocator)
            rows.append(
                dict(gen=t1 - t0, train=t2 - t1, rebuild=t3 - t2, requant_peer=t4 - t3, in_place=t5 - t4,
                     requant=t6 - t5)
            )  # fmt: skip
    med = {k: statistics.median(r[k] for r in rows) * 1e3 for k in rows[0]}
    step_ms = med["gen"] + med["train"] + med["in_place"] + med["requant"]
    peer_step_ms = med["gen"] + med["train"] + med["rebuild"] + med["requant_peer"]
    result = dict(
        shape=shape_name,
        pair=pair,
        params_m=sum(p.numel() for p in learner.parameters()) / 1e6,
        step_ms=step_ms,
        gen_ms=med["gen"],
        train_ms=med["train"],
        rebuild_ms=med["rebuild"],
        in_place_ms=med["in_place"],
        requant_ms=med["requant"],
        peer_share=None if args.sync_only else (med["rebuild"] + med["requant_peer"]) / peer_step_ms,
        ours_share=None if args.sync_only else (med["in_place"] + med["requant"]) / step_ms,
    )
    del ours, peer, learner, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def _percent(share: float | None) -> str:
    return f"{'-':>7}" if share is None else f"{100 * share:6.2f}%"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="0.6b,4b", help=f"comma-separated, of {sorted(SHAPES)}")
    parser.add_argument("--pairs", default="nvfp4-row,pair", help=f"comma-separated, of {sorted(PAIRS)}")
    parser.add_argument("--batch", type=int, default=32, help="completions per step")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--completion-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    parser.add_argument("--cpu", action="store_true", help="run on CPU (the kernels' torch twins)")
    parser.add_argument("--sync-only", action="store_true", help="time sync and re-quantization alone")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "0"  # torch twins of the NVFP4 kernels, not the slow interpreter
    results = []
    header = (
        f"{'shape':>6} {'params':>7} {'pair':>13} {'step ms':>9} {'gen':>8} {'train':>8} | {'peer: rebuild':>13} "
        f"{'ours: in place':>14} {'requant':>8} | {'peer %':>7} {'ours %':>7}"
    )
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; batch {args.batch}, "
          f"prompt {args.prompt_len}, completion {args.completion_len}; sync + requant as % of the step")  # fmt: skip
    print(header)
    for shape in args.shapes.split(","):
        for pair in args.pairs.split(","):
            r = bench_pair(shape, pair, args, device)
            results.append(r)
            print(
                f"{r['shape']:>6} {r['params_m']:6.0f}M {r['pair']:>13} {r['step_ms']:9.1f} {r['gen_ms']:8.1f} {r['train_ms']:8.1f} | "
                f"{r['rebuild_ms']:13.2f} {r['in_place_ms']:14.2f} {r['requant_ms']:8.2f} | "
                f"{_percent(r['peer_share'])} {_percent(r['ours_share'])}",
                flush=True,
            )
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_sync.json"), "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
