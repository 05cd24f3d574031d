"""Export and import NVFP4 safetensors checkpoints in the ModelOpt and compressed-tensors layouts.

::

    res = export_nvfp4_checkpoint(model, "out/", layout="modelopt", input_amax={"model.layers.0...": 3.1})
    weights = load_nvfp4_checkpoint("out/")          # {"model.layers.0.self_attn.q_proj.weight": NVFP4Tensor}
    model.load_state_dict(dequantized_state_dict("out/"))

What gets quantized: every 2-D floating ``<module>.weight`` whose module name matches none of the ``skip``
fnmatch patterns (default :data:`DEFAULT_SKIP`: lm_head, embeddings, norms, MoE routers). Everything else
(norms, embeddings, biases, skipped layers) is written unchanged. Skipped 2-D weights are listed by module
name in ``exclude_modules`` / ``ignore`` so that engines load them unquantized.

Shared outer scale of fused shards (``share_fused_scales=True``): vLLM loads q/k/v into one ``qkv_proj``
and gate/up into one ``gate_up_proj`` with ONE outer scale; it takes ``.max()`` over the shards' stored
scales (decode ``weight_scale_2`` for ModelOpt, encode ``weight_global_scale`` for compressed-tensors) and
warns if they differ (research note §3.3, §4 pitfall 12). So every shard of a group is quantized with the
shared amax ``A = max(A_q, A_k, A_v)`` (``QuantRecipe(scale_source="static", static_amax=A)``) and stores the
same outer scale; the bytes on disk are exactly what the engine computes with. Calibrated activation amaxes
of a fused group are unified the same way (max). With ``share_fused_scales=False`` each shard keeps its own
amax: the checkpoint still loads, but vLLM then applies one shard's scale to all (the max decode scale for
ModelOpt -> the other shards dequantize too large; the max ENCODE scale for compressed-tensors -> the
shards with larger amax dequantize too small), i.e. the engine's weights differ from the exported ones.

Exactness: ``load_nvfp4_checkpoint`` returns tensors whose ``data``/``scale`` bytes and decode multiplier
equal the exported in-memory quantization (for compressed-tensors the decode multiplier is
``RN(1/weight_global_scale)``, which is how the te and compressed-tensors profiles define it).
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from .api import quantize
from .checkpoint_layouts import (
    GROUP_SIZE,
    LAYOUTS,
    Layout,
    compressed_tensors_config,
    get_layout,
    modelopt_configs,
)
from .recipe import QuantRecipe
from .reference import outer_scale_from_recipe
from .tensor import NVFP4Tensor

__all__ = [
    "DEFAULT_SKIP",
    "FUSED_GROUPS",
    "ExportResult",
    "dequantized_state_dict",
    "detect_layout",
    "export_nvfp4_checkpoint",
    "load_activation_recipes",
    "load_nvfp4_checkpoint",
]

#: Module-name patterns (fnmatch) kept in high precision: output head, embeddings, norms, MoE routers.
DEFAULT_SKIP = (
    "lm_head",
    "*.lm_head",
    "*embed*",  # embed_tokens, embed_in (GPT-NeoX), embed_positions, word_embeddings
    "wte",
    "*.wte",
    "wpe",
    "*.wpe",
    "*norm*",
    "*.mlp.gate",
    "*block_sparse_moe.gate",
    "*router*",
    "*shared_expert_gate",
)
#: Sibling modules the engines fuse into one GEMM with one outer scale (vLLM ``packed_modules_mapping``):
#: q/k/v, gate/up, MLA's q_a/kv_a (DeepSeek-V2/V3), Mixtral-style expert w1/w3.
FUSED_GROUPS = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("q_a_proj", "kv_a_proj_with_mqa"),
    ("w1", "w3"),
)
#: Model types whose transformers-5 fused experts (``experts.gate_up_proj``) unfuse to the checkpoint names
#: written here (``experts.{e}.gate_proj/up_proj/down_proj``); other models rename their experts on load.
UNFUSE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe")
HF_QUANT_CONFIG = "hf_quant_config.json"
CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)


@dataclass
class ExportResult:
    """What :func:`export_nvfp4_checkpoint` wrote.

    Attributes:
        path: the checkpoint directory.
        layout: ``"modelopt"`` or ``"compressed-tensors"``.
        weights: ``"<module>.weight"`` -> the NVFP4Tensor whose bytes were written.
        input_scales: ``"<module>"`` -> the stored activation outer scale (layout convention), if calibrated.
        excluded: module names written unquantized (the config's exclude/ignore list).
        files: safetensors files written.
    """

    path: Path
    layout: str
    weights: dict[str, NVFP4Tensor]
    input_scales: dict[str, float]
    excluded: list[str]
    files: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------- export


def export_nvfp4_checkpoint(
    model_or_state_dict,
    out_dir,
    layout: str = "modelopt",
    recipe: QuantRecipe | None = None,
    skip=DEFAULT_SKIP,
    input_amax: Mapping[str, float] | None = None,
    *,
    share_fused_scales: bool = True,
    fused_groups=FUSED_GROUPS,
    config=None,
    tokenizer=None,
    backend: str = "auto",
    max_shard_bytes: int = 5 * 2**30,
) -> ExportResult:
    """Quantize the Linear weights of a model (or a state dict) to NVFP4 and write a safetensors checkpoint.

    Args:
        model_or_state_dict: an ``nn.Module`` (a HF model: its ``config`` is written and tokenizer files
            next to ``model.name_or_path`` are copied) or a ``{name: tensor}`` state dict.
        out_dir: directory to write (created).
        layout: ``"modelopt"`` or ``"compressed-tensors"`` (see ``checkpoint_layouts.py``).
        recipe: weight quantizer; default ``QuantRecipe(profile=layout's producer)``. Needs
            ``scale="tensor"``, ``scale_source="dynamic"``, no Hadamard; compressed-tensors (encode scales)
            also needs profile ``te`` or ``compressed-tensors``. ``block="16x16"`` is allowed (its scales are
            stored per 1x16 row, which engines read as ordinary NVFP4).
        skip: fnmatch patterns on module names to keep high precision (:data:`DEFAULT_SKIP`).
        input_amax: ``{module name: calibrated activation amax}`` for W4A4 checkpoints (``input_scale`` /
            ``input_global_scale``; every quantized module needs one). None: weight-only (W4A16) config.
        share_fused_scales: one outer scale per fused group (see the module docstring).
        fused_groups: tuples of sibling module names sharing a scale (:data:`FUSED_GROUPS`).
        config: for a state dict, the model config (``PretrainedConfig`` or dict) to write as config.json.
        tokenizer: saved into ``out_dir`` if given.
        backend: quantize backend (``"auto"``: Triton on CUDA, torch reference otherwise).
        max_shard_bytes: split the safetensors into shards of at most this size (+ index json).
    """
    lay = get_layout(layout)
    recipe = _check_recipe(recipe or QuantRecipe(profile=lay.profile), lay)
    raw = _state_dict(model_or_state_dict)
    _check_fused_experts(model_or_state_dict, raw, skip)
    state = _unfuse_experts(raw)
    if isinstance(model_or_state_dict, torch.nn.Module):  # embeddings stay high precision whatever their name
        embeddings = [n for n, m in model_or_state_dict.named_modules() if isinstance(m, torch.nn.Embedding)]
        skip = (*((skip,) if isinstance(skip, str) else tuple(skip)), *embeddings)
    targets, excluded = _plan(state, skip)
    groups = _fused_groups(targets, excluded, fused_groups) if share_fused_scales else {}
    amax = {m: _weight_amax(m, state[f"{m}.weight"], recipe) for m in targets}
    shared = _shared(amax, groups)

    weights: dict[str, NVFP4Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for m in targets:
        r = (
            recipe
            if float(shared[m]) == 0.0
            else replace(recipe, scale_source="static", static_amax=shared[m])
        )
        t = quantize(state[f"{m}.weight"], r, backend=backend)
        weights[f"{m}.weight"] = t
        out[f"{m}.{lay.weight}"] = t.data.cpu().contiguous()
        out[f"{m}.{lay.weight_scale}"] = t.scale.cpu().contiguous()
        stored = t.global_encode_scale if lay.stores_encode else t.global_scale
        out[f"{m}.{lay.weight_global}"] = stored.float().cpu().reshape(lay.global_shape).clone()

    input_scales = {}
    if input_amax is not None:
        input_scales = _input_scales(input_amax, targets, groups, lay)
        for m, v in input_scales.items():
            out[f"{m}.{lay.input_global}"] = torch.tensor(v, dtype=torch.float32).reshape(lay.global_shape)

    quantized = {f"{m}.weight" for m in targets}
    seen: set[int] = set()
    for name, t in state.items():
        if name in quantized:
            continue
        t = t.detach().cpu()
        ptr = t.untyped_storage().data_ptr()
        out[name] = (
            t.clone() if ptr in seen or not t.is_contiguous() else t
        )  # safetensors refuses shared memory
        seen.add(ptr)

    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    files = _save_sharded(out, path, max_shard_bytes)
    dtype = state[f"{targets[0]}.weight"].dtype if targets else None
    _write_configs(path, lay, model_or_state_dict, config, excluded, input_amax is None, dtype)
    _copy_tokenizer(path, model_or_state_dict, tokenizer)
    return ExportResult(path, lay.name, weights, input_scales, excluded, files)


def _check_recipe(recipe: QuantRecipe, lay: Layout) -> QuantRecipe:
    if not isinstance(recipe, QuantRecipe):
        raise TypeError(f"recipe must be a QuantRecipe, got {type(recipe).__name__}")
    if recipe.scale != "tensor" or recipe.scale_source != "dynamic":
        raise ValueError(
            "export_nvfp4_checkpoint: checkpoints store one outer scale per tensor computed from the weight; "
            f"recipe needs scale='tensor', scale_source='dynamic' (got scale={recipe.scale!r}, "
            f"scale_source={recipe.scale_source!r})"
        )
    if recipe.hadamard:
        raise ValueError(
            "export_nvfp4_checkpoint: engines do not undo a Hadamard rotation; use hadamard=False"
        )
    if recipe.profile not in lay.profiles:
        raise ValueError(
            f"export_nvfp4_checkpoint: layout {lay.name!r} stores the ENCODE scale 2688/amax, from which only "
            f"profiles {lay.profiles} recover their decode multiplier exactly; profile {recipe.profile!r} "
            "derives encode from decode (use layout='modelopt')"
        )
    return recipe


def _state_dict(obj) -> dict[str, torch.Tensor]:
    if isinstance(obj, torch.nn.Module):
        return dict(obj.state_dict())
    if isinstance(obj, Mapping):
        bad = [k for k, v in obj.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise TypeError(f"export_nvfp4_checkpoint: state dict entry {bad[0]!r} is not a tensor")
        return dict(obj)
    raise TypeError(
        f"export_nvfp4_checkpoint: expected an nn.Module or a state dict, got {type(obj).__name__}"
    )


def _check_fused_experts(obj, state: dict[str, torch.Tensor], skip) -> None:
    """Refuse fused experts of a model type whose checkpoint names differ from the ones written here."""
    config = getattr(obj, "config", None)
    model_type = getattr(config, "model_type", None)
    skip = (skip,) if isinstance(skip, str) else tuple(skip)
    fused = any(
        k.endswith(".experts.gate_up_proj") and t.dim() == 3 and not _skipped(k.rpartition(".")[0], skip)
        for k, t in state.items()
    )
    if fused and model_type is not None and model_type not in UNFUSE_MODEL_TYPES:
        raise ValueError(
            f"export_nvfp4_checkpoint: {model_type!r} stores fused experts that its checkpoints name differently "
            f"(known: {UNFUSE_MODEL_TYPES}); pass a state dict with the checkpoint's own expert names, or skip "
            "the experts (skip=(..., '*experts*'))"
        )


def _unfuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers-5 fused MoE experts -> the per-expert Linear weights checkpoints and engines use:
    ``<p>.experts.gate_up_proj`` [E, 2I, H] (gate rows first, as Qwen3-MoE's forward ``chunk(2)`` reads them)
    -> ``<p>.experts.{e}.gate_proj.weight`` = ``[e, :I]`` and ``up_proj`` = ``[e, I:]``;
    ``<p>.experts.down_proj`` [E, H, I] -> ``<p>.experts.{e}.down_proj.weight``."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        prefix, _, leaf = name.rpartition(".")
        if not (prefix.endswith("experts") and leaf in ("gate_up_proj", "down_proj") and t.dim() == 3):
            out[name] = t
            continue
        down = state.get(f"{prefix}.down_proj")
        if leaf == "gate_up_proj" and (
            down is None or down.dim() != 3 or t.shape[1] != 2 * down.shape[2] or t.shape[2] != down.shape[1]
        ):
            raise ValueError(
                f"export_nvfp4_checkpoint: {name!r} {tuple(t.shape)} is not [E, 2I, H] next to a down_proj "
                "[E, H, I]; this fused-expert layout is not supported (add it to skip=)"
            )
        half = t.shape[1] // 2
        for e in range(t.shape[0]):
            if leaf == "gate_up_proj":
                out[f"{prefix}.{e}.gate_proj.weight"] = t[e, :half]
                out[f"{prefix}.{e}.up_proj.weight"] = t[e, half:]
            else:
                out[f"{prefix}.{e}.down_proj.weight"] = t[e]
    return out


def _fuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`_unfuse_experts` (per-expert weights -> stacked ``gate_up_proj`` / ``down_proj``)."""
    pattern = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        m = pattern.match(name)
        if m is None:
            out[name] = t
            continue
        experts.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = t
    for prefix, per in experts.items():
        n = len(per)
        for e in range(n):
            missing = {"gate_proj", "up_proj", "down_proj"} - set(per.get(e, {}))
            if missing:
                raise KeyError(
                    f"NVFP4 checkpoint: expert {prefix}.{e} lacks {sorted(missing)} (experts 0..{n - 1})"
                )
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat((per[e]["gate_proj"], per[e]["up_proj"])) for e in range(n)]
        )
        out[f"{prefix}.down_proj"] = torch.stack([per[e]["down_proj"] for e in range(n)])
    return out


