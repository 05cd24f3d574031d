"""TriageGRPOConfig mirrors TriageConfig, validates early, parses from YAML / the command line."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from trainer_testkit import make_args
from trl import TrlParser

from triage import TriageConfig
from triage.trainers import TriageGRPOConfig
from triage.trainers.grpo_trainer import resolve_sampler_kwargs


def test_every_triage_field_is_mirrored_with_the_same_default(tmp_path):
    names = {f.name for f in dataclasses.fields(TriageGRPOConfig)}
    assert set(TriageConfig.field_names()) <= names
    assert make_args(tmp_path).triage_config() == TriageConfig()


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("correction", "bogus", "correction"),
        ("amplify_down", "drop", "amplify_down"),
        ("tau", "wide", "tau"),
        ("icepop_low", 9.0, "icepop_low"),
        ("learner_precision", "fp8", "learner_precision"),
        ("sampler", "ollama", "sampler"),
        ("sampler_kwargs", "{not json", "sampler_kwargs"),
        ("quant_recipe", {"block": "1x16"}, "quant_recipe is only used"),
    ],
)
def test_bad_values_fail_at_construction_naming_the_field(tmp_path, field, value, match):
    with pytest.raises(ValueError, match=match):
        make_args(tmp_path, **{field: value})


@pytest.mark.parametrize(
    "fields, match",
    [
        (
            {"sampler_kwargs": {"sede": 0}},
            r"sampler_kwargs: unknown key for sampler 'hf': 'sede' \(did you mean 'seed'",
        ),
        ({"sampler_kwargs": {"precison": "bf16"}}, r"'precison' \(did you mean 'precision'\?\)"),
        (
            {"sampler_kwargs": {"precision": "nvfp4", "quant_recipe": {"scael": "row"}}},
            r"sampler_kwargs.quant_recipe: unknown QuantRecipe field 'scael' \(did you mean 'scale'\?\)",
        ),
        ({"sampler_kwargs": {"kv_cache_dtype": "int4"}}, r"sampler_kwargs.kv_cache_dtype must be one of"),
        (
            {"learner_precision": "nvfp4", "quant_recipe": {"scael": "row"}},
            r"quant_recipe: unknown QuantRecipe field 'scael' \(did you mean 'scale'\?\)",
        ),
        (
            {"learner_precision": "nvfp4", "quant_recipe": {"scale": "token"}},
            r"quant_recipe: QuantRecipe.scale",
        ),
        ({"sampler": "sglang"}, r"sampler 'sglang' needs the key 'base_url'"),
        ({"sampler": "offline", "sampler_kwargs": {"dat": "r.jsonl"}}, r"'dat' \(did you mean 'data'"),
        ({"sampler": "sglang", "sampler_kwargs": {"base_url": "x", "precision": "bf16"}}, "'hf' only"),
        ({"use_vllm": True, "sampler_kwargs": {"seed": 0}}, "sampler_kwargs is set but sampler is None"),
    ],
)
def test_python_typos_get_the_recipes_did_you_mean_at_construction(tmp_path, fields, match):
    """sampler_kwargs / quant_recipe given in Python are checked when the config is built, not by a raw
    TypeError from the sampler or QuantRecipe when the trainer is."""
    with pytest.raises(ValueError, match=match):
        make_args(tmp_path, **fields)


def test_no_sampler_resolves_to_the_builtin_hf_sampler_only_where_trl_has_no_logprobs(tmp_path):
    """The drop-in default: TriageGRPOConfig(output_dir=...) alone needs sampler log-probs (correction triage)
    and TRL's transformers generation has none, so the HF sampler is chosen; vLLM or correction='none' keep
    TRL's own generation; an explicit sampler is kept."""
    args = TriageGRPOConfig(output_dir=str(tmp_path), use_cpu=True)
    assert args.correction == "triage" and args.sampler == "hf" and args.sampler_kwargs is None
    assert make_args(tmp_path, sampler_kwargs={"seed": 1}).sampler == "hf"  # kwargs for the default sampler
    assert make_args(tmp_path, use_vllm=True).sampler is None
    assert make_args(tmp_path, correction="none").sampler is None
    assert make_args(tmp_path, sampler="offline", sampler_kwargs={"data": "r.jsonl"}).sampler == "offline"


def test_yaml_and_cli_parsing(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "correction: icepop\ntau: auto\ntail_floor: null\nuse_cpu: true\nbf16: false\n"
        "num_generations: 2\nper_device_train_batch_size: 2\nsampler: hf\n"
        f"output_dir: {tmp_path}\n"
    )
    parser = TrlParser((TriageGRPOConfig,))
    (args,) = parser.parse_args_and_config(
        ["--config", str(recipe), "--icepop_high", "4.0", "--sampler_kwargs", '{"seed": 3}']
    )
    cfg = args.triage_config()
    assert (
        cfg.correction == "icepop" and cfg.tau == "auto" and cfg.tail_floor is None and cfg.icepop_high == 4.0
    )
    assert args.sampler_kwargs == {"seed": 3}
    assert args.vllm_importance_sampling_correction is False
    # the command line switches the optional knobs off with null (strings reach __post_init__)
    (args,) = parser.parse_args_and_config(
        ["--config", str(recipe), "--tail_floor", "0.5", "--guard_kappa", "null"]
    )
    assert args.tail_floor == 0.5 and args.guard_kappa is None and args.triage_config().guard_kappa is None
    with pytest.raises(ValueError, match="tail_floor='x'"):
        parser.parse_args_and_config(["--config", str(recipe), "--tail_floor", "x"])


def test_recipe_sampler_keys_become_hf_sampler_arguments():
    kw = resolve_sampler_kwargs("hf", {"precision": "bf16", "seed": 1})
    assert kw["sampler_model"] == "copy" and kw["dtype"] is torch.bfloat16
    assert "prepare_model" not in kw  # a bf16 copy is refreshed in place; nothing to convert
    nv = resolve_sampler_kwargs("hf", {"precision": "nvfp4", "quant_recipe": {"scale": "row"}})
    assert nv["sampler_model"] == "copy" and callable(nv["prepare_model"])
    kw = resolve_sampler_kwargs("hf", {"precision": "bf16", "kv_cache_dtype": "fp8_e4m3"})
    assert kw["kv_cache_dtype"] == "fp8_e4m3"  # the HF sampler's emulated fp8 KV cache
    with pytest.raises(ValueError, match="precision: nvfp4"):
        resolve_sampler_kwargs("hf", {"quant_recipe": {"scale": "row"}})
    assert resolve_sampler_kwargs("sglang", {"base_url": "http://x"}) == {"base_url": "http://x"}
