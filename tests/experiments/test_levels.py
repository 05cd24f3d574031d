"""Mismatch levels (experiments/recipes/levels): the layer after the arm that owns the learner/sampler numerics,
and the validation that keeps arms and levels apart."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from triage.experiments.recipes import (
    ALL_ARMS,
    LEARNER_NUMERICS,
    LEVELS,
    SAMPLER_NUMERICS,
    build_config,
    check_layer,
    load_recipe,
    numerics_keys,
    validate_recipe,
)

LEVEL_DIR = Path(__file__).resolve().parents[2] / "experiments" / "recipes" / "levels"


def _numerics(recipe):
    kw = recipe.get("sampler_kwargs") or {}
    return (
        {k: recipe.get(k) for k in LEARNER_NUMERICS},
        {k: kw.get(k) for k in SAMPLER_NUMERICS},
    )


def test_shipped_levels_hold_numerics_only():
    assert {p.stem for p in LEVEL_DIR.glob("*.yaml")} == set(LEVELS)
    for level in LEVELS:
        layer = yaml.safe_load((LEVEL_DIR / f"{level}.yaml").read_text())
        check_layer("levels", level, layer)
        assert {"bf16", "learner_precision"} <= set(layer) and "sampler_model" in layer["sampler_kwargs"], (
            level
        )


@pytest.mark.parametrize("level", LEVELS)
def test_every_arm_at_every_level_validates_and_builds(level):
    for arm in ALL_ARMS:
        recipe = load_recipe(f"tiny/{arm}/{level}")
        validate_recipe(recipe, build=True)
        # the arm's correction survives the level; the level's numerics replace the preset's
        assert recipe["correction"] == load_recipe(f"tiny/{arm}")["correction"]
        layer = yaml.safe_load((LEVEL_DIR / f"{level}.yaml").read_text())
        learner, sampler = _numerics(recipe)
        assert learner == {k: layer.get(k) for k in LEARNER_NUMERICS}, (arm, level)
        assert sampler == {k: layer["sampler_kwargs"].get(k) for k in SAMPLER_NUMERICS}, (arm, level)


def test_the_tiny_preset_numerics_are_the_realistic_level():
    for arm in ALL_ARMS:
        assert load_recipe(f"tiny/{arm}") == load_recipe(f"tiny/{arm}/realistic"), arm


def test_levels_replace_the_numerics_whole():
    """`aligned` sets no sampler precision or quantizer: the preset's NVFP4 sampler copy must not leak in."""
    aligned = load_recipe("tiny/grpo-none/aligned")
    assert aligned["sampler_kwargs"] == {"sampler_model": "shared", "kv_cache_dtype": "native"}
    assert aligned["learner_precision"] == "bf16" and "quant_recipe" not in aligned
    assert aligned["bf16"] is False  # no autocast: the learner scores in the weights' dtype, as it samples
    config = build_config(aligned, output_dir="unused", use_cpu=True)
    assert config.learner_precision == "bf16" and config.quant_recipe is None and not config.bf16
    # the other sampler keys of the preset stay (a level replaces numerics only) and overrides still win
    over = load_recipe(
        "tiny/grpo-none/aligned", ["sampler_kwargs.batch_size=8", "sampler_kwargs.kv_cache_dtype=fp8"]
    )
    assert over["sampler_kwargs"] == {"sampler_model": "shared", "kv_cache_dtype": "fp8", "batch_size": 8}
    matched = load_recipe("tiny/triage/nvfp4-matched")
    assert matched["sampler_kwargs"]["quant_recipe"] == matched["quant_recipe"]  # the same recipe both sides
    assert matched["sampler_kwargs"]["dtype"] == "float32" and matched["bf16"] is False
    bf16 = load_recipe("tiny/tis/realistic-bf16-learner")
    assert bf16["learner_precision"] == "bf16" and "quant_recipe" not in bf16 and bf16["bf16"] is True
    assert bf16["sampler_kwargs"]["quant_recipe"]["scale"] == "tensor"


