"""Decompose the engine mismatch δ of the testbed levels at one checkpoint (CPU or GPU, a few minutes).

Why `triage diagnose` is not enough here: its ``Precision`` rows always quantize the sampler's weights with a
per-tensor outer scale and sample at temperature 1 from the master, while the testbed's HF sampler copy
(``sampler_kwargs`` of ``experiments/recipes/levels/nvfp4-row-fp8kv.yaml`` and ``pair.yaml``) is built by
``resolve_sampler_kwargs`` → ``HFSampler._build_copy``: deep copy, cast to bf16, then
``convert(NVFP4Config.from_recipe(quant_recipe))``, which uses the SAME recipe for activations and weights,
so ``scale: row`` also gives the weights one outer scale per output row (compressed-tensors formulas). This
script builds every model through the trainer's own code and scores with the diagnostics' execution paths:

* models: the learner as ``TriageGRPOTrainer`` has it (``L-fp32``: the checkpoint in fp32;
  ``L-nvfp4``: ``convert(NVFP4Config.from_recipe(pair.quant_recipe))``, fp32 master; ``--learner-level
  pair-row``: that level's recipe) and sampler copies
  ``HFSampler(sampler_model="copy", **resolve_sampler_kwargs("hf", kwargs))._build_copy(master)``:

  ===========  =================================================================================
  ``S-bf16``   bf16 copy, nn.Linear (no quantization), native KV
  ``S-a32``    fp32 copy, the sampler's NVFP4 weights only (FrozenNVFP4Linear w4a16: fp32 x·Ŵᵀ)
  ``S-a``      bf16 copy, the sampler's NVFP4 weights only (w4a16, bf16 activations), native KV
  ``S-b``      bf16 copy, NVFP4 weights + per-token NVFP4 activations (the level's recipe), native KV
  ``S-c``      ``S-b`` + fp8 e4m3 KV cache = the sampler of ``nvfp4-row-fp8kv`` and of ``pair``
  ===========  =================================================================================

  ``L-wq`` is ``S-a32`` scored as a learner: an fp32 learner that computes with the sampler's Ŵ (the
  counterfactual "weight quantization shared, nothing else").
* tokens: ``--prompts`` level-6 prompts of the testbed's RL data (``synthetic_math`` train split, seed 0,
  256 held out, as ``ablate.run_recipe`` builds it) × ``--generations`` completions sampled from ``S-c`` at
  ``--temperature`` (``sample_with_kv_cache``, as the HF sampler does), up to ``--max-new-tokens``.
* scoring: ``triage.trainers.diagnostics.paths.run_path`` (learner: one full-sequence forward over the whole
  batch; sampler: prefill + one cached step per token), ``log softmax(z/T)``; the full next-token
  distributions are kept too, so ``KL(μ_S-c ‖ π)`` is computed exactly at every visited position (its mean is
  −E_μ[δ], the bias, without sampling noise).

Prints (1) the per-layer comparison of the learner's and the sampler's dequantized weights at ``pair``, (2) δ
per pair (mean δ, mean |δ|, mean per-response mean δ, mean per-response Σδ, exact mean KL), (3) token
correlations between the pairs' δ, (4) the telescoping chain L-fp32 → S-bf16 → S-a → S-b → S-c (each step's
mean log-prob shift). ``--json`` writes the numbers (without the per-token δ).

On CPU both sides run the kernels' torch reference quantizer and fp64 reference GEMM; on a GPU the Triton
and cuBLAS paths (``backend="auto"``), so the numbers there differ in the last bits of every GEMM.

    python experiments/testbed/delta_decomposition.py --model /path/to/sft --temperature 1.3 \\
        --prompts 16 --generations 8 --threads 1 --json /tmp/delta.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import time
from pathlib import Path

import torch
import yaml

LEVELS = Path(__file__).resolve().parents[1] / "recipes" / "levels"


def level(name: str) -> dict:
    return yaml.safe_load((LEVELS / f"{name}.yaml").read_text())


# ---------------------------------------------------------------------------------------------------------
# models, built by the trainer's own code


def sampler_copy(master, **kwargs):
    """The HF sampler's copy of ``master`` for ``sampler_kwargs`` (the trainer's resolve + build)."""
    from triage.trainers.grpo_trainer import resolve_sampler_kwargs
    from triage.trainers.sampling.hf import HFSampler

    resolved = resolve_sampler_kwargs("hf", {"sampler_model": "copy", **kwargs})
    resolved.pop("kv_cache_dtype", None)  # the KV format is the scoring path's (run_path), not the model's
    return HFSampler(**resolved)._build_copy(master).eval().requires_grad_(False)


def weight_only(recipe: dict):
    """``prepare_model``: the layers' weights quantized with ``recipe``, activations left as they are."""
    from triage.kernels import NVFP4Config, convert
    from triage.trainers.config import quant_recipe_from

    config = NVFP4Config.from_recipe(quant_recipe_from(recipe), frozen="w4a16")
    return lambda m: convert(m, config)