def _skipped(module: str, skip) -> bool:
    return any(fnmatch.fnmatchcase(module, p) for p in skip)


def _plan(state: dict[str, torch.Tensor], skip) -> tuple[list[str], list[str]]:
    """(modules to quantize, 2-D weights kept high precision) in state-dict order."""
    if isinstance(skip, str):
        skip = (skip,)
    targets, excluded = [], []
    for name, t in state.items():
        if not t.is_floating_point():
            continue
        module = name.rpartition(".")[0]
        if t.dim() == 2 and name.endswith(".weight"):
            (excluded if _skipped(module, skip) else targets).append(module)
        elif t.dim() > 2 and not _skipped(module, skip):
            raise ValueError(
                f"export_nvfp4_checkpoint: tensor {name!r} has {t.dim()} dims {tuple(t.shape)}; only 2-D Linear "
                "weights (and transformers' fused experts gate_up_proj/down_proj) are exported: add it to skip="
            )
    return targets, excluded


def _fused_groups(targets: list[str], excluded: list[str], fused_groups) -> dict[str, tuple[str, ...]]:
    """module -> the members of its fused group that exist. Mixed quantized/skipped groups are an error
    (vLLM refuses a fused layer whose shards are not all quantized or all excluded)."""
    present = set(targets)
    skipped = set(excluded)
    groups: dict[str, tuple[str, ...]] = {}
    for m in targets:
        parent, _, leaf = m.rpartition(".")
        for names in fused_groups:
            if leaf not in names:
                continue
            members = tuple(f"{parent}.{n}" if parent else n for n in names)
            mixed = [x for x in members if x in skipped]
            if mixed:
                raise ValueError(
                    f"export_nvfp4_checkpoint: fused group {members} has {mixed} skipped but {m!r} quantized; "
                    "engines load the group as one layer, so skip all of it or none"
                )
            groups[m] = tuple(x for x in members if x in present)
    return groups


