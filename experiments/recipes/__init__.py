"""Recipes for the DAPO-math ablation: YAML layers merged into one flat dict.

A recipe is ``base.yaml`` (DAPO mapped to TRL + the NVFP4 learner) <- ``presets/<preset>.yaml`` (model, data,
batch, cluster layout) <- ``arms/<arm>.yaml`` (the mismatch correction) <- your file <- overrides; later
layers win, mappings merge key by key, lists and scalars are replaced, and a ``dataset``/``eval_dataset``
mapping that names a new ``source`` replaces the old one whole. The result is flat:

* every ``TriageGRPOConfig`` field (TRL ``GRPOConfig`` + the TRIAGE fields), with ``quant_recipe`` a
  mapping of ``QuantRecipe`` fields;
* and the sections in :data:`RECIPE_SECTIONS`: ``model_name_or_path``, ``dataset`` and ``eval_dataset``
  (``triage.experiments.data`` specs), ``reward_funcs`` (``triage.trainers.rewards`` names), ``launch``
  (cluster layout, read by experiments/cluster/launch_multinode.sh) and ``description``.

``load_recipe("qwen3-4b/triage")`` names a preset and an arm; ``load_recipe("my.yaml")`` reads a file whose
optional ``preset:`` and ``arm:`` keys pull those layers in first. ``python -m triage.experiments.recipes
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

__all__ = [
    "RECIPE_DIR",
    "ALL_ARMS",
    "ARMS",
    "FOLLOW_UP_ARMS",
    "PRESETS",
    "RECIPE_SECTIONS",
    "LAUNCH_KEYS",
    "ACCELERATE_DIR",
    "CPU_LAYER",
    "load_yaml",
    "merge",
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
# Not run by default: the follow-ups of the first local ablation (docs/results.md §3); `--arms` selects them.
FOLLOW_UP_ARMS = ("triage-keep-down", "triage-no-is", "triage-no-guard", "triage-no-floor")
ALL_ARMS = ARMS + FOLLOW_UP_ARMS
PRESETS = ("qwen3-4b", "qwen3-30b-a3b", "tiny")
RECIPE_SECTIONS = ("model_name_or_path", "dataset", "eval_dataset", "reward_funcs", "launch", "description")
LAUNCH_KEYS = ("accelerate_config", "train_nodes", "gpus_per_node", "vllm_serve", "vllm_extra_args")
_COMPOSE_KEYS = ("preset", "arm")
_REPLACE_WHEN_SOURCE_CHANGES = ("dataset", "eval_dataset")


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


def _layer(kind: str, name: str) -> dict[str, Any]:
    known = ALL_ARMS if kind == "arms" else PRESETS
    if name not in known:
        raise ValueError(f"unknown {kind[:-1]} {name!r}; known: {', '.join(known)}")
    return load_yaml(RECIPE_DIR / kind / f"{name}.yaml")


def _compose(layer: Mapping[str, Any]) -> dict[str, Any]:
    """base <- preset <- arm <- the layer itself (without its preset/arm keys)."""
    recipe = load_yaml(RECIPE_DIR / "base.yaml")
    if layer.get("preset") is not None:
        recipe = merge(recipe, _layer("presets", layer["preset"]))
    if layer.get("arm") is not None:
        recipe = merge(recipe, _layer("arms", layer["arm"]))
    return merge(recipe, {k: v for k, v in layer.items() if k not in _COMPOSE_KEYS})


def load_recipe(
    path_or_name: str | os.PathLike,
    overrides: Mapping[str, Any] | Iterable[str] | None = None,
    *,
    validate: bool = True,
    cpu: bool = False,
) -> dict[str, Any]:
    """The flat recipe for ``"PRESET/ARM"`` or a YAML file, with ``overrides`` applied last.

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
    elif text.count("/") == 1:
        preset, arm = text.split("/")
        layer = {"preset": preset, "arm": arm}
    else:
        raise ValueError(
            f"{text!r} is neither a recipe file nor PRESET/ARM (presets: {', '.join(PRESETS)}; "
            f"arms: {', '.join(ALL_ARMS)})"
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
    ``TriageGRPOConfig`` itself runs (``check_quant_recipe``, ``check_sampler_kwargs``, against the sampler
    ``resolve_sampler`` picks); the dataset specs; the reward names and options; the ``launch`` section. With
    ``build=True`` also constructs ``TriageGRPOConfig`` (on CPU, bf16 off: the device is not checked).
    """
    from triage import TriageConfig
    from triage.experiments.data import validate_spec
    from triage.trainers.config import check_quant_recipe, check_sampler_kwargs, did_you_mean, resolve_sampler
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
        check_quant_recipe(recipe["quant_recipe"], "quant_recipe")
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