def nvfp4_learner(master, recipe: dict):
    """The ``pair`` learner: ``TriageGRPOTrainer._convert_learner_to_nvfp4`` on a copy of the fp32 master."""
    from triage.kernels.conversion import NVFP4Config, convert
    from triage.trainers.config import quant_recipe_from

    return convert(copy.deepcopy(master), NVFP4Config.from_recipe(quant_recipe_from(recipe))).eval()


def quantized_weights(model) -> dict:
    """W_q (``NVFP4Tensor``) of every NVFP4 layer, as its forward computes with it."""
    from triage.kernels.frozen_linear import FrozenNVFP4Linear
    from triage.kernels.linear import NVFP4Linear

    out = {}
    for name, m in model.named_modules():
        if isinstance(m, NVFP4Linear):
            out[name] = m._weight_cache.get(m.weight, m.config).quantized
        elif isinstance(m, FrozenNVFP4Linear):
            out[name] = m.quantized_weight()
    return out


def _material(a: torch.Tensor, b: torch.Tensor, rel: float = 0.01) -> float:
    """Fraction of elements whose values differ by more than ``rel`` of the larger magnitude."""
    return float(((a - b).abs() > rel * torch.maximum(a.abs(), b.abs())).float().mean())


def weight_table(master, learner, sampler, sampler_recipe: dict, learner_recipe: dict) -> list[dict]:
    """Per layer: where the learner's Ŵ_L and the sampler's Ŵ_S differ, and how their errors relate.

    ``exact``: Ŵ_L ≠ Ŵ_S (any bit); ``code``: the signed E2M1 value differs; ``>1%``: the values differ by more
    than 1 % (a different outer scale alone moves every value by the ratio of the amaxes, e.g. ≤ 0.4 % for the
    bf16 cast of the amax element: that shows in ``exact`` but not in ``>1%``). The three causes, each alone
    and measured as ``>1%``: the bf16 cast (TE tensor on W vs on bf16(W)), the profile (TE vs
    compressed-tensors, tensor scale, on bf16(W)) and the outer scale (CT tensor vs CT row, on bf16(W))."""
    from triage.kernels.nvfp4 import QuantRecipe, quantize
    from triage.kernels.nvfp4.format import e2m1_decode

    ql, qs = quantized_weights(learner), quantized_weights(sampler)
    source = dict(master.named_modules())
    rows = []
    r_l, r_s = QuantRecipe(**learner_recipe), QuantRecipe(**sampler_recipe)
    r_ct_tensor = QuantRecipe(**{**sampler_recipe, "scale": "tensor"})
    assert qs[next(iter(qs))].recipe == r_s and ql[next(iter(ql))].recipe == r_l
    for name in ql:
        w = source[name].weight.detach().float()
        wb = w.to(torch.bfloat16)
        a, b = ql[name].dequantize(torch.float32), qs[name].dequantize(torch.float32)
        ca, cb = e2m1_decode(ql[name].codes()), e2m1_decode(qs[name].codes())

        def q(x, r):
            return quantize(x, r, backend="torch").dequantize(torch.float32)

        q_te_bf16, q_ct_tensor = q(wb, r_l), q(wb, r_ct_tensor)
        assert torch.equal(q(wb, r_s), b), f"{name}: the sampler's W_q is not quantize(bf16(W), recipe)"
        el, es = a - w, b - w
        rows.append(
            {
                "layer": name.removeprefix("model.layers."),
                "shape": list(w.shape),
                "exact": float((a != b).float().mean()),
                "code": float((ca != cb).float().mean()),
                "material": _material(a, b),
                "material_bf16_cast": _material(a, q_te_bf16),
                "material_profile": _material(q_te_bf16, q_ct_tensor),
                "material_row_scale": _material(q_ct_tensor, b),
                "rel_err_learner": float(el.norm() / w.norm()),
                "rel_err_sampler": float(es.norm() / w.norm()),
                "rel_diff_LS": float((a - b).norm() / w.norm()),
                "cos_err": float(torch.nn.functional.cosine_similarity(el.flatten(), es.flatten(), dim=0)),
                # the part of the sampler's quantization error the learner's own error does not reproduce
                "unshared": float((a - b).norm() / es.norm()),
            }
        )
    return rows