def _weight_amax(module: str, w: torch.Tensor, recipe: QuantRecipe) -> float:
    name = f"{module}.weight"
    k = w.shape[-1]
    if k % GROUP_SIZE:
        raise ValueError(
            f"export_nvfp4_checkpoint: {name!r} has K={k} input features, not a multiple of {GROUP_SIZE}; "
            f"engines need K % {GROUP_SIZE} == 0 (recipe.pad={recipe.pad} cannot help: the padded bytes would "
            "not match the model's shape); add the module to skip="
        )
    if w.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"export_nvfp4_checkpoint: {name!r} has dtype {w.dtype}; expected fp16, bf16 or fp32")
    a = w.detach().abs().amax().float()
    if not torch.isfinite(a):
        raise ValueError(f"export_nvfp4_checkpoint: {name!r} contains NaN or Inf; refusing to export it")
    return float(a)


def _shared(amax: dict[str, float], groups: dict[str, tuple[str, ...]]) -> dict[str, float]:
    return {m: max(amax[x] for x in groups.get(m, (m,))) for m in amax}


def _input_scales(input_amax, targets, groups, lay: Layout) -> dict[str, float]:
    if not isinstance(input_amax, Mapping):
        raise TypeError(f"input_amax must be a dict {{module: amax}}, got {type(input_amax).__name__}")
    unknown = sorted(set(input_amax) - set(targets))
    if unknown:
        raise ValueError(f"input_amax has entries for modules that are not quantized: {unknown[:5]}")
    missing = [m for m in targets if m not in input_amax]
    if missing:
        raise ValueError(
            f"input_amax is missing {len(missing)} quantized module(s), e.g. {missing[:3]}: a W4A4 checkpoint "
            "needs a calibrated activation amax for every quantized Linear (or pass input_amax=None: W4A16)"
        )
    amax = {}
    for m in targets:
        v = input_amax[m]
        try:
            v = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"input_amax[{m!r}] must be a number, got {v!r}") from None
        if not (v > 0 and v < float("inf")):
            raise ValueError(f"input_amax[{m!r}] must be finite and > 0, got {v!r}")
        amax[m] = v
    shared = _shared(amax, groups)
    scales = {}
    for m in targets:
        recipe = QuantRecipe(profile=lay.profile, scale_source="static", static_amax=shared[m])
        outer = outer_scale_from_recipe(recipe, "cpu")
        scales[m] = float(outer.encode if lay.stores_encode else outer.decode)
    return scales


