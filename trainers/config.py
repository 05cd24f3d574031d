"""``TriageGRPOConfig``: TRL's ``GRPOConfig`` plus the TRIAGE fields, under the same names as ``TriageConfig``.

Every ``TriageConfig`` field (``correction``, ``tau``, the per-class policies, ...) is a field here with the
same name and the same default, so a recipe YAML, ``TrlParser`` and the command line set them like any other
``GRPOConfig`` field. ``config.triage_config()`` returns the validated ``TriageConfig``.

Drop-in default: TRIAGE needs the sampler's per-token log-probs, which TRL's plain transformers generation does
not return. So with ``use_vllm=False``, no ``sampler`` and a correction other than ``"none"``, ``sampler``
resolves to ``"hf"`` (the built-in HF sampler on the learner's own weights), and ``GRPOConfig(...)`` →
``TriageGRPOConfig(...)`` with the same arguments trains. ``sampler_kwargs`` and ``quant_recipe`` are checked
here, at construction, with the same "did you mean" errors as the recipes.

Two of TRL's own switches overlap with TRIAGE, and the rule is (docs/trainer.md, "TRL's own corrections"):

* ``vllm_importance_sampling_correction`` (TRL's truncated/masked IS against vLLM log-probs; ``True`` by
  default in ``GRPOConfig``). Here it defaults to ``None`` = "decide from ``correction``": ``True`` when
  ``correction="none"`` (so ``none`` is exactly ``GRPOTrainer`` with ``GRPOConfig``'s defaults), ``False``
  otherwise (TRIAGE owns the correction). Setting it to ``True`` together with a correction other than
  ``none`` is an error: the two would correct the same mismatch twice.
* ``off_policy_mask_threshold`` (TRL's DeepSeek-V3.2 off-policy sequence mask, on current-vs-sampler
  log-probs). It is an error together with ``correction="opsm"`` (the same mask, twice: use
  ``opsm_threshold``). With any other correction it stays TRL's mask and multiplies TRIAGE's weights.
"""

from __future__ import annotations

import difflib
import inspect
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from trl import GRPOConfig

from triage import CORRECTIONS, POLICIES, TriageConfig
from triage.config import SEQ_MIS_LEVELS, TAU_SPACES

from .sampling.factory import SAMPLER_KINDS, sampler_classes

LEARNER_PRECISIONS = ("bf16", "nvfp4")
# sampler_kwargs the HF sampler alone takes: precision / quant_recipe on top of HFSampler's own arguments
# (grpo_trainer.resolve_sampler_kwargs turns them into a sampler copy), kv_cache_dtype, activation_scale and
# fused_weight_scale (HFSampler arguments: the KV-cache format, calibrated static NVFP4 activation scales, the
# weight scale shared by fused q/k/v and gate/up shards)
SAMPLER_NUMERICS_KEYS = (
    "precision",
    "quant_recipe",
    "kv_cache_dtype",
    "activation_scale",
    "fused_weight_scale",
)

_D = TriageConfig()  # the single source of the TRIAGE defaults


def _help(text: str, choices: tuple[str, ...] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"help": text}
    if choices is not None:
        meta["choices"] = list(choices)
    return meta