# ---------------------------------------------------------------------------------------------------------
# tokens


def prompts(n: int, first: int = 0, seed: int = 0, held_out: int = 256) -> list[dict]:
    """Rows ``first`` .. ``first + n − 1`` of the testbed's RL prompts (level 6, train split, held-out excluded)."""
    from triage.experiments.data import synthetic_math

    return list(synthetic_math(first + n, [6], seed, "train", held_out=held_out))[first:]


@torch.no_grad()
def sample(model, tokenizer, rows, generations, temperature, max_new_tokens, kv, seed):
    from triage.experiments.sft import prompt_ids
    from triage.trainers.diagnostics.paths import TokenBatch
    from triage.trainers.sampling.base import SamplingParams
    from triage.trainers.sampling.hf import sample_with_kv_cache

    ids = [prompt_ids(tokenizer, r) for r in rows for _ in range(generations)]
    pad = tokenizer.pad_token_id
    out = sample_with_kv_cache(
        model,
        ids,
        SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature),
        [tokenizer.eos_token_id],
        generator=torch.Generator().manual_seed(seed),
        pad_id=pad,
        kv_cache_dtype=kv,
    )
    return TokenBatch.from_lists(ids, out["completion_ids"], pad), out


# ---------------------------------------------------------------------------------------------------------
# scoring with the diagnostics' paths, keeping the full next-token distributions


@contextlib.contextmanager
def capture_distributions(store: list):
    """Make ``paths._token_logps`` also keep ``log softmax(z/T)`` over the vocabulary (same values)."""
    from triage.trainers.diagnostics import paths

    original = paths._token_logps

    def token_logps(logits, tokens, temperature):
        z = logits.float()
        if temperature != 1.0:
            z = z / temperature
        full = torch.log_softmax(z, dim=-1)
        store.append(full if full.dim() == 3 else full.unsqueeze(1))
        return full.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

    paths._token_logps = token_logps
    try:
        yield
    finally:
        paths._token_logps = original


def score(model, kind, batch, temperature, kv="native"):
    from triage.trainers.diagnostics.paths import ExecutionPath, run_path

    dtype = next(model.parameters(), next(model.buffers())).dtype
    dtype = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
    from triage.trainers.sampling.kvcache import kv_format

    path = ExecutionPath(kind, dtype=dtype, kv_cache=kv_format(kv), temperature=temperature)
    store: list = []
    with capture_distributions(store):
        result = run_path(model, path, batch, capture_layers=False)
    full = torch.cat(store, dim=1)  # (B, C, V)
    return result.logps, full, result.seconds


@torch.no_grad()
def score_learner_kv(model, batch, temperature, kv):
    """A learner that rounds its keys and values the way the sampler's KV cache does: the prompt's prefill
    through a ``kv`` cache (which calibrates its fp8 scales on the prompt's keys and values, as the sampler's
    does, here the learner's own), then the whole completion in one teacher-forced forward through the same
    cache. With a native cache this equals the plain learner forward (to 5e-7 on the smoke checkpoint); run
    on the sampler's model it reproduces the sampler's token-by-token log-probs exactly. The counterfactual
    "the learner emulates the sampler's KV format" (not a trainer option)."""
    from triage.trainers.diagnostics import paths
    from triage.trainers.sampling.kvcache import cache_argument, kv_cache, kv_format

    ids, mask, pos, p = batch.input_ids, batch.attention_mask, batch.position_ids, batch.prompt_width
    store: list = []
    start = time.perf_counter()
    with capture_distributions(store):
        cache = kv_cache(model.config, kv_format(kv), "tensor", attention_mask=mask[:, :p])
        name = cache_argument(model)
        out = model(input_ids=ids[:, :p], attention_mask=mask[:, :p], position_ids=pos[:, :p], use_cache=True,
                    **{name: cache})  # fmt: skip
        first = paths._token_logps(out.logits[:, -1:], ids[:, p : p + 1], temperature)
        out = model(input_ids=ids[:, p:-1], attention_mask=mask[:, :-1], position_ids=pos[:, p:-1], use_cache=True,
                    **{name: cache})  # fmt: skip
        rest = paths._token_logps(out.logits, ids[:, p + 1 :], temperature)
    logps = torch.cat([first, rest], dim=1)
    logps = torch.where(batch.completion_mask, logps, torch.zeros((), dtype=logps.dtype))
    return logps, torch.cat(store, dim=1), time.perf_counter() - start


