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