def did_you_mean(key: str, known: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the closest of ``known`` (difflib), or ``""``."""
    close = difflib.get_close_matches(key, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _first_unknown(value: Mapping, known: Iterable[str]) -> str | None:
    """``"'key' (did you mean 'x'?)"`` for the first key of ``value`` not in ``known``; ``None`` if all are."""
    known = list(known)
    unknown = [k for k in value if k not in known]
    return f"{unknown[0]!r}{did_you_mean(str(unknown[0]), known)}" if unknown else None


def resolve_sampler(sampler: str | None, use_vllm: bool, correction: str) -> str | None:
    """The sampler source a config uses: ``sampler`` when set; otherwise ``"hf"`` (the built-in HF sampler, on
    the learner's own weights) when TRL's own generation could not give the sampler log-probs the correction
    needs (``use_vllm`` off, ``correction != "none"``); otherwise ``None`` (TRL's own generation: vLLM, or
    plain transformers generation for ``correction="none"``, exactly ``GRPOTrainer``)."""
    if sampler is None and not use_vllm and correction != "none":
        return "hf"
    return sampler


def quant_recipe_from(value: Any, where: str = "quant_recipe"):
    """The ``QuantRecipe`` a recipe or config value gives: None → None (the layers' defaults), a
    ``QuantRecipe`` as is, a mapping of its fields (a recipe's ``quant_recipe``, a JSON field parsed) → the
    recipe; else a ``ValueError`` naming ``where`` and the bad field (with a close-match hint for a typo)."""
    from triage.kernels.nvfp4.recipe import QuantRecipe

    if value is None or isinstance(value, QuantRecipe):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be a mapping of QuantRecipe fields, got {value!r}")
    names = sorted(inspect.signature(QuantRecipe).parameters)
    bad = _first_unknown(value, names)
    if bad:
        raise ValueError(f"{where}: unknown QuantRecipe field {bad}; fields: {names}")
    try:
        return QuantRecipe(**value)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from None


def check_sampler_kwargs(kind: str | None, kwargs: Mapping | None, where: str = "sampler_kwargs") -> None:
    """``kwargs`` suit ``make_sampler(kind, **kwargs)``: every key is an argument of the sampler class (plus
    :data:`SAMPLER_NUMERICS_KEYS` for ``"hf"``; a typo gets a close-match hint), the class's required
    arguments are there, and the HF numerics keys have valid values. ``ValueError`` naming the key otherwise.
    An engine's numerics are set on its server: the numerics keys are refused for every other sampler."""
    kwargs = kwargs or {}
    if kind is None:
        if kwargs:
            raise ValueError(
                f"{where} is set but sampler is None (TRL's own generation takes no sampler_kwargs)"
            )
        return
    if kind not in SAMPLER_KINDS:
        raise ValueError(f"sampler={kind!r}: expected None or one of {SAMPLER_KINDS}")
    from .sampling.kvcache import KV_CACHE_DTYPES

    if kind != "hf":
        numerics = [k for k in SAMPLER_NUMERICS_KEYS if k in kwargs]
        if numerics:
            raise ValueError(
                f"{where}.{numerics[0]} applies to sampler 'hf' only, got sampler {kind!r} (an engine's "
                "numerics are set on its server, e.g. launch.vllm_serve)"
            )
    params = {
        name: p
        for name, p in inspect.signature(sampler_classes()[kind]).parameters.items()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }
    names = sorted({*params, *(SAMPLER_NUMERICS_KEYS if kind == "hf" else ())})
    bad = _first_unknown(kwargs, names)
    if bad:
        raise ValueError(f"{where}: unknown key for sampler {kind!r}: {bad}; keys: {names}")
    missing = [name for name, p in params.items() if p.default is p.empty and name not in kwargs]
    if missing:
        raise ValueError(f"{where}: sampler {kind!r} needs the key {missing[0]!r}")
    if kwargs.get("precision") not in (None, "bf16", "nvfp4"):
        raise ValueError(f"{where}.precision must be 'bf16' or 'nvfp4', got {kwargs['precision']!r}")
    if kwargs.get("quant_recipe") is not None:  # null: no recipe (the key as if absent)
        if kwargs.get("precision") != "nvfp4":
            raise ValueError(f"{where}.quant_recipe needs {where}.precision: nvfp4")
        quant_recipe_from(kwargs["quant_recipe"], f"{where}.quant_recipe")
    if kwargs.get("kv_cache_dtype") not in (None, *KV_CACHE_DTYPES):  # what the HF sampler emulates
        raise ValueError(
            f"{where}.kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kwargs['kv_cache_dtype']!r}"
        )
    from .sampling.hf import ACTIVATION_SCALES, FUSED_WEIGHT_SCALES

    for key, allowed, static, what in (
        ("activation_scale", ACTIVATION_SCALES, "calibrated", ("calibrated activation", "max|x|", "H·x")),
        ("fused_weight_scale", FUSED_WEIGHT_SCALES, "shared", ("fused-group weight", "max|W|", "H·W")),
    ):
        _check_static_scale(kwargs, where, key, allowed, static, *what)


def _check_static_scale(
    kwargs: Mapping, where: str, key: str, allowed: tuple, static: str, amax: str, measures: str, rotated: str
) -> None:
    """``<key>: <static>`` (``activation_scale: calibrated``, ``fused_weight_scale: shared``) makes the sampler
    replace the dynamic per-tensor amax of an NVFP4 copy's ``quant_recipe`` (its activation and weight recipe)
    by a static one (the ``amax`` kind, ``measures`` what it measures): it needs ``precision: nvfp4`` and a
    recipe with one dynamic outer scale per tensor and no Hadamard rotation; ``ValueError`` naming the field
    otherwise."""
    value = kwargs.get(key)
    if value not in (None, *allowed):
        raise ValueError(f"{where}.{key} must be one of {allowed}, got {value!r}")
    if value != static:
        return
    if kwargs.get("precision") != "nvfp4":
        raise ValueError(
            f"{where}.{key}: {static} needs {where}.precision: nvfp4 (static {amax} scales of an NVFP4 sampler "
            f"copy), got precision {kwargs.get('precision')!r}"
        )
    recipe = kwargs.get("quant_recipe") or {}
    get = recipe.get if isinstance(recipe, Mapping) else lambda k, d=None: getattr(recipe, k, d)
    if get("scale", "tensor") != "tensor":
        raise ValueError(
            f"{where}.{key}: {static} needs {where}.quant_recipe.scale: tensor (a {amax} amax replaces the "
            f"per-tensor one), got scale {get('scale')!r}"
        )
    if get("scale_source", "dynamic") != "dynamic":
        raise ValueError(
            f"{where}.{key}: {static} needs {where}.quant_recipe.scale_source: dynamic (the sampler sets the "
            f"static amax), got scale_source {get('scale_source')!r}"
        )
    if get("hadamard", False):
        raise ValueError(
            f"{where}.{key}: {static} needs {where}.quant_recipe.hadamard: false (the {amax} amax is "
            f"{measures}, a Hadamard recipe scales the rotated {rotated})"
        )


def _parse_json_field(config: Any, name: str) -> None:
    """Parse ``config.<name>`` in place when it is a string (a mapping passed as JSON on the command line)."""
    value = getattr(config, name)
    if isinstance(value, str):
        try:
            setattr(config, name, json.loads(value))
        except json.JSONDecodeError as err:
            raise ValueError(f"TriageGRPOConfig.{name} is not valid JSON: {err}") from None


@dataclass
class TriageGRPOConfig(GRPOConfig):
    r"""``GRPOConfig`` + TRIAGE. Field docs: ``TriageConfig`` (the math) and docs/trainer.md (the table).

    TRIAGE fields (same names and defaults as ``triage.TriageConfig``):
        correction, tau, tau_space, consistent, amplify_down, correct_up, amplify_up, correct_down, is_cap, soft_rate,
        tail_floor, guard_kappa, tau_init, tau_multiplier, tau_floor, tau_ema, veto_floor, icepop_low,
        icepop_high, seq_mis_low, seq_mis_high, seq_mis_level, opsm_threshold.

    Trainer fields:
        learner_precision: ``"bf16"`` (the model as loaded) or ``"nvfp4"`` (Linear layers and fused MoE experts
            converted with ``triage.kernels.convert(model, NVFP4Config.from_recipe(quant_recipe))``).
        quant_recipe: the learner's ``QuantRecipe`` fields as a mapping (JSON string on the CLI): the activation
            and weight recipe of every NVFP4 layer; ``None``: the Transformer Engine defaults of
            ``NVFP4LinearConfig`` / ``NVFP4MoEConfig``. ``"nvfp4"`` only.
        lora_base_mode: with ``peft_config`` and ``"nvfp4"``, the frozen base's ``NVFP4FrozenConfig.compute``
            (``"w4a4"``, activations quantized with ``quant_recipe`` too, or ``"w4a16"``):
            ``NVFP4Config.from_recipe(quant_recipe, frozen=lora_base_mode)``.
        sampler: where completions and sampler log-probs come from when no ``rollout_func`` is passed — a
            ``triage.trainers.sampling`` source: ``"hf"``, ``"sglang"``, ``"vllm-server"``, ``"offline"``; or
            ``None``, resolved at construction by :func:`resolve_sampler`: ``"hf"`` (the built-in sampler on
            the learner's own weights) with ``use_vllm=False`` and a correction, TRL's own generation with
            ``use_vllm=True`` or ``correction="none"``.
        sampler_kwargs: keyword arguments for ``make_sampler(sampler, **sampler_kwargs)`` (dict or JSON),
            checked against the sampler class's signature at construction (:func:`check_sampler_kwargs`).
        log_mismatch_metrics: log the ``triage/...`` metrics whenever sampler log-probs exist (also with
            ``correction="none"``, where they do not change the loss). Off: no δ is computed at all.
    """

    # --- TRIAGE (mirrors triage.TriageConfig) -------------------------------------------------------------
    correction: str = field(
        default=_D.correction, metadata=_help("mismatch correction (TRIAGE or a baseline)", CORRECTIONS)
    )
    tau: str = field(
        default=_D.tau,
        metadata=_help("tolerance band |δ| ≤ τ in nats, or 'auto' (adaptive, from the running median |δ|)"),
    )
    tau_space: str = field(
        default=_D.tau_space,
        metadata=_help(
            "where the band is measured: 'log' (|δ| ≤ τ, nats) or 'prob' (|p_learner − p_sampler| ≤ τ)",
            TAU_SPACES,
        ),
    )
    consistent: str = field(default=_D.consistent, metadata=_help("policy for |δ| ≤ τ", POLICIES))
    amplify_down: str = field(default=_D.amplify_down, metadata=_help("policy for δ < −τ, A < 0", POLICIES))
    correct_up: str = field(default=_D.correct_up, metadata=_help("policy for δ < −τ, A > 0", POLICIES))
    amplify_up: str = field(default=_D.amplify_up, metadata=_help("policy for δ > τ, A > 0", POLICIES))
    correct_down: str = field(default=_D.correct_down, metadata=_help("policy for δ > τ, A < 0", POLICIES))
    is_cap: float = field(default=_D.is_cap, metadata=_help("C in the 'is' policy / tis: w = min(e^δ, C)"))
    soft_rate: float = field(default=_D.soft_rate, metadata=_help("λ in 'soft': w = exp(−λ(|δ| − τ))"))
    # ``float | str | None``: the command line passes strings, so ``--tail_floor null`` can switch it off
    tail_floor: float | str | None = field(
        default=_D.tail_floor,
        metadata=_help("amplify-down tokens with δ < −tail_floor get w = 0 (null: off)"),
    )
    guard_kappa: float | str | None = field(
        default=_D.guard_kappa,
        metadata=_help("sequence guard κ on the negative-tail mass of A < 0 responses (null: off)"),
    )
    tau_init: float = field(default=_D.tau_init, metadata=_help("initial τ when tau='auto'"))
    tau_multiplier: float = field(default=_D.tau_multiplier, metadata=_help("τ = m · EMA(median |δ|)"))
    tau_floor: float = field(default=_D.tau_floor, metadata=_help("lower bound of the adaptive τ"))
    tau_ema: float = field(default=_D.tau_ema, metadata=_help("EMA factor β of the adaptive τ"))
    veto_floor: float = field(
        default=_D.veto_floor, metadata=_help("veto: drop a response with any e^δ < floor")
    )
    icepop_low: float = field(default=_D.icepop_low, metadata=_help("icepop: keep tokens with e^δ ≥ low"))
    icepop_high: float = field(default=_D.icepop_high, metadata=_help("icepop: keep tokens with e^δ ≤ high"))
    seq_mis_low: float = field(default=_D.seq_mis_low, metadata=_help("seq-mis: keep responses with ρ ≥ low"))
    seq_mis_high: float = field(
        default=_D.seq_mis_high, metadata=_help("seq-mis: keep responses with ρ ≤ high")
    )
    seq_mis_level: str = field(
        default=_D.seq_mis_level, metadata=_help("seq-mis ratio: Π e^δ or exp(mean δ)", SEQ_MIS_LEVELS)
    )
    opsm_threshold: float = field(
        default=_D.opsm_threshold, metadata=_help("opsm: drop A < 0 responses with mean δ < −threshold")
    )

    # --- trainer-side ------------------------------------------------------------------------------------
    learner_precision: str = field(
        default="bf16", metadata=_help("learner numerics: the model as loaded, or NVFP4", LEARNER_PRECISIONS)
    )
    quant_recipe: dict | str | None = field(
        default=None,
        metadata=_help(
            "learner NVFP4 recipe: QuantRecipe fields (mapping, or JSON on the CLI); None: TE defaults"
        ),
    )
    lora_base_mode: str = field(
        default="w4a4",
        metadata=_help(
            "LoRA on NVFP4 (peft_config + learner_precision nvfp4): frozen base numerics", ("w4a4", "w4a16")
        ),
    )
    aqn: dict | str | None = field(
        default=None,
        metadata=_help(
            "adaptive quantization noise (QeRL): AQNConfig fields as a mapping (JSON on the CLI); None: off"
        ),
    )
    sampler: str | None = field(
        default=None,
        metadata=_help(
            "sampler source when no rollout_func is given (None: 'hf' with use_vllm off and a correction, "
            "else TRL's own generation)"
        ),
    )
    sampler_kwargs: dict | str | None = field(
        default=None, metadata=_help("keyword arguments of make_sampler (dict, or a JSON string on the CLI)")
    )
    log_mismatch_metrics: bool = field(
        default=True, metadata=_help("log triage/... metrics whenever sampler log-probs exist")
    )

    # --- TRL fields whose meaning TRIAGE changes (see module docstring) -----------------------------------
    vllm_importance_sampling_correction: bool | None = field(
        default=None,
        metadata=_help(
            "TRL's vLLM IS correction. None: on for correction='none' (GRPOTrainer's default), off otherwise; "
            "True with another correction is an error (double correction)"
        ),
    )

    def __post_init__(self):
        if isinstance(self.tau, str) and self.tau != "auto":
            try:
                self.tau = float(self.tau)
            except ValueError:
                raise ValueError(
                    f"TriageGRPOConfig.tau={self.tau!r}: expected a float ≥ 0 (nats) or 'auto'"
                ) from None
        for name in ("tail_floor", "guard_kappa"):  # strings from the command line (or YAML's 5e-2)
            value = getattr(self, name)
            if isinstance(value, str):
                if value.strip().lower() in ("none", "null", "off"):
                    setattr(self, name, None)
                else:
                    try:
                        setattr(self, name, float(value))
                    except ValueError:
                        raise ValueError(
                            f"TriageGRPOConfig.{name}={value!r}: expected a number or null (off)"
                        ) from None
        self.triage_config()  # validates every TRIAGE field, naming the offending one

        if self.vllm_importance_sampling_correction is None:
            self.vllm_importance_sampling_correction = self.correction == "none"
        elif self.vllm_importance_sampling_correction and self.correction != "none":
            raise ValueError(
                f"vllm_importance_sampling_correction=True with correction={self.correction!r} would correct the "
                "engine mismatch twice (TRL's IS ratio and TRIAGE's weights). TRIAGE owns the correction: drop "
                "vllm_importance_sampling_correction, or use correction='none' to get TRL's behaviour."
            )
        if self.off_policy_mask_threshold is not None and self.correction == "opsm":
            raise ValueError(
                "off_policy_mask_threshold (TRL's OPSM) together with correction='opsm' applies the same "
                "off-policy sequence mask twice: set opsm_threshold and leave off_policy_mask_threshold unset."
            )
        if self.learner_precision not in LEARNER_PRECISIONS:
            raise ValueError(
                f"TriageGRPOConfig.learner_precision={self.learner_precision!r}: expected one of {LEARNER_PRECISIONS}"
            )
        _parse_json_field(self, "quant_recipe")
        if self.lora_base_mode not in ("w4a4", "w4a16"):
            raise ValueError(
                f"TriageGRPOConfig.lora_base_mode={self.lora_base_mode!r}: expected 'w4a4' or 'w4a16'"
            )
        _parse_json_field(self, "aqn")
        if self.aqn is not None and not isinstance(self.aqn, dict):
            raise ValueError(f"TriageGRPOConfig.aqn must be a mapping of AQNConfig fields, got {self.aqn!r}")
        if self.learner_precision == "bf16" and self.quant_recipe is not None:
            raise ValueError("quant_recipe is only used with learner_precision='nvfp4'")
        if self.quant_recipe is not None:
            quant_recipe_from(self.quant_recipe, "TriageGRPOConfig.quant_recipe")
        self.sampler = resolve_sampler(self.sampler, self.use_vllm, self.correction)
        _parse_json_field(self, "sampler_kwargs")
        if self.sampler_kwargs is not None and not isinstance(self.sampler_kwargs, dict):
            raise ValueError(
                f"TriageGRPOConfig.sampler_kwargs must be a mapping, got {self.sampler_kwargs!r}"
            )
        check_sampler_kwargs(self.sampler, self.sampler_kwargs, "TriageGRPOConfig.sampler_kwargs")
        super().__post_init__()

    def triage_config(self) -> TriageConfig:
        """The validated ``TriageConfig`` these fields describe (a fresh copy)."""
        return TriageConfig.from_dict({name: getattr(self, name) for name in TriageConfig.field_names()})