def pair_stats(lp_l, lp_s, full_l, full_s, mask) -> dict:
    from triage import token_gap

    d = token_gap(lp_l, lp_s, mask)
    m = mask.float()
    tokens = m.sum()
    per_resp_n = m.sum(1).clamp(min=1)
    ps = full_s.exp()
    kl = (ps * (full_s - full_l)).sum(-1)  # KL(μ_S ‖ π_L) at every position
    return {
        "delta": d,
        "mean_delta": float((d * m).sum() / tokens),
        "mean_abs_delta": float((d.abs() * m).sum() / tokens),
        "mean_resp_mean_delta": float(((d * m).sum(1) / per_resp_n).mean()),
        "mean_resp_sum_delta": float((d * m).sum(1).mean()),
        "exact_kl": float((kl * m).sum() / tokens),
        "std_delta": float(d[mask].std()),
    }


def corr(a: torch.Tensor, b: torch.Tensor, mask) -> float:
    x, y = a[mask].double(), b[mask].double()
    x, y = x - x.mean(), y - y.mean()
    return float((x * y).sum() / math.sqrt(float((x * x).sum() * (y * y).sum())))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the testbed SFT checkpoint (a local HF folder; read only)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--first-prompt", type=int, default=0, help="index of the first prompt of the RL data")
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.3)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    p.add_argument(
        "--learner-level",
        default="pair",
        help="the level whose NVFP4 learner recipe L-nvfp4 uses (its sampler must be nvfp4-row-fp8kv's): "
        "pair (TE, tensor-wide) or pair-row (the sampler's own per-row/per-token recipe)",
    )
    args = p.parse_args(argv)
    pair, row = level(args.learner_level), level("nvfp4-row-fp8kv")
    if pair.get("learner_precision") != "nvfp4" or pair.get("sampler_kwargs") != row["sampler_kwargs"]:
        raise SystemExit(
            f"--learner-level {args.learner_level}: not an NVFP4 learner against nvfp4-row-fp8kv's sampler"
        )
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(args.model)
    master = (
        AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval().requires_grad_(False)
    )
    s_recipe, l_recipe = row["sampler_kwargs"]["quant_recipe"], pair["quant_recipe"]
    print(f"sampler recipe (weights AND activations): {s_recipe}\nlearner recipe ({args.learner_level}): {l_recipe}")

    models = {
        "L-fp32": master,
        "L-nvfp4": nvfp4_learner(master, l_recipe),
        "S-bf16": sampler_copy(master, precision="bf16"),
        "S-a32": sampler_copy(master, dtype=torch.float32, prepare_model=weight_only(s_recipe)),
        "S-a": sampler_copy(master, precision="bf16", prepare_model=weight_only(s_recipe)),
        "S-b": sampler_copy(master, precision="nvfp4", quant_recipe=s_recipe),
    }
    kv_c = row["sampler_kwargs"]["kv_cache_dtype"]

    # (1) weights
    wt = weight_table(master, models["L-nvfp4"], models["S-b"], s_recipe, l_recipe)
    sa, sb = quantized_weights(models["S-a"]), quantized_weights(models["S-b"])
    assert all(torch.equal(sa[k].dequantize(torch.float32), sb[k].dequantize(torch.float32)) for k in sb)
    print(
        f"\n(1) learner ({args.learner_level}) Ŵ_L vs sampler Ŵ_S per decoder Linear: fractions of elements that differ, and norms"
    )
    print(
        f"{'layer':20} {'exact':>6} {'code':>6} {'>1%':>6} | >1% by: {'bf16':>5} {'prof':>5} {'row':>5} |"
        f" {'‖EL‖':>6} {'‖ES‖':>6} {'‖L-S‖':>6} {'cos':>5} {'unshr':>5}"
    )
    keys = ("exact", "code", "material", "material_bf16_cast", "material_profile", "material_row_scale")
    for r in wt:
        print(
            f"{r['layer']:20} {r['exact']:6.3f} {r['code']:6.3f} {r['material']:6.3f} |         "
            f"{r['material_bf16_cast']:5.3f} {r['material_profile']:5.3f} {r['material_row_scale']:5.3f} |"
            f" {r['rel_err_learner']:6.4f} {r['rel_err_sampler']:6.4f} {r['rel_diff_LS']:6.4f}"
            f" {r['cos_err']:5.3f} {r['unshared']:5.3f}"
        )
    n = sum(math.prod(r["shape"]) for r in wt)
    avg = {k: sum(r[k] * math.prod(r["shape"]) for r in wt) / n for k in keys}
    print(
        f"{'all (by elements)':20} {avg['exact']:6.3f} {avg['code']:6.3f} {avg['material']:6.3f} |         "
        f"{avg['material_bf16_cast']:5.3f} {avg['material_profile']:5.3f} {avg['material_row_scale']:5.3f} |"
    )
    print(
        "(‖EL‖, ‖ES‖: ‖Ŵ−W‖/‖W‖ of learner and sampler; ‖L-S‖ = ‖Ŵ_L−Ŵ_S‖/‖W‖; cos of the two errors;"
        " unshr = ‖Ŵ_L−Ŵ_S‖/‖Ŵ_S−W‖, 0 = the learner reproduces the sampler's weight error, √2 = independent)"
    )

    # (2) tokens from the sampler of the two levels, S-c
    batch, out = sample(
        models["S-b"],
        tok,
        prompts(args.prompts, args.first_prompt),
        args.generations,
        args.temperature,
        args.max_new_tokens,
        kv_c,
        args.seed,
    )
    mask = batch.completion_mask
    lens = mask.sum(1).float()
    print(
        f"\n(2) {mask.shape[0]} completions from S-c at T={args.temperature}: {int(mask.sum())} tokens, "
        f"length {lens.mean():.1f} (min {int(lens.min())}, max {int(lens.max())}); "
        f"{time.perf_counter() - t0:.0f}s so far"
    )
    scores = {}
    for name, kind, kv in (
        ("L-fp32", "learner", "native"),
        ("L-nvfp4", "learner", "native"),
        ("L-wq", "learner", "native"),
        ("L-fp32-kv", "learner-kv", kv_c),
        ("L-nvfp4-kv", "learner-kv", kv_c),
        ("S-bf16", "sampler", "native"),
        ("S-a32", "sampler", "native"),
        ("S-a", "sampler", "native"),
        ("S-b", "sampler", "native"),
        ("S-c", "sampler", kv_c),
    ):
        model = models[{"L-wq": "S-a32", "S-c": "S-b"}.get(name, name.removesuffix("-kv"))]
        if kind == "learner-kv":
            lp, full, secs = score_learner_kv(model, batch, args.temperature, kv)
        else:
            lp, full, secs = score(model, kind, batch, args.temperature, kv)
        scores[name] = (lp, full)
        print(f"  scored {name:8} ({kind}, kv={kv}) in {secs:.1f}s")
    # the sampler's own reported log-probs vs the S-c path (the scoring reproduces the sampling pass)
    rep = torch.zeros_like(scores["S-c"][0])
    for i, l in enumerate(out["logprobs"]):
        rep[i, : len(l)] = torch.tensor(l)
    print(
        f"  check: max |logμ(sampling pass) − logμ(S-c path)| = {float((rep - scores['S-c'][0])[mask].abs().max()):.2e}"
    )

    pairs = [
        ("L-fp32", "S-bf16"),
        ("L-fp32", "S-a32"),
        ("L-fp32", "S-a"),
        ("L-fp32", "S-b"),
        ("L-fp32", "S-c"),
        ("L-nvfp4", "S-a"),
        ("L-nvfp4", "S-b"),
        ("L-nvfp4", "S-c"),
        ("L-wq", "S-c"),
        ("L-fp32-kv", "S-c"),  # the learner attends over K/V rounded with the sampler's fp8 scales
        ("L-nvfp4-kv", "S-c"),
        ("L-fp32", "L-nvfp4"),  # the learner-side shift (π_fp32 vs π_nvfp4), "sampler" = L-nvfp4
        ("L-fp32", "L-wq"),
        # the sampler chain against S-c itself: how far each partial sampler is from the full one
        ("S-bf16", "S-c"),
        ("S-a", "S-c"),
        ("S-b", "S-c"),
    ]
    results = {}
    print(
        "\n(2) δ = log π_first − log π_second on the S-c tokens; mean δ = −KL(μ‖π) in expectation only where the"
        " second is S-c; 'exact KL' = KL(π_second ‖ π_first) summed over the vocabulary at every visited state"
    )
    print(
        "    learner vs sampler      mean δ     mean|δ|   mean resp-mean δ  mean resp Σδ   exact KL(μ‖π)   sd δ"
    )
    for a, b in pairs:
        s = pair_stats(scores[a][0], scores[b][0], scores[a][1], scores[b][1], mask)
        results[f"{a} vs {b}"] = s
        print(
            f"    {a:8} vs {b:8}  {s['mean_delta']:+.5f}  {s['mean_abs_delta']:.5f}   {s['mean_resp_mean_delta']:+.5f}"
            f"          {s['mean_resp_sum_delta']:+.4f}       {s['exact_kl']:.5f}       {s['std_delta']:.4f}"
        )
    d = {k: v["delta"] for k, v in results.items()}
    print("\n(3) correlations of δ over tokens")
    correlations = {}
    for x, y in (
        ("L-fp32 vs S-c", "L-nvfp4 vs S-c"),
        ("L-fp32 vs S-c", "L-fp32 vs L-nvfp4"),
        ("L-fp32 vs S-c", "L-fp32 vs S-a"),
        ("L-fp32 vs S-c", "L-wq vs S-c"),
        ("L-fp32 vs S-a32", "L-fp32 vs L-nvfp4"),
        ("L-fp32 vs S-a", "L-fp32 vs L-nvfp4"),
    ):
        correlations[f"{x} ~ {y}"] = c = corr(d[x], d[y], mask)
        print(f"    corr({x}, {y}) = {c:+.3f}")
    # the telescoping chain: δ(L-fp32 vs S-c) = Σ of these steps (log μ_prev − log μ_next along the chain)
    print("\n(4) the chain L-fp32 → S-bf16 → S-a → S-b → S-c: each step's log π_prev − log π_next")
    m = mask.float()
    chain = {}
    for a, b in (("L-fp32", "S-bf16"), ("S-bf16", "S-a"), ("S-a", "S-b"), ("S-b", "S-c")):
        step = scores[a][0] - scores[b][0]
        mean, mean_abs = float((step * m).sum() / m.sum()), float((step.abs() * m).sum() / m.sum())
        chain[f"{a} -> {b}"] = {"mean": mean, "mean_abs": mean_abs}
        print(f"    {a:7} → {b:7}: mean {mean:+.5f}, mean|·| {mean_abs:.5f}")
    if args.json:
        payload = {
            "args": vars(args),
            "sampler_recipe": s_recipe,
            "learner_recipe": l_recipe,
            "weights": wt,
            "tokens": int(mask.sum()),
            "pairs": {k: {kk: vv for kk, vv in v.items() if kk != "delta"} for k, v in results.items()},
            "correlations": correlations,
            "chain": chain,
            "sft": _sft_record(args.model),
            "seconds": time.perf_counter() - t0,
        }
        Path(args.json).write_text(json.dumps(payload, indent=1))
        print(f"wrote {args.json}")
    print(f"total {time.perf_counter() - t0:.0f}s")
    return 0


def _sft_record(model: str) -> dict | None:
    """The checkpoint's SFT record (``sft.json`` beside it, as the testbed's SFT writes it): which checkpoint
    the numbers are of (its size, steps and held-out accuracy), or None when the folder has none."""
    path = Path(model) / "sft.json"
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    return {k: record.get(k) for k in ("params", "steps_done", "stopped_by", "final")}


if __name__ == "__main__":
    raise SystemExit(main())
