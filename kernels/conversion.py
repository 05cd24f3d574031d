"""One entry point for the NVFP4 layers: ``convert(model, NVFP4Config)`` and its inverse ``unconvert(model)``.

As torchao's ``quantize_(model, config)``: one config says what each kind of module becomes, one call swaps
the modules in place (``nn.Module.set_submodule``) and returns the model, so that it can serve as a
sampler's ``prepare_model``. A module whose qualified name matches one of ``NVFP4Config.skip`` (fnmatch,
default :data:`~triage.kernels.skip.DEFAULT_SKIP`, the list the checkpoint export keeps too) is left as it
is. Per-layer configs (``convert(model, config, layers={name: NVFP4Config})``): the module ``name`` is
converted by its own config instead of ``config`` (its table row and its ``skip``), e.g. a calibrated static
activation scale per layer, or a subset of layers with ``config`` converting nothing
(``NVFP4Config(linear=None, moe=None)``).

=====================  =======================================================  ============================
module                 ``convert``                                              ``unconvert``
=====================  =======================================================  ============================
``nn.Linear``          ``linear`` set: :class:`~triage.kernels.NVFP4Linear`     —
                       (shares W and b); ``linear`` and ``frozen`` set:
                       :class:`~triage.kernels.FrozenNVFP4Linear` (W quantized
                       once with ``linear.weight``, no master kept)
``NVFP4Linear``        ``frozen`` set: ``FrozenNVFP4Linear`` holding the W_q    ``nn.Linear`` (same W and b)
                       its forward used
fused MoE experts      ``moe`` set: :class:`~triage.kernels.NVFP4MoeExperts`    the original experts module
(Qwen3-MoE, tf 5.x)    (same parameters)                                        (same parameters)
``FrozenNVFP4Linear``  left as it is                                            ``nn.Linear`` holding Ŵ
                                                                                (frozen: no gradient)
=====================  =======================================================  ============================

Parameters are shared, not copied, so tied weights stay tied and an optimizer built before the conversion
keeps working (except for frozen layers, which have no parameters). Every replacement is built before
the first one is installed: a layer that does not fit (its shape, a NaN weight to freeze) raises an error
naming it and leaves the model unchanged.

The converted layers of each fused group (q/k/v, gate/up of one parent) are linked
(:func:`~triage.kernels.siblings.link_siblings`): at decode sizes, grad-free, they run their GEMMs as one
launch.

Where the numerics live: the recipes (block size, scales, rounding, Hadamard: ``QuantRecipe`` in
``kernels/nvfp4/recipe.py``) are fields of the three layer configs; the layers' forward and backward are in
``kernels/linear.py`` (dense), ``kernels/moe/experts.py`` (experts) and ``kernels/frozen_linear.py``
(frozen base); the quantizers and GEMMs under ``kernels/nvfp4/`` and ``kernels/moe/``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from torch import nn

from triage.kernels.frozen_linear import FrozenNVFP4Linear, NVFP4FrozenConfig
from triage.kernels.linear import NVFP4Linear, NVFP4LinearConfig
from triage.kernels.moe.experts import NVFP4MoEConfig, NVFP4MoeExperts, is_fused_experts
from triage.kernels.nvfp4.recipe import QuantRecipe
from triage.kernels.skip import DEFAULT_SKIP, skip_patterns, skipped

__all__ = ["NVFP4Config", "convert", "unconvert"]

_LAYER_CONFIGS = (("linear", NVFP4LinearConfig), ("moe", NVFP4MoEConfig), ("frozen", NVFP4FrozenConfig))


@dataclass(frozen=True)
class NVFP4Config:
    """What :func:`convert` makes of each kind of module (module docstring: the table).

    Attributes:
        linear: the :class:`NVFP4LinearConfig` of the ``nn.Linear`` layers (default: Transformer Engine's
            recipe); None leaves ``nn.Linear`` layers alone.
        moe: the :class:`NVFP4MoEConfig` of the fused MoE experts; None leaves them alone.
        frozen: set, the linear layers become :class:`FrozenNVFP4Linear` computing with this
            :class:`NVFP4FrozenConfig` (a frozen base for LoRA): every ``NVFP4Linear``, and with ``linear``
            set every ``nn.Linear``, quantized once with ``linear.weight``. None: nothing is frozen.
        skip: fnmatch patterns on qualified module names left as they are (a pattern string or an iterable
            of them, stored as a tuple).
    """

    linear: NVFP4LinearConfig | None = field(default_factory=NVFP4LinearConfig)
    moe: NVFP4MoEConfig | None = field(default_factory=NVFP4MoEConfig)
    frozen: NVFP4FrozenConfig | None = None
    skip: tuple[str, ...] = DEFAULT_SKIP

    def __post_init__(self) -> None:
        for name, cls in _LAYER_CONFIGS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, cls):
                hint = " (NVFP4Config.from_recipe builds the configs of one recipe)"
                raise TypeError(
                    f"NVFP4Config.{name} must be an {cls.__name__} or None, got {type(value).__name__}"
                    + (hint if isinstance(value, QuantRecipe) else "")
                )
        object.__setattr__(self, "skip", skip_patterns(self.skip))

    @classmethod
    def from_recipe(cls, recipe: QuantRecipe | None = None, *, frozen: str | None = None) -> NVFP4Config:
        """The config of one ``QuantRecipe`` for activations and weights (the trainer's ``quant_recipe``).

        ``recipe``: the activation and weight recipe of the dense layers and the experts (the experts' weights
        with ``scale="expert"``: one outer scale per expert); the other fields default. None: the defaults
        (Transformer Engine's recipe). ``frozen`` (``"w4a4"`` or ``"w4a16"``): a frozen base instead
        (LoRA; ``TriageGRPOConfig.lora_base_mode``): the linear layers become ``FrozenNVFP4Linear`` with
        weights quantized with ``recipe`` (None: the default weight recipe), computing ``frozen`` with
        ``recipe`` (None: ``QuantRecipe()``) for the activations of ``"w4a4"``; the experts are left alone.
        """
        if recipe is not None and not isinstance(recipe, QuantRecipe):
            raise TypeError(f"NVFP4Config.from_recipe: recipe must be a QuantRecipe or None, got {recipe!r}")
        if recipe is None:
            linear, moe = NVFP4LinearConfig(), NVFP4MoEConfig()
        else:
            linear = NVFP4LinearConfig(activation=recipe, weight=recipe)
            moe = NVFP4MoEConfig(activation=recipe, weight=dataclasses.replace(recipe, scale="expert"))
        if frozen is None:
            return cls(linear=linear, moe=moe)
        return cls(
            linear=linear,
            moe=None,
            frozen=NVFP4FrozenConfig(compute=frozen, activation=recipe or QuantRecipe()),
        )


def convert(
    model: nn.Module, config: NVFP4Config | None = None, *, layers: Mapping[str, NVFP4Config] | None = None
) -> nn.Module:
    """Replace the modules of ``model`` (in place) by NVFP4 layers as ``config`` says (default
    ``NVFP4Config()``: dense layers and fused experts with the Transformer Engine recipe); returns ``model``.

    ``layers``: qualified module name → the ``NVFP4Config`` of that module, used for it instead of ``config``
    (the table row of its kind, its ``skip``). Every name must be a module of ``model`` of a kind in the table
    (``nn.Linear`` itself, not a subclass; an NVFP4 layer; fused MoE experts) that its own config does not
    skip and converts (or has converted: an NVFP4 layer whose config is the entry's): ``ValueError`` naming the
    entries that are not.

    Modules already converted are left as they are (converting twice changes nothing), except that
    ``frozen`` freezes ``NVFP4Linear`` layers. Raises ``ValueError`` / ``TypeError`` naming the layer or the
    ``layers`` entry that does not fit (shape, recipe, non-finite weight), before anything is replaced.
    """
    config = NVFP4Config() if config is None else config
    if not isinstance(config, NVFP4Config):
        raise TypeError(
            "convert: config must be an NVFP4Config (NVFP4Config.from_recipe(recipe) for one QuantRecipe), "
            f"got {type(config).__name__}"
        )
    modules = dict(model.named_modules())
    per_layer = _layer_configs(layers, modules)
    replacements = []
    for name, module in modules.items():
        layer_config = per_layer.get(name, config)
        if skipped(name, layer_config.skip):
            continue
        try:
            new = _replacement(module, layer_config)
        except (ValueError, TypeError) as err:
            raise type(err)(
                f"convert: layer {name!r}: {err} (NVFP4Config.skip keeps a layer as it is)"
            ) from None
        if new is None:
            continue
        if not name:
            raise ValueError(
                f"convert: the model itself is a {type(module).__name__}; convert a module that holds it"
            )
        replacements.append((name, new))
    for name, new in replacements:
        model.set_submodule(name, new)
    from triage.kernels.siblings import link_siblings

    link_siblings(model)  # q/k/v, gate/up: one decode launch per group (triage.kernels.siblings)
    return model


def _layer_configs(
    layers: Mapping[str, NVFP4Config] | None, modules: Mapping[str, nn.Module]
) -> dict[str, NVFP4Config]:
    """``layers`` as a dict, checked against the model's ``modules`` (name → module): each value an
    ``NVFP4Config``, each name a module of a kind :func:`_replacement` knows that its config does not skip."""
    if layers is None:
        return {}
    if not isinstance(layers, Mapping):
        raise TypeError(
            f"convert: layers must be a mapping of module names to NVFP4Config, got {type(layers).__name__}"
        )
    for name, value in layers.items():
        if not isinstance(value, NVFP4Config):
            raise TypeError(f"convert: layers[{name!r}] must be an NVFP4Config, got {type(value).__name__}")
    unknown = [name for name in layers if name not in modules]
    if unknown:
        raise ValueError(f"convert: layers names modules that the model does not have: {unknown[:5]}")
    other = [f"{name!r} ({type(modules[name]).__name__})" for name in layers if not _in_table(modules[name])]
    if other:
        raise ValueError(
            "convert: layers names modules that are neither Linear layers nor fused MoE experts: "
            + ", ".join(other[:5])
        )
    kept = [name for name, value in layers.items() if skipped(name, value.skip)]
    if kept:
        raise ValueError(
            f"convert: layers names modules that their own NVFP4Config.skip keeps as they are: {kept[:5]} "
            "(NVFP4Config(skip=()) converts them)"
        )
    idle = [
        f"{name!r} ({type(modules[name]).__name__})"
        for name, value in layers.items()
        if not _converts(modules[name], value) and not _converted_as(modules[name], value)
    ]
    if idle:
        raise ValueError(
            "convert: layers gives modules a config that would leave them as they are (a Linear with "
            "linear=None, fused experts with moe=None, or a layer converted with another config: unconvert "
            f"it first): {', '.join(idle[:5])}"
        )
    return dict(layers)


def _converted_as(module: nn.Module, config: NVFP4Config) -> bool:
    """Whether ``module`` is already what ``config`` makes of its kind (so converting again changes nothing)."""
    if isinstance(module, FrozenNVFP4Linear):
        return (
            config.frozen is not None
            and module.config == config.frozen
            and (config.linear is None or module.weight_recipe == config.linear.weight)
        )
    if isinstance(module, NVFP4Linear):
        return config.frozen is None and module.config == config.linear
    if isinstance(module, NVFP4MoeExperts):
        return module.config == config.moe
    return False


def _in_table(module: nn.Module) -> bool:
    """Whether ``module`` is of a kind in the table of the module docstring."""
    return (
        type(module) is nn.Linear
        or isinstance(module, (NVFP4Linear, FrozenNVFP4Linear, NVFP4MoeExperts))
        or is_fused_experts(module)
    )


def _converts(module: nn.Module, config: NVFP4Config) -> bool:
    """Whether ``config`` replaces ``module`` (a row of the table in the module docstring applies)."""
    if isinstance(module, NVFP4Linear):
        return config.frozen is not None
    if type(module) is nn.Linear:
        return config.linear is not None
    return config.moe is not None and is_fused_experts(module) and not isinstance(module, NVFP4MoeExperts)


def _replacement(module: nn.Module, config: NVFP4Config) -> nn.Module | None:
    """What ``module`` becomes under ``config``, or None (the table in the module docstring)."""
    if not _converts(module, config):
        return None
    if isinstance(module, NVFP4Linear):
        return FrozenNVFP4Linear.from_linear(module, config.frozen)
    if type(module) is nn.Linear:
        if config.frozen is None:
            return NVFP4Linear.from_linear(module, config.linear)
        return FrozenNVFP4Linear.from_linear(
            module, config.frozen, recipe=config.linear.weight, quant_backend=config.linear.quant_backend
        )
    return NVFP4MoeExperts(module, config.moe)


def unconvert(model: nn.Module, *, frozen: bool = True) -> nn.Module:
    """Inverse of :func:`convert` (whatever configs it used, per-layer ones included), in place; returns
    ``model``: every ``NVFP4Linear`` back to ``nn.Linear`` and every ``NVFP4MoeExperts`` to the experts module
    it replaced (same parameters), every ``FrozenNVFP4Linear`` to an ``nn.Linear`` holding its dequantized
    weight Ŵ (frozen).

    ``frozen=False`` leaves the ``FrozenNVFP4Linear`` layers as they are: their codes are the weights (there
    is no higher-precision form to return to), as a sampler copy wants them (shared, not dequantized)."""
    kinds = (NVFP4Linear, NVFP4MoeExperts, FrozenNVFP4Linear) if frozen else (NVFP4Linear, NVFP4MoeExperts)
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, kinds)]
    if targets and not targets[0][0]:
        method = "to_experts" if isinstance(model, NVFP4MoeExperts) else "to_linear"
        raise ValueError(f"unconvert: the model itself is an {type(model).__name__}; call its .{method}()")
    for name, m in targets:
        model.set_submodule(name, m.to_experts() if isinstance(m, NVFP4MoeExperts) else m.to_linear())
    return model