def test_the_served_level_is_a_calibrated_modelopt_sampler():
    """`nvfp4-served-fp8kv`: per-tensor weight scales shared by each fused group and calibrated static
    activation scales, as the HF sampler the trainer builds from it (the keys reach ``HFSampler``)."""
    from triage.trainers.grpo_trainer import resolve_sampler_kwargs
    from triage.trainers.sampling import HFSampler

    recipe = load_recipe("tiny/grpo-none/nvfp4-served-fp8kv")
    sampler_kwargs = recipe["sampler_kwargs"]
    assert (
        sampler_kwargs["activation_scale"] == "calibrated" and sampler_kwargs["kv_cache_dtype"] == "fp8_e4m3"
    )
    assert sampler_kwargs["fused_weight_scale"] == "shared"
    assert (
        sampler_kwargs["quant_recipe"]["scale"] == "tensor"
        and sampler_kwargs["quant_recipe"]["profile"] == "modelopt"
    )
    assert recipe["learner_precision"] == "bf16" and recipe["bf16"] is False
    config = build_config(recipe, output_dir="unused", use_cpu=True)
    sampler = HFSampler(**resolve_sampler_kwargs("hf", config.sampler_kwargs))
    assert sampler.activation_scale == "calibrated" and sampler.sampler_model == "copy"
    assert sampler.fused_weight_scale == "shared"


def test_a_recipe_file_pulls_a_level_in(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("preset: tiny\narm: triage\nlevel: nvfp4-matched\nmax_steps: 3\n")
    recipe = load_recipe(path)
    assert recipe == load_recipe("tiny/triage/nvfp4-matched", {"max_steps": 3})
    assert "level" not in recipe


@pytest.mark.parametrize(
    "kind, layer, match",
    [
        ("levels", {"learner_precision": "bf16", "correction": "tis"}, "level 'x' sets 'correction'"),
        (
            "levels",
            {"sampler_kwargs": {"precision": "bf16", "seed": 3}},
            "level 'x' sets 'sampler_kwargs.seed'",
        ),
        ("levels", {"sampler_kwargs": "copy"}, "level 'x' sets 'sampler_kwargs'"),
        ("arms", {"correction": "tis", "learner_precision": "nvfp4"}, "arm 'x' sets 'learner_precision'"),
        (
            "arms",
            {"sampler_kwargs": {"kv_cache_dtype": "fp8"}},
            "arm 'x' sets 'sampler_kwargs.kv_cache_dtype'",
        ),
        (
            "arms",
            {"sampler_kwargs": {"activation_scale": "calibrated"}},
            "arm 'x' sets 'sampler_kwargs.activation_scale'",
        ),
        (
            "arms",
            {"sampler_kwargs": {"fused_weight_scale": "shared"}},
            "arm 'x' sets 'sampler_kwargs.fused_weight_scale'",
        ),
    ],
)
def test_arms_set_no_numerics_and_levels_nothing_else(kind, layer, match):
    with pytest.raises(ValueError, match=match):
        check_layer(kind, "x", layer)


def test_numerics_keys_and_names():
    layer = {"quant_recipe": {}, "tau": 0.1, "sampler_kwargs": {"dtype": "bfloat16", "batch_size": 4}}
    assert numerics_keys(layer) == ["quant_recipe", "sampler_kwargs.dtype"]
    check_layer("arms", "fine", {"correction": "tis", "sampler_kwargs": {"batch_size": 4}})
    with pytest.raises(ValueError, match=r"unknown level 'exact'; known: aligned, bf16-sampler"):
        load_recipe("tiny/triage/exact")
    with pytest.raises(ValueError, match=r"neither a recipe file nor PRESET/ARM\[/LEVEL\]"):
        load_recipe("tiny/triage/aligned/extra")