def _save_sharded(tensors: dict[str, torch.Tensor], path: Path, max_bytes: int) -> list[str]:
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata=meta)
        return ["model.safetensors"]
    files, weight_map = [], {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata=meta)
        files.append(fname)
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / INDEX).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    return files


def _model_config_dict(obj, config) -> dict | None:
    config = config if config is not None else getattr(obj, "config", None)
    if config is None:
        return None
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise TypeError(f"config must be a PretrainedConfig or a dict, got {type(config).__name__}")


def _write_configs(path: Path, lay: Layout, obj, config, excluded, weight_only: bool, dtype) -> None:
    from triage._version import __version__

    if lay.name == "modelopt":
        hf_quant, qconfig = modelopt_configs(excluded, weight_only, f"triage-rl-{__version__}")
        (path / HF_QUANT_CONFIG).write_text(json.dumps(hf_quant, indent=2))
    else:
        qconfig = compressed_tensors_config(excluded, weight_only)
    cfg = _model_config_dict(obj, config) or {}
    if dtype is not None and cfg.get("dtype") is None and cfg.get("torch_dtype") is None:
        cfg["dtype"] = str(dtype).removeprefix("torch.")  # as save_pretrained records it; loaders read it
    cfg["quantization_config"] = qconfig
    (path / CONFIG).write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str))
    gen = getattr(obj, "generation_config", None)
    if gen is not None and hasattr(gen, "save_pretrained"):
        gen.save_pretrained(path)


