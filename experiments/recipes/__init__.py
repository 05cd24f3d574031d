"""Recipes for the DAPO-math ablation: YAML layers merged into one flat dict.

A recipe is ``base.yaml`` (DAPO mapped to TRL + the NVFP4 learner) <- ``presets/<preset>.yaml`` (model, data,
batch, cluster layout) <- ``arms/<arm>.yaml`` (the mismatch correction) <- ``levels/<level>.yaml`` (optional:
the learner/sampler numerics, i.e. the mismatch level) <- your file <- overrides; later layers win, mappings
merge key by key, lists and scalars are replaced, and a ``dataset``/``eval_dataset`` mapping that names a new
``source`` replaces the old one whole. A level replaces the numerics of the layers below it whole (the keys of
:data:`LEARNER_NUMERICS` and ``sampler_kwargs``' :data:`SAMPLER_NUMERICS`; one it does not set takes the
library default), holds nothing else, and an arm holds none of them: an arm is a correction, a level is a
mismatch, and the two never overlap. The result is flat:

* every ``TriageGRPOConfig`` field (TRL ``GRPOConfig`` + the TRIAGE fields), with ``quant_recipe`` a
  mapping of ``QuantRecipe`` fields;
* and the sections in :data:`RECIPE_SECTIONS`: ``model_name_or_path``, ``dataset`` and ``eval_dataset``
  (``triage.experiments.data`` specs), ``reward_funcs`` (``triage.trainers.rewards`` names), ``launch``
  (cluster layout, read by experiments/cluster/launch_multinode.sh) and ``description``.

``load_recipe("qwen3-4b/triage")`` names a preset and an arm, ``load_recipe("tiny/grpo-none/aligned")`` a
preset, an arm and a level; ``load_recipe("my.yaml")`` reads a file whose optional ``preset:``, ``arm:`` and
``level:`` keys pull those layers in first. ``python -m triage.experiments.recipes
PRESET/ARM -o recipe.yaml`` writes the merged YAML that ``triage train --config`` reads.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from triage.trainers.config import SAMPLER_NUMERICS_KEYS

__all__ = [
    "RECIPE_DIR",
    "ALL_ARMS",
    "ARMS",
    "FOLLOW_UP_ARMS",
    "LEVELS",
    "LEARNER_NUMERICS",
    "SAMPLER_NUMERICS",
    "PRESETS",
    "RECIPE_SECTIONS",
    "LAUNCH_KEYS",
    "ACCELERATE_DIR",
    "CPU_LAYER",
    "load_yaml",
    "merge",
    "numerics_keys",
    "check_layer",
    "load_layer",
    "without_numerics",
    "parse_overrides",
    "parse_value",
    "load_recipe",
    "validate_recipe",
    "split_recipe",
    "build_config",
    "recipe_names",
    "dump_recipe",
]

RECIPE_DIR = Path(__file__).resolve().parent
ACCELERATE_DIR = RECIPE_DIR.parent / "accelerate"
CPU_LAYER = RECIPE_DIR / "cpu.yaml"  # the CPU overrides (load_recipe(..., cpu=True), `triage train --cpu`)
ARMS = ("grpo-none", "tis", "icepop", "opsm", "triage", "triage-mask")
# Not run by default (`--arms` selects them): TRL's default sequence IS through the same switch, TRIAGE's
# other profiles by name, the follow-ups of the testbed (docs/results.md §3), and prime-rl's
# probability-space mask with its two controls (docs/triage.md, "Probability-space tolerance").
FOLLOW_UP_ARMS = (
    "seq-mis-trl",
    "triage-keep-down",
    "triage-soft-up",
    "triage-suppress-down",
    "triage-suppress-no-guard",
    "triage-suppress-no-floor",
    "triage-suppress-soft-only",
    "triage-no-is",
    "prime-rl-mask",
    "triage-prob-mask-down",
    "triage-prob-mask-both",
)
ALL_ARMS = ARMS + FOLLOW_UP_ARMS
PRESETS = ("qwen3-4b", "qwen3-30b-a3b", "tiny")
# Learner/sampler mismatch levels (levels/*.yaml), in the order of docs/results.md §1's table: roughly from the
# closest alignment to the widest gap, then the levels whose learner is NVFP4 too.
LEVELS = (
    "aligned",
    "bf16-sampler",
    "nvfp4-matched",
    "nvfp4-served-fp8kv",
    "nvfp4-row",
    "nvfp4-row-fp8kv",
    "nvfp4-tensor-fp8kv",
    "nvfp4-coarse-fp8kv",
    "pair",
    "pair-row",
    "realistic",
    "realistic-bf16-learner",
)
RECIPE_SECTIONS = ("model_name_or_path", "dataset", "eval_dataset", "reward_funcs", "launch", "description")
LAUNCH_KEYS = ("accelerate_config", "train_nodes", "gpus_per_node", "vllm_serve", "vllm_extra_args")
_COMPOSE_KEYS = ("preset", "arm", "level")
_REPLACE_WHEN_SOURCE_CHANGES = ("dataset", "eval_dataset")
#: The numerics a level sets and an arm may not: the learner's (top-level keys: its precision and NVFP4 recipe,
#: and the trainer's bf16 autocast) and the HF sampler's (``sampler_kwargs`` keys: which weights it samples
#: with, their dtype and NVFP4 recipe, the KV-cache format).
LEARNER_NUMERICS = ("learner_precision", "quant_recipe", "bf16")
SAMPLER_NUMERICS = ("sampler_model", "dtype", *SAMPLER_NUMERICS_KEYS)


def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """A YAML file that must hold a mapping (an empty file is an empty mapping)."""
    path = Path(path)
    with path.open(encoding="utf-8") as fh:
        data = yaml.safe_load(fh)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a recipe file must be a YAML mapping, got {type(data).__name__}")
    return data


def merge(base: Mapping[str, Any], update: Mapping[str, Any], replace_sources: bool = True) -> dict[str, Any]:
    """``update`` over ``base``: mappings merge recursively, everything else is replaced (copies). A dataset
    spec that names a ``source`` replaces the old spec whole (``replace_sources``; off while the dotted
    overrides of one command line are gathered, so their order does not matter)."""
    out = copy.deepcopy(dict(base))
    for key, value in update.items():
        old = out.get(key)
        replace_whole = (
            replace_sources
            and key in _REPLACE_WHEN_SOURCE_CHANGES
            and isinstance(value, Mapping)
            and "source" in value
        )
        if isinstance(old, Mapping) and isinstance(value, Mapping) and not replace_whole:
            out[key] = merge(old, value, replace_sources)
        else:
            out[key] = copy.deepcopy(value)
    return out


_FLOAT_WITHOUT_DOT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def parse_value(text: str) -> Any:
    """The value of a ``KEY=VALUE`` override, parsed as YAML with two fixes to YAML 1.1: ``no``/``yes``/``on``/
    ``off`` stay strings (only true/false are booleans: ``eval_strategy=no`` is "no"), and ``3e-5`` is a float
    (PyYAML wants ``3.0e-5``)."""
    parsed = yaml.safe_load(text)
    stripped = text.strip()
    if isinstance(parsed, bool) and stripped.lower() not in ("true", "false"):
        return stripped
    if isinstance(parsed, str) and _FLOAT_WITHOUT_DOT.fullmatch(stripped):
        return float(stripped)
    return parsed


def parse_overrides(overrides: Mapping[str, Any] | Iterable[str] | None) -> dict[str, Any]:
    """Overrides as a nested mapping. Accepts a mapping (dotted keys allowed: ``{"quant_recipe.scale": "row"}``)
    or ``KEY=VALUE`` strings whose value is parsed as YAML (``["max_steps=5", "dataset.n=64"]``)."""
    if overrides is None:
        return {}
    if isinstance(overrides, Mapping):
        items = list(overrides.items())
    else:
        items = []
        for text in overrides:
            if not isinstance(text, str) or "=" not in text:
                raise ValueError(f"an override is KEY=VALUE, got {text!r}")
            key, value = text.split("=", 1)
            items.append((key.strip(), parse_value(value)))
    nested: dict[str, Any] = {}
    for key, value in items:
        parts = key.split(".")
        if not all(parts):
            raise ValueError(f"bad override key {key!r}")
        layer = {parts[-1]: value}
        for part in reversed(parts[:-1]):
            layer = {part: layer}
        nested = merge(nested, layer, replace_sources=False)
    return nested


def numerics_keys(layer: Mapping[str, Any]) -> list[str]:
    """The numerics keys a recipe layer sets, dotted (``learner_precision``, ``sampler_kwargs.precision``, ...)."""
    keys = [k for k in LEARNER_NUMERICS if k in layer]
    sampler = layer.get("sampler_kwargs")
    if isinstance(sampler, Mapping):
        keys += [f"sampler_kwargs.{k}" for k in SAMPLER_NUMERICS if k in sampler]
    return keys


def check_layer(kind: str, name: str, layer: Mapping[str, Any]) -> None:
    """An arm sets no numerics key; a level sets numerics keys only (``ValueError`` naming the layer and key)."""
    if kind == "arms" and numerics_keys(layer):
        raise ValueError(
            f"arm {name!r} sets {numerics_keys(layer)[0]!r}: an arm is a mismatch correction; the learner/sampler "
            "numerics belong to a level (experiments/recipes/levels)"
        )
    if kind == "levels":
        sampler = layer.get("sampler_kwargs") or {}
        other = [k for k in layer if k not in (*LEARNER_NUMERICS, "sampler_kwargs")]
        if not isinstance(sampler, Mapping):
            other.append("sampler_kwargs")
        else:
            other += [f"sampler_kwargs.{k}" for k in sampler if k not in SAMPLER_NUMERICS]
        if other:
            raise ValueError(
                f"level {name!r} sets {other[0]!r}: a level holds only learner/sampler numerics "
                f"({', '.join(LEARNER_NUMERICS)}, sampler_kwargs.{{{', '.join(SAMPLER_NUMERICS)}}})"
            )


def load_layer(kind: str, name: str) -> dict[str, Any]:
    """The recipe layer ``RECIPE_DIR/<kind>/<name>.yaml`` (``kind``: arms, presets or levels), checked
    (:func:`check_layer`); an unknown name is an error listing the known ones."""
    known = {"arms": ALL_ARMS, "presets": PRESETS, "levels": LEVELS}[kind]
    if name not in known:
        raise ValueError(f"unknown {kind[:-1]} {name!r}; known: {', '.join(known)}")
    layer = load_yaml(RECIPE_DIR / kind / f"{name}.yaml")
    check_layer(kind, name, layer)
    return layer


def without_numerics(recipe: Mapping[str, Any]) -> dict[str, Any]:
    """``recipe`` without its learner/sampler numerics keys (what a level replaces)."""
    out = {k: copy.deepcopy(v) for k, v in recipe.items() if k not in LEARNER_NUMERICS}
    if isinstance(out.get("sampler_kwargs"), Mapping):
        out["sampler_kwargs"] = {k: v for k, v in out["sampler_kwargs"].items() if k not in SAMPLER_NUMERICS}
    return out


def _compose(layer: Mapping[str, Any]) -> dict[str, Any]:
    """base <- preset <- arm <- level (replacing the numerics) <- the layer itself (without those keys)."""
    recipe = load_yaml(RECIPE_DIR / "base.yaml")
    if layer.get("preset") is not None:
        recipe = merge(recipe, load_layer("presets", layer["preset"]))
    if layer.get("arm") is not None:
        recipe = merge(recipe, load_layer("arms", layer["arm"]))
    if layer.get("level") is not None:
        recipe = merge(without_numerics(recipe), load_layer("levels", layer["level"]))
    return merge(recipe, {k: v for k, v in layer.items() if k not in _COMPOSE_KEYS})


def load_recipe(
    path_or_name: str | os.PathLike,
    overrides: Mapping[str, Any] | Iterable[str] | None = None,
    *,
    validate: bool = True,
    cpu: bool = False,
) -> dict[str, Any]:
    """The flat recipe for ``"PRESET/ARM"``, ``"PRESET/ARM/LEVEL"`` or a YAML file, with ``overrides`` applied last.

    ``cpu=True`` layers :data:`CPU_LAYER` between the recipe and ``overrides``: the tiny model built locally,
    CPU and fp32, 8 steps, a small eval (a laptop smoke run of the ``tiny`` preset). Validated with
    :func:`validate_recipe` unless ``validate=False``. Unknown keys are errors.
    """
    text = os.fspath(path_or_name)
    path = Path(text)
    if path.suffix in (".yaml", ".yml") or path.is_file():
        if not path.is_file():
            raise FileNotFoundError(f"recipe file not found: {path}")
        layer = load_yaml(path)
    elif text.count("/") in (1, 2):
        layer = dict(zip(("preset", "arm", "level"), text.split("/")))
    else:
        raise ValueError(
            f"{text!r} is neither a recipe file nor PRESET/ARM[/LEVEL] (presets: {', '.join(PRESETS)}; "
            f"arms: {', '.join(ALL_ARMS)}; levels: {', '.join(LEVELS)})"
        )
    recipe = _compose(layer)
    if cpu:
        recipe = merge(recipe, load_yaml(CPU_LAYER))
    recipe = merge(recipe, parse_overrides(overrides))
    if validate:
        validate_recipe(recipe)
    return recipe


def recipe_names() -> list[str]:
    """Every shipped ``PRESET/ARM`` combination."""
    return [f"{preset}/{arm}" for preset in PRESETS for arm in ALL_ARMS]


# ---------------------------------------------------------------------------------------------------------
# validation


def _config_class():
    from triage.trainers.config import TriageGRPOConfig

    return TriageGRPOConfig


def _config_fields() -> set[str]:
    import dataclasses

    return {f.name for f in dataclasses.fields(_config_class()) if f.init}


def _check_launch(launch: Any) -> None:
    if not isinstance(launch, Mapping):
        raise ValueError(f"launch must be a mapping, got {launch!r}")
    unknown = [k for k in launch if k not in LAUNCH_KEYS]
    if unknown:
        raise ValueError(f"launch: unknown keys {unknown}; keys: {list(LAUNCH_KEYS)}")
    name = launch.get("accelerate_config")
    if name is not None and not (ACCELERATE_DIR / f"{name}.yaml").is_file() and not Path(name).is_file():
        shipped = sorted(p.stem for p in ACCELERATE_DIR.glob("*.yaml"))
        raise ValueError(f"launch.accelerate_config {name!r} is neither a file nor one of {shipped}")
    for key in ("train_nodes", "gpus_per_node"):
        if key in launch and (not isinstance(launch[key], int) or launch[key] < 1):
            raise ValueError(f"launch.{key} must be a positive int, got {launch[key]!r}")
    serve = launch.get("vllm_serve")
    if serve is not None:
        import dataclasses

        from trl.scripts.vllm_serve import ScriptArguments

        names = {f.name for f in dataclasses.fields(ScriptArguments)}
        if not isinstance(serve, Mapping):
            raise ValueError(f"launch.vllm_serve must be a mapping, got {serve!r}")
        unknown = [k for k in serve if k not in names]
        if unknown:
            raise ValueError(f"launch.vllm_serve: unknown `trl vllm-serve` arguments {unknown}")
    extra = launch.get("vllm_extra_args")
    if extra is not None and (not isinstance(extra, list) or not all(isinstance(a, str) for a in extra)):
        raise ValueError(
            f"launch.vllm_extra_args must be a list of strings (passed on to `vllm serve`), got {extra!r}"
        )


def validate_recipe(recipe: Mapping[str, Any], *, build: bool = False) -> None:
    """Check a flat recipe without loading models or data; raise ``ValueError`` naming the bad key.

    Checks: every key is a ``TriageGRPOConfig`` field or a recipe section (with a close-match hint); the
    TRIAGE fields through ``TriageConfig``; ``quant_recipe`` and ``sampler_kwargs`` with the checks
    ``TriageGRPOConfig`` itself runs (``quant_recipe_from``, ``check_sampler_kwargs``, against the sampler
    ``resolve_sampler`` picks); the dataset specs; the reward names and options; the ``launch`` section. With
    ``build=True`` also constructs ``TriageGRPOConfig`` (on CPU, bf16 off: the device is not checked).
    """
    from triage import TriageConfig
    from triage.experiments.data import validate_spec
    from triage.trainers.config import check_sampler_kwargs, did_you_mean, quant_recipe_from, resolve_sampler
    from triage.trainers.rewards import build_reward_funcs

    fields = _config_fields()
    known = fields | set(RECIPE_SECTIONS)
    for key in recipe:
        if key not in known:
            raise ValueError(f"unknown recipe key {key!r}{did_you_mean(key, known)}")
    for key in ("model_name_or_path", "dataset", "reward_funcs"):
        if recipe.get(key) in (None, "", []):
            raise ValueError(f"recipe needs {key!r}")
    if not isinstance(recipe["model_name_or_path"], str):
        raise ValueError(f"model_name_or_path must be a string, got {recipe['model_name_or_path']!r}")
    for section in ("dataset", "eval_dataset"):
        if recipe.get(section) is not None:
            try:
                validate_spec(recipe[section])
            except ValueError as err:
                raise ValueError(f"{section}: {err}") from None
    try:
        build_reward_funcs(recipe["reward_funcs"], recipe.get("max_completion_length"))
    except (TypeError, ValueError) as err:
        raise ValueError(f"reward_funcs: {err}") from None
    try:
        correction = TriageConfig.from_dict(dict(recipe)).correction
    except ValueError as err:
        raise ValueError(f"TRIAGE fields: {err}") from None
    if recipe.get("quant_recipe") is not None:
        if recipe.get("learner_precision") != "nvfp4":
            raise ValueError("quant_recipe is set but learner_precision is not 'nvfp4'")
        quant_recipe_from(recipe["quant_recipe"], "quant_recipe")
    sampler = resolve_sampler(recipe.get("sampler"), bool(recipe.get("use_vllm")), correction)
    kwargs = recipe.get("sampler_kwargs")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise ValueError(f"sampler_kwargs must be a mapping, got {kwargs!r}")
    check_sampler_kwargs(sampler, kwargs)
    if recipe.get("launch") is not None:
        _check_launch(recipe["launch"])
    if build:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="triage-recipe-") as tmp:
            build_config(recipe, output_dir=tmp, use_cpu=True, bf16=False)


def split_recipe(recipe: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(``TriageGRPOConfig`` keyword arguments, the other sections)."""
    config = {k: copy.deepcopy(v) for k, v in recipe.items() if k not in RECIPE_SECTIONS}
    sections = {k: copy.deepcopy(v) for k, v in recipe.items() if k in RECIPE_SECTIONS}
    return config, sections


def build_config(recipe: Mapping[str, Any], **overrides: Any):
    """``TriageGRPOConfig(**config fields, **overrides)`` (e.g. ``output_dir=``)."""
    config, _ = split_recipe(recipe)
    config.update(overrides)
    return _config_class()(**config)


def dump_recipe(recipe: Mapping[str, Any]) -> str:
    """The recipe as YAML (keys in recipe order)."""
    return yaml.safe_dump(dict(recipe), sort_keys=False, default_flow_style=False, allow_unicode=True)
