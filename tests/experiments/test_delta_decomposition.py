"""``experiments/testbed/delta_decomposition.py`` on the smoke SFT checkpoint: it runs end to end, every
pair's exact KL is a KL (≥ 0), the chain's endpoints are ordered as the errors added (no quantization ≪ the
full sampler), its weight table finds the per-row weight scales behind most differences, and the JSON names
the checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "testbed" / "delta_decomposition.py"


def _script():
    """The script as a module (its functions and ``main`` in this process)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("delta_decomposition", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_delta_decomposition_runs_and_orders_the_errors(tmp_path, torch_twins):
    from triage.experiments.ablate import SCALES
    from triage.experiments.sft import ensure_sft_checkpoint

    sft = tmp_path / "sft"
    ensure_sft_checkpoint(SCALES["smoke"].sft, sft, log=lambda *_: None)
    out = tmp_path / "delta.json"
    args = ["--model", str(sft), "--prompts", "2", "--generations", "2", "--max-new-tokens", "12"]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--json", str(out)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    pairs = result["pairs"]
    assert {"L-fp32 vs S-bf16", "L-fp32 vs S-c", "L-nvfp4 vs S-c", "S-b vs S-c"} <= set(pairs)
    assert all(p["exact_kl"] >= 0 for p in pairs.values())
    assert pairs["L-fp32 vs S-bf16"]["exact_kl"] < pairs["L-fp32 vs S-c"]["exact_kl"] / 10
    assert result["tokens"] > 0 and result["weights"]
    # the sampler's per-row weight scales (vs the pair learner's per-tensor) set most of the differences
    assert all(w["material_row_scale"] > 0.5 > w["material_profile"] for w in result["weights"])
    assert result["sft"]["params"] > 0 and set(result["chain"]) == {
        "L-fp32 -> S-bf16",
        "S-bf16 -> S-a",
        "S-a -> S-b",
        "S-b -> S-c",
    }


def test_the_kv_rounding_learner_is_the_learner_or_the_sampler_it_emulates(tmp_path, torch_twins):
    """``score_learner_kv``: with a native cache it is the plain learner forward; on the sampler's own model
    with the fp8 cache it gives the sampler's token-by-token log-probs bit for bit."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from triage.experiments.ablate import SCALES
    from triage.experiments.sft import ensure_sft_checkpoint

    dd = _script()
    sft = tmp_path / "sft"
    ensure_sft_checkpoint(SCALES["smoke"].sft, sft, log=lambda *_: None)
    tok = AutoTokenizer.from_pretrained(sft)
    master = AutoModelForCausalLM.from_pretrained(sft, dtype=torch.float32).eval().requires_grad_(False)
    recipe = dd.level("nvfp4-row-fp8kv")["sampler_kwargs"]["quant_recipe"]
    sampler = dd.sampler_copy(master, precision="nvfp4", quant_recipe=recipe)
    batch, _ = dd.sample(sampler, tok, dd.prompts(2, 0), 2, 1.3, 12, "fp8_e4m3", 0)
    mask = batch.completion_mask
    learner = dd.score(master, "learner", batch, 1.3)[0]
    assert (learner - dd.score_learner_kv(master, batch, 1.3, "native")[0])[mask].abs().max() < 1e-5
    decode = dd.score(sampler, "sampler", batch, 1.3, "fp8_e4m3")[0]
    assert torch.equal(decode[mask], dd.score_learner_kv(sampler, batch, 1.3, "fp8_e4m3")[0][mask])


def test_learner_level_picks_the_nvfp4_learner_recipe(tmp_path, torch_twins):
    """``--learner-level pair-row``: L-nvfp4 on the sampler's own per-row recipe; a level without an NVFP4
    learner against that sampler is refused naming the option."""
    from triage.experiments.ablate import SCALES
    from triage.experiments.sft import ensure_sft_checkpoint

    sft = tmp_path / "sft"
    ensure_sft_checkpoint(SCALES["smoke"].sft, sft, log=lambda *_: None)
    base = [sys.executable, str(SCRIPT), "--model", str(sft), "--prompts", "1", "--generations", "2"]
    out = tmp_path / "delta.json"
    proc = subprocess.run(
        [*base, "--max-new-tokens", "6", "--learner-level", "pair-row", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["learner_recipe"]["scale"] == "row" and result["args"]["learner_level"] == "pair-row"
    # on the sampler's own recipe the learner's Ŵ differs from the sampler's only by the bf16 cast of W (the
    # pair learner's per-tensor scale moves most elements by more than 1 %: the first test)
    assert all(w["material"] < 0.1 for w in result["weights"])
    with pytest.raises(SystemExit, match="--learner-level nvfp4-row: not an NVFP4 learner"):
        _script().main(["--model", str(sft), "--learner-level", "nvfp4-row"])  # refused before any work