def _copy_tokenizer(path: Path, obj, tokenizer) -> None:
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
        return
    src = getattr(obj, "name_or_path", None) or getattr(getattr(obj, "config", None), "_name_or_path", None)
    if not src or not Path(src).is_dir() or Path(src).resolve() == path.resolve():
        return
    for fname in TOKENIZER_FILES:
        f = Path(src) / fname
        if f.is_file() and not (path / fname).exists():
            shutil.copy2(f, path / fname)


# ----------------------------------------------------------------------------------------------- import


def _read_json(p: Path) -> dict | None:
    return json.loads(p.read_text()) if p.is_file() else None


def detect_layout(path) -> str:
    """``"modelopt"`` or ``"compressed-tensors"`` from the checkpoint's configs (config.json
    ``quantization_config``, else ``hf_quant_config.json``). Raises if neither describes NVFP4."""
    path = Path(path)
    qc = (_read_json(path / CONFIG) or {}).get("quantization_config")
    hf = _read_json(path / HF_QUANT_CONFIG)
    if qc is not None:
        method = str(qc.get("quant_method", "")).lower()
        if method.startswith("modelopt"):
            _check_modelopt_algo(
                str(qc.get("quant_algo") or (hf or {}).get("quantization", {}).get("quant_algo"))
            )
            return "modelopt"
        if method == "compressed-tensors":
            formats = {qc.get("format")} | {g.get("format") for g in qc.get("config_groups", {}).values()}
            if "nvfp4-pack-quantized" not in formats:
                raise ValueError(
                    f"{path}: compressed-tensors checkpoint is not nvfp4-pack-quantized ({formats})"
                )
            for g in qc.get("config_groups", {}).values():
                gs = (g.get("weights") or {}).get("group_size")
                if gs not in (None, GROUP_SIZE):
                    raise ValueError(f"{path}: weights group_size={gs}, NVFP4 needs {GROUP_SIZE}")
            return "compressed-tensors"
        raise ValueError(f"{path}: config.json quantization_config has quant_method={method!r}, not NVFP4")
    if hf is not None:
        _check_modelopt_algo(str(hf.get("quantization", {}).get("quant_algo")))
        gs = hf.get("quantization", {}).get("group_size", GROUP_SIZE)
        if gs != GROUP_SIZE:
            raise ValueError(f"{path}: hf_quant_config.json group_size={gs}, NVFP4 needs {GROUP_SIZE}")
        return "modelopt"
    raise ValueError(
        f"{path}: no NVFP4 quantization config found (expected config.json 'quantization_config' or "
        f"{HF_QUANT_CONFIG})"
    )


def _check_modelopt_algo(algo: str) -> None:
    if algo.upper() not in ("NVFP4", "W4A16_NVFP4"):
        raise ValueError(
            f"ModelOpt checkpoint has quant_algo={algo!r}; only NVFP4 / W4A16_NVFP4 are supported"
        )


def _weight_only(path: Path, layout: str) -> bool:
    qc = (_read_json(path / CONFIG) or {}).get("quantization_config") or {}
    if layout == "modelopt":
        algo = qc.get("quant_algo") or (_read_json(path / HF_QUANT_CONFIG) or {}).get("quantization", {}).get(
            "quant_algo"
        )
        return str(algo).upper() == "W4A16_NVFP4"
    return all(g.get("input_activations") is None for g in qc.get("config_groups", {}).values())


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = _read_json(path / INDEX)
    if index is not None:
        files = sorted(set(index["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no .safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        if not (path / f).is_file():
            raise FileNotFoundError(f"{path}: shard {f!r} listed in {INDEX} is missing")
        tensors.update(load_file(str(path / f)))
    return tensors


def _config_dtype(path: Path) -> torch.dtype:
    cfg = _read_json(path / CONFIG) or {}
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
    dtype = getattr(torch, str(name).replace("torch.", ""), None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.bfloat16


def _quantized_modules(tensors: dict[str, torch.Tensor], lay: Layout) -> list[str]:
    """Modules with any NVFP4 tensor (block scales or outer scale; for compressed-tensors also the packed
    weight). ModelOpt's packed ``weight`` alone is indistinguishable from a plain weight except by dtype."""
    suffixes = {lay.weight_scale, lay.weight_global}
    if lay.name == "compressed-tensors":
        suffixes.add(lay.weight)
    modules = []
    for name, t in tensors.items():
        module, _, suffix = name.rpartition(".")
        if suffix in suffixes or (lay.name == "modelopt" and suffix == "weight" and t.dtype == torch.uint8):
            if module not in modules:
                modules.append(module)
    return modules


def _get(tensors, name: str, dtype: torch.dtype, what: str) -> torch.Tensor:
    if name not in tensors:
        raise KeyError(f"NVFP4 checkpoint: missing tensor {name!r} ({what})")
    t = tensors[name]
    if t.dtype != dtype:
        raise ValueError(f"NVFP4 checkpoint: tensor {name!r} has dtype {t.dtype}, expected {dtype} ({what})")
    return t


def _scalar(tensors, name: str, what: str) -> float:
    t = _get(tensors, name, torch.float32, what)
    if t.numel() != 1:
        raise ValueError(
            f"NVFP4 checkpoint: {name!r} must hold one value ({what}), has shape {tuple(t.shape)}"
        )
    v = float(t.reshape(()))
    if not (v > 0 and v < float("inf")):
        raise ValueError(f"NVFP4 checkpoint: {name!r} = {v} ({what}) must be finite and > 0")
    return v


def _load(path, dtype, device) -> tuple[Layout, dict[str, torch.Tensor], dict[str, NVFP4Tensor], list[str]]:
    path = Path(path)
    lay = LAYOUTS[detect_layout(path)]
    tensors = _read_tensors(path)
    dtype = dtype or _config_dtype(path)
    out: dict[str, NVFP4Tensor] = {}
    modules = _quantized_modules(tensors, lay)
    for m in modules:
        data = _get(tensors, f"{m}.{lay.weight}", torch.uint8, "packed E2M1 codes")
        scale = _get(tensors, f"{m}.{lay.weight_scale}", torch.float8_e4m3fn, "E4M3 block scales")
        stored = _scalar(tensors, f"{m}.{lay.weight_global}", "weight outer scale")
        n, half_k = data.shape if data.dim() == 2 else (None, None)
        if (
            data.dim() != 2
            or tuple(scale.shape) != (n, 2 * half_k // GROUP_SIZE)
            or (2 * half_k) % GROUP_SIZE
        ):
            raise ValueError(
                f"NVFP4 checkpoint: {m!r}: {lay.weight} {tuple(data.shape)} and {lay.weight_scale} "
                f"{tuple(scale.shape)} are not [N, K/2] and [N, K/16] with K % 16 == 0"
            )
        recipe = QuantRecipe(profile=lay.profile, scale_source="checkpoint", checkpoint_scale=stored)
        outer = outer_scale_from_recipe(recipe, device)
        out[f"{m}.weight"] = NVFP4Tensor(
            data=data.to(device),
            scale=scale.to(device),
            global_scale=outer.decode,
            recipe=recipe,
            shape=torch.Size((n, 2 * half_k)),
            dtype=dtype,
            global_encode_scale=outer.encode,
        )
    return lay, tensors, out, modules


def load_nvfp4_checkpoint(path, *, dtype: torch.dtype | None = None, device="cpu") -> dict[str, NVFP4Tensor]:
    """``{"<module>.weight": NVFP4Tensor}`` for every quantized Linear of a ModelOpt or compressed-tensors
    checkpoint (layout detected from its configs).

    Each tensor's recipe is ``QuantRecipe(profile=<layout producer>, scale_source="checkpoint",
    checkpoint_scale=<stored outer scale>)``: ``global_scale`` is ``weight_scale_2`` (ModelOpt) or
    ``RN(1/weight_global_scale)`` (compressed-tensors). ``dtype`` (the dequantization default) is taken
    from config.json when not given. Missing or malformed tensors raise an error naming the tensor.
    """
    return _load(path, dtype, device)[2]


def load_activation_recipes(path) -> dict[str, QuantRecipe]:
    """``{module: QuantRecipe}`` reproducing the checkpoint's static activation quantization on the learner:
    ``scale_source="checkpoint"`` with ``input_scale`` (ModelOpt, decode) or ``input_global_scale``
    (compressed-tensors, encode). Empty for weight-only (W4A16) checkpoints; a W4A4 checkpoint missing a
    quantized module's activation scale is an error naming the tensor."""
    path = Path(path)
    lay, tensors, _, modules = _load(path, None, "cpu")
    if _weight_only(path, lay.name):
        return {}
    recipes = {}
    for m in modules:
        v = _scalar(tensors, f"{m}.{lay.input_global}", "static activation outer scale")
        recipes[m] = QuantRecipe(profile=lay.profile, scale_source="checkpoint", checkpoint_scale=v)
    return recipes


def dequantized_state_dict(
    path, dtype: torch.dtype | None = None, device="cpu", *, fuse_experts: bool = False
) -> dict[str, torch.Tensor]:
    """The checkpoint as a plain state dict: quantized weights dequantized (``e2m1·s·g``, exact in fp32,
    then cast to ``dtype``, default config.json's dtype), other tensors as stored; scale tensors dropped.
    Load it with ``model.load_state_dict(...)`` (also into a ``convert_to_nvfp4`` model: ``NVFP4Linear``
    keeps the dequantized values as its master weight and re-quantizes them with its own recipe).
    ``fuse_experts=True`` stacks per-expert ``experts.{e}.{gate,up,down}_proj.weight`` back into the
    transformers-5 ``experts.gate_up_proj`` / ``experts.down_proj`` parameters."""
    lay, tensors, weights, modules = _load(path, dtype, device)
    nvfp4_names = {
        f"{m}.{s}"
        for m in modules
        for s in (lay.weight, lay.weight_scale, lay.weight_global, lay.input_global)
    }
    out = {name: t.to(device) for name, t in tensors.items() if name not in nvfp4_names}
    for name, t in weights.items():
        out[name] = t.dequantize()
    return _fuse_experts(out) if fuse_experts else out
