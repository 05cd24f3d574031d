"""Export and import NVFP4 safetensors checkpoints in the ModelOpt and compressed-tensors layouts.

::

    res = export_nvfp4_checkpoint(model, "out/", layout="modelopt", input_amax={"model.layers.0...": 3.1})
    weights = load_nvfp4_checkpoint("out/")          # {"model.layers.0.self_attn.q_proj.weight": NVFP4Tensor}
    model.load_state_dict(dequantized_state_dict("out/"))

What gets quantized: every 2-D floating ``<module>.weight`` whose module name matches none of the ``skip``
fnmatch patterns (default :data:`~triage.kernels.skip.DEFAULT_SKIP`, the list ``triage.kernels.convert``
skips too: lm_head, embeddings, norms, MoE routers, score/classifier heads). Everything else
(norms, embeddings, biases, skipped layers) is written unchanged. Skipped 2-D weights are listed by module
name in ``exclude_modules`` / ``ignore`` so that engines load them unquantized.

Shared outer scale of fused shards (``share_fused_scales=True``): vLLM loads q/k/v into one ``qkv_proj``
and gate/up into one ``gate_up_proj`` with ONE outer scale; it takes ``.max()`` over the shards' stored
scales (decode ``weight_scale_2`` for ModelOpt, encode ``weight_global_scale`` for compressed-tensors) and
warns if they differ (research note §3.3, §4 pitfall 12). So every shard of a group
(:mod:`triage.kernels.fused_groups`) is quantized with the group amax ``A = max(A_q, A_k, A_v)``
(``QuantRecipe(scale_source="static", static_amax=A)``; compressed-tensors: the smallest of the shards' encode
scales, :func:`_quantize_weights`) and stores the same outer scale; the bytes on disk are exactly what the
engine computes with. Calibrated activation amaxes of a fused group are unified the same way (max). With
``share_fused_scales=False`` each shard keeps its own amax: the checkpoint still loads, but vLLM then applies
one shard's scale to all (the max decode scale for ModelOpt -> the other shards dequantize too large; the max
ENCODE scale for compressed-tensors -> the shards with larger amax dequantize too small), i.e. the engine's
weights differ from the exported ones.

Producer arithmetic: the default recipe of each layout writes the bytes its producer writes for bf16, fp16
and fp32 weights: ModelOpt's formulas (profile ``modelopt``, fp32 after an exact amax), and for
compressed-tensors the package's own arithmetic in the weight's dtype (:func:`compressed_tensors_quantize`),
which :func:`quantize`'s fp32 profile does not reproduce.

Folders: an earlier NVFP4 export in ``out_dir`` is replaced (its shards, index and ModelOpt config removed
first); weight files of anything else are refused, never deleted. config.json names ``architectures``.

Exactness: ``load_nvfp4_checkpoint`` returns tensors whose ``data``/``scale`` bytes and decode multiplier
equal the exported in-memory quantization (for compressed-tensors the decode multiplier is
``RN(1/weight_global_scale)``, which is how the te and compressed-tensors profiles define it). Malformed
files (NaN or negative block-scale bytes, absurd outer scales, an unknown config dtype, unreadable shards)
are errors naming the tensor and file.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..fused_groups import FUSED_GROUPS, fused_group_members, group_amax
from ..skip import DEFAULT_SKIP, skip_patterns, skipped
from .api import quantize
from .checkpoint_layouts import (
    GROUP_SIZE,
    LAYOUTS,
    Layout,
    compressed_tensors_config,
    get_layout,
    modelopt_configs,
)
from .format import e2m1_codes, e4m3_encode, pack_nibbles
from .recipe import QuantRecipe
from .reference import FP4_TIMES_E4M3, block_amax, outer_scale_from_recipe
from .tensor import NVFP4Tensor

__all__ = [
    "DEFAULT_SKIP",
    "FUSED_GROUPS",
    "ExportResult",
    "compressed_tensors_global_scale",
    "compressed_tensors_quantize",
    "dequantized_state_dict",
    "detect_layout",
    "export_nvfp4_checkpoint",
    "load_activation_recipes",
    "load_nvfp4_checkpoint",
    "model_config",
    "read_nvfp4_checkpoint",
    "write_nvfp4_checkpoint",
]

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
        out_dir: directory to write (created; an earlier NVFP4 export there is replaced, other weight
            files refused).
        layout: ``"modelopt"`` or ``"compressed-tensors"`` (see ``checkpoint_layouts.py``).
        recipe: weight quantizer; default ``QuantRecipe(profile=layout's producer)``. Needs
            ``scale="tensor"``, ``scale_source="dynamic"``, no Hadamard; compressed-tensors (encode scales)
            also needs profile ``te`` or ``compressed-tensors``. Profile ``compressed-tensors`` runs the
            package's arithmetic (:func:`compressed_tensors_quantize`, nearest rounding only).
            ``block="16x16"`` is allowed (its scales are stored per 1x16 row, which engines read as
            ordinary NVFP4).
        skip: fnmatch patterns on module names to keep high precision (a pattern string or a tuple of them;
            :data:`~triage.kernels.skip.DEFAULT_SKIP`).
        input_amax: ``{module name: calibrated activation amax}`` for W4A4 checkpoints (``input_scale`` /
            ``input_global_scale``; every quantized module needs one). None: weight-only (W4A16) config.
        share_fused_scales: one outer scale per fused group (see the module docstring).
        fused_groups: tuples of sibling module names sharing a scale
            (:data:`~triage.kernels.fused_groups.FUSED_GROUPS`; a name in two of them is an error).
        config: for a state dict, the model config (``PretrainedConfig`` or dict naming ``architectures``)
            to write as config.json; default for a model: :func:`model_config` (as ``save_pretrained``).
        tokenizer: saved into ``out_dir`` if given.
        backend: quantize backend (``"auto"``: Triton on CUDA, torch reference otherwise); profile
            ``compressed-tensors`` always runs the package's torch arithmetic on the weight's device.
        max_shard_bytes: split the safetensors into shards of at most this size (+ index json).
    """
    lay = get_layout(layout)
    recipe = _check_recipe(recipe or QuantRecipe(profile=lay.profile), lay)
    skip = skip_patterns(skip)
    raw = _state_dict(model_or_state_dict)
    _check_fused_experts(model_or_state_dict, raw, skip)
    state = _unfuse_experts(raw)
    if isinstance(model_or_state_dict, torch.nn.Module):  # embeddings stay high precision whatever their name
        embeddings = [n for n, m in model_or_state_dict.named_modules() if isinstance(m, torch.nn.Embedding)]
        skip = (*skip, *embeddings)
    targets, excluded = _plan(state, skip)
    for m in targets:
        _check_weight(m, state[f"{m}.weight"], recipe)
    groups = _fused_groups(targets, excluded, fused_groups) if share_fused_scales else {}
    weights = _quantize_weights(state, targets, groups, recipe, backend)

    input_scales = None if input_amax is None else _input_scales(input_amax, targets, groups, lay)
    path = Path(out_dir)
    files = write_nvfp4_checkpoint(
        path,
        weights,
        {name: t for name, t in state.items() if name not in weights},
        layout=lay.name,
        config=config if config is not None else _own_config(model_or_state_dict),
        input_scales=input_scales,
        max_shard_bytes=max_shard_bytes,
    )
    gen = getattr(model_or_state_dict, "generation_config", None)
    if gen is not None and hasattr(gen, "save_pretrained"):
        gen.save_pretrained(path)
    _copy_tokenizer(path, model_or_state_dict, tokenizer)
    return ExportResult(path, lay.name, weights, input_scales or {}, excluded, files)


def write_nvfp4_checkpoint(
    out_dir,
    quantized: Mapping[str, NVFP4Tensor],
    tensors: Mapping[str, torch.Tensor],
    *,
    layout: str = "modelopt",
    config=None,
    input_scales: Mapping[str, float] | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> list[str]:
    """Write already-quantized weights (their bytes as they are) and other tensors as an NVFP4 checkpoint:
    the one writer behind :func:`export_nvfp4_checkpoint` and the LoRA base save (``save_nvfp4_lora``).

    ``quantized``: ``{"<module>.weight": NVFP4Tensor}`` (K % 16 == 0, one outer scale per tensor; for an
    ENCODE-scale layout a recipe of the layout's profiles with a known encode scale), stored per ``layout``
    (:data:`~triage.kernels.nvfp4.checkpoint_layouts.LAYOUTS`) as packed codes, E4M3 block scales and the
    outer scale. ``tensors``: every other tensor (norms, embeddings, biases, skipped layers) by state-dict
    name, written unchanged; its 2-D floating ``<module>.weight`` entries are the config's
    ``exclude_modules`` / ``ignore`` (engines load them unquantized). ``input_scales``: ``{module: stored
    activation outer scale}`` in the layout's convention (decode for ModelOpt, encode for compressed-tensors)
    for a W4A4 config, every quantized module needing one; None: a weight-only (W4A16) config.
    ``config``: the model config for config.json (a ``PretrainedConfig`` or a dict naming ``architectures``,
    e.g. :func:`model_config`), whose ``dtype`` defaults to the quantized weights' dtype when they share one.
    An earlier NVFP4 export in ``out_dir`` is replaced (:func:`_clear_previous_export`).
    :func:`load_nvfp4_checkpoint` reads the same bytes and decode scales back. Returns the safetensors
    file names."""
    lay = get_layout(layout)
    out: dict[str, torch.Tensor] = {}
    for name, t in quantized.items():
        if not name.endswith(".weight"):
            raise ValueError(
                f"write_nvfp4_checkpoint: quantized entry {name!r} must be a '<module>.weight' name"
            )
        module = name[: -len(".weight")]
        if t.shape[-1] % GROUP_SIZE:
            raise ValueError(
                f"write_nvfp4_checkpoint: {name!r} has K={t.shape[-1]}, not a multiple of {GROUP_SIZE} "
                "(engines need it)"
            )
        if t.global_scale.numel() != 1:
            raise ValueError(
                f"write_nvfp4_checkpoint: {name!r} has a per-row outer scale; checkpoints store one per tensor"
            )
        if lay.stores_encode:
            if t.global_encode_scale is None or t.recipe.profile not in lay.profiles:
                raise ValueError(
                    f"write_nvfp4_checkpoint: {name!r} (profile {t.recipe.profile!r}) cannot be stored in the "
                    f"{lay.name!r} layout, which keeps the ENCODE scale; use layout='modelopt'"
                )
            stored = t.global_encode_scale
        else:
            stored = t.global_scale
        out[f"{module}.{lay.weight}"] = t.data.detach().cpu().contiguous()
        out[f"{module}.{lay.weight_scale}"] = t.scale.detach().cpu().contiguous()
        out[f"{module}.{lay.weight_global}"] = stored.detach().float().cpu().reshape(lay.global_shape).clone()
    modules = [name[: -len(".weight")] for name in quantized]
    if input_scales is not None:
        unknown = sorted(set(input_scales) - set(modules))
        missing = [m for m in modules if m not in input_scales]
        if unknown or missing:
            raise ValueError(
                f"write_nvfp4_checkpoint: input_scales must name exactly the quantized modules; unknown "
                f"{unknown[:3]}, missing {missing[:3]}"
            )
        for m in modules:
            v = torch.tensor(float(input_scales[m]), dtype=torch.float32)
            if not (torch.isfinite(v) and v > 0):
                raise ValueError(
                    f"write_nvfp4_checkpoint: input_scales[{m!r}] = {float(v)!r}; must be finite and > 0"
                )
            out[f"{m}.{lay.input_global}"] = v.reshape(lay.global_shape)
    collide = sorted(set(tensors) & set(out))
    if collide:
        raise ValueError(
            f"write_nvfp4_checkpoint: tensor {collide[0]!r} collides with a quantized tensor name"
        )
    out.update(_unshared(tensors))
    excluded = [
        n.rpartition(".")[0]
        for n, t in tensors.items()
        if n.endswith(".weight") and t.dim() == 2 and t.is_floating_point()
    ]
    dtypes = {t.dtype for t in quantized.values()}
    return _write_files(
        Path(out_dir),
        out,
        layout=lay.name,
        config=config,
        excluded=excluded,
        weight_only=input_scales is None,
        dtype=dtypes.pop() if len(dtypes) == 1 else None,
        max_shard_bytes=max_shard_bytes,
    )


def _unshared(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached CPU tensors, each the whole of its own contiguous storage: a view (a slice of a fused expert
    tensor, a tied or shared weight) is copied, as safetensors and ``save_torch_state_dict`` refuse shared or
    partly covered storage."""
    seen: set[int] = set()
    out = {}
    for name, t in tensors.items():
        t = t.detach().cpu()
        storage = t.untyped_storage()
        whole = t.is_contiguous() and storage.nbytes() == t.numel() * t.element_size()
        out[name] = t if whole and storage.data_ptr() not in seen else t.clone()
        seen.add(storage.data_ptr())
    return out


def _quantize_weights(state, targets, groups, recipe: QuantRecipe, backend) -> dict[str, NVFP4Tensor]:
    """``{"<m>.weight": NVFP4Tensor}``, one outer scale per fused group (``groups``: :func:`_fused_groups`).

    Profile ``compressed-tensors``: the package's own arithmetic (:func:`compressed_tensors_quantize`), the
    group sharing the smallest of its members' encode scales ``gs(A_m)`` (llm-compressor's rule for fused
    layers; it equals ``gs`` of the group amax except where a member's ``gs`` is not finite and is replaced by 1,
    see :mod:`triage.kernels.fused_groups`). Other profiles: :func:`quantize` with the group amax
    (:func:`~triage.kernels.fused_groups.group_amax`, the largest member amax) as a static amax (ModelOpt's
    rule); a group amax of 0 (all-zero members) keeps the dynamic recipe."""
    if recipe.profile == "compressed-tensors":
        enc = {
            m: compressed_tensors_global_scale(state[f"{m}.weight"].detach().abs().amax()) for m in targets
        }
        return {
            f"{m}.weight": compressed_tensors_quantize(
                state[f"{m}.weight"],
                torch.stack([enc[x] for x in groups.get(m, (m,))]).amin(0),
                block=recipe.block,
            )
            for m in targets
        }
    amax = {m: float(state[f"{m}.weight"].detach().abs().amax().float()) for m in targets}
    shared = group_amax(amax, groups)
    weights = {}
    for m in targets:
        try:
            r = recipe if shared[m] == 0.0 else replace(recipe, scale_source="static", static_amax=shared[m])
        except ValueError as e:  # an amax whose fp32 reciprocal overflows (_check_weight refused NaN/inf)
            group = groups.get(m, (m,))
            raise ValueError(
                f"export_nvfp4_checkpoint: {m}.weight cannot be quantized with the "
                f"{'group' if len(group) > 1 else 'tensor'} amax {shared[m]!r} of {list(group)}: {e}"
            ) from e
        weights[f"{m}.weight"] = quantize(state[f"{m}.weight"], r, backend=backend)
    return weights


def compressed_tensors_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' ``generate_gparam``: the ENCODE scale ``2688 / A`` as PyTorch evaluates it in the
    dtype ``d`` of ``amax`` (``scalar / tensor`` is ``reciprocal(tensor) * scalar``):
    ``gs = fp32(RN_d(RN_d(1 / max(A, tiny_d)) · 2688))``, and 1 where that is not finite. Shape ``[1]``.

    In bf16 both products round to 8 bits, so ``gs`` differs from the fp32 ``RN(2688 / A)`` in most
    tensors; in fp16 every ``A < 2688 / 65504`` overflows to ``gs = 1``."""
    a = torch.clamp(amax, min=torch.finfo(amax.dtype).tiny)
    gs = torch.reciprocal(a) * FP4_TIMES_E4M3
    return torch.where(torch.isfinite(gs), gs, torch.ones_like(gs)).float().reshape(1)


def compressed_tensors_quantize(
    w: torch.Tensor, global_scale: torch.Tensor | None = None, *, block: str = "1x16"
) -> NVFP4Tensor:
    """NVFP4-quantize ``w`` exactly as compressed-tensors writes it (``calculate_qparams`` for the block
    scales, ``NVFP4PackedCompressor.compress`` for the codes), in ``w``'s own dtype ``d``:

    * ``gs`` = ``global_scale`` (default :func:`compressed_tensors_global_scale` of ``max |w|``);
    * block scale ``s = e4m3(RN(gs · RN_d(b / 6)))`` with ``b`` the block amax (in ``d``, exact), and
      ``s = 0.125`` where that rounds to 0;
    * code = E2M1 of ``RN(x / RN(s / gs))`` (ties to even, sign = ``v < 0``), packed low nibble first.

    ``block="16x16"`` takes ``b`` over 16x16 tiles (stored per 1x16 row; the package itself has no
    tiles). The result's recipe is ``QuantRecipe(profile="compressed-tensors", scale_source="checkpoint",
    checkpoint_scale=gs)``, the one :func:`load_nvfp4_checkpoint` gives back: decode multiplier
    ``RN(1 / gs)``."""
    gs = compressed_tensors_global_scale(w.detach().abs().amax()) if global_scale is None else global_scale
    gs = gs.float().reshape(1).to(w.device)
    recipe = QuantRecipe(
        profile="compressed-tensors", block=block, scale_source="checkpoint", checkpoint_scale=float(gs)
    )
    x = w.detach()
    six = torch.tensor(6.0, dtype=x.dtype, device=x.device)
    s = e4m3_encode(gs * (block_amax(x, recipe) / six).float()).float()
    s = torch.where(s == 0, torch.full_like(s, 0.125), s)
    v = x.float().unflatten(-1, (-1, GROUP_SIZE)) / (s / gs).unsqueeze(-1)
    outer = outer_scale_from_recipe(recipe, x.device)
    return NVFP4Tensor(
        data=pack_nibbles(e2m1_codes(v.flatten(-2), "negative")),
        scale=s.to(torch.float8_e4m3fn),
        global_scale=outer.decode,
        recipe=recipe,
        shape=w.shape,
        dtype=w.dtype,
        global_encode_scale=outer.encode,
    )


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
    if recipe.profile == "compressed-tensors" and recipe.rounding != "nearest":
        raise ValueError(
            "export_nvfp4_checkpoint: profile 'compressed-tensors' writes what compressed-tensors computes, "
            f"which rounds to nearest; got rounding={recipe.rounding!r}"
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
    fused = any(
        k.endswith(".experts.gate_up_proj") and t.dim() == 3 and not skipped(k.rpartition(".")[0], skip)
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


def _plan(state: dict[str, torch.Tensor], skip) -> tuple[list[str], list[str]]:
    """(modules to quantize, 2-D weights kept high precision) in state-dict order."""
    targets, excluded = [], []
    for name, t in state.items():
        if not t.is_floating_point():
            continue
        module = name.rpartition(".")[0]
        if t.dim() == 2 and name.endswith(".weight"):
            (excluded if skipped(module, skip) else targets).append(module)
        elif t.dim() > 2 and not skipped(module, skip):
            raise ValueError(
                f"export_nvfp4_checkpoint: tensor {name!r} has {t.dim()} dims {tuple(t.shape)}; only 2-D Linear "
                "weights (and transformers' fused experts gate_up_proj/down_proj) are exported: add it to skip="
            )
    return targets, excluded


def _fused_groups(targets: list[str], excluded: list[str], fused_groups) -> dict[str, tuple[str, ...]]:
    """Quantized module -> the members of its fused group among the 2-D weights
    (:func:`~triage.kernels.fused_groups.fused_group_members`). A group with some members quantized and others
    skipped is an error (vLLM refuses a fused layer whose shards are not all quantized or all excluded)."""
    kept = set(excluded)
    groups = {}
    for m, members in fused_group_members([*targets, *excluded], fused_groups).items():
        if m in kept:
            continue
        mixed = [x for x in members if x in kept]
        if mixed:
            raise ValueError(
                f"export_nvfp4_checkpoint: fused group {members} has {mixed} skipped but {m!r} quantized; "
                "engines load the group as one layer, so skip all of it or none"
            )
        groups[m] = members
    return groups


def _check_weight(module: str, w: torch.Tensor, recipe: QuantRecipe) -> None:
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
    if not torch.isfinite(w.detach().abs().amax()):
        raise ValueError(f"export_nvfp4_checkpoint: {name!r} contains NaN or Inf; refusing to export it")


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
        v32 = float(torch.tensor(v, dtype=torch.float32))
        if not (v32 > 0 and v32 < float("inf")):
            raise ValueError(f"input_amax[{m!r}] must be finite and > 0 in fp32, got {v!r}")
        amax[m] = v32
    shared = group_amax(amax, groups)
    scales = {}
    for m in targets:
        if lay.name == "compressed-tensors":  # generate_gparam on the calibrated amax (an fp32 value)
            scales[m] = float(compressed_tensors_global_scale(torch.tensor(shared[m], dtype=torch.float32)))
        else:
            recipe = QuantRecipe(profile="modelopt", scale_source="static", static_amax=shared[m])
            scales[m] = float(outer_scale_from_recipe(recipe, "cpu").decode)
    return scales


def _save_sharded(tensors: dict[str, torch.Tensor], path: Path, max_bytes: int) -> list[str]:
    """Write ``tensors`` with ``huggingface_hub.save_torch_state_dict``: ``model.safetensors``, or shards of at
    most ``max_bytes`` (a tensor larger than that alone in its own) named ``model-0000i-of-0000n.safetensors``
    with ``model.safetensors.index.json`` (``{"metadata": {"total_size"}, "weight_map"}``); every file's
    safetensors metadata is ``{"format": "pt"}``. Returns the file names in shard order."""
    from huggingface_hub import save_torch_state_dict, split_torch_state_dict_into_shards

    save_torch_state_dict(tensors, path, max_shard_size=max_bytes)
    return list(split_torch_state_dict_into_shards(tensors, max_shard_size=max_bytes).filename_to_tensors)


def model_config(model):
    """A copy of ``model.config`` naming the model's class in ``architectures``, as ``save_pretrained``
    records it (vLLM's model registry refuses a config without it)."""
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    return config


def _own_config(obj):
    """A model's config as ``save_pretrained`` writes it (:func:`model_config`); None for a state dict."""
    own = isinstance(obj, torch.nn.Module) and hasattr(getattr(obj, "config", None), "to_json_string")
    return model_config(obj) if own else None


def _config_dict(config) -> dict:
    """config.json's content (without ``quantization_config``) from a ``PretrainedConfig`` (what its
    ``save_pretrained`` writes) or a dict; either must name ``architectures``."""
    if isinstance(config, Mapping):
        cfg = dict(config)
    elif hasattr(config, "to_json_string"):  # a PretrainedConfig: what its save_pretrained writes
        cfg = json.loads(config.to_json_string(use_diff=True))
    else:
        raise TypeError(f"config must be a PretrainedConfig or a dict, got {type(config).__name__}")
    arch = cfg.get("architectures")
    if not (isinstance(arch, list) and arch and all(isinstance(a, str) for a in arch)):
        raise ValueError(
            f"config: 'architectures' must name the model class (e.g. ['Qwen3ForCausalLM']), got {arch!r}; "
            "inference engines pick the model by it (pass the model, or triage.kernels.nvfp4.export."
            "model_config(model))"
        )
    return cfg


#: The weight files an export writes (and save_pretrained / the producers): one file, or numbered shards.
EXPORT_WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")


def _clear_previous_export(path: Path) -> None:
    """Remove the files of an earlier NVFP4 export in ``path`` that the new one may not overwrite
    (``model.safetensors``, ``model-NNNNN-of-NNNNN.safetensors``, ``model.safetensors.index.json``,
    ``hf_quant_config.json``), so that no stale shard, index or config is read back; other files are left
    alone. Weight files of anything else (a folder whose configs describe no NVFP4 checkpoint) are refused,
    never deleted."""
    ours = (path / INDEX, path / HF_QUANT_CONFIG)
    shards = sorted(p for p in path.glob("*.safetensors") if EXPORT_WEIGHT_FILE.fullmatch(p.name))
    old = shards + [p for p in ours if p.is_file()]
    if not old:
        return
    try:
        detect_layout(path)
    except ValueError as err:
        raise FileExistsError(
            f"{path} holds {[p.name for p in old]}, which are not an NVFP4 export ({err}); export into an "
            "empty folder, or delete them to overwrite"
        ) from None
    for p in old:
        p.unlink()


def _write_files(
    out_dir,
    tensors: Mapping[str, torch.Tensor],
    *,
    layout: str,
    config,
    excluded: list[str],
    weight_only: bool,
    dtype: torch.dtype | None,
    max_shard_bytes: int = 5 * 2**30,
) -> list[str]:
    """Write the tensors of an NVFP4 checkpoint (already in the layout's names) and its configs.

    An earlier NVFP4 export in ``out_dir`` is replaced (:func:`_clear_previous_export`). config.json is
    ``config`` + ``quantization_config`` (+ ``dtype`` if unset): a ``PretrainedConfig`` through its own
    ``save_pretrained``, a dict naming ``architectures`` as JSON, None as nothing but those two keys (enough
    for :func:`load_nvfp4_checkpoint`, not for an engine). ModelOpt also gets ``hf_quant_config.json``.
    Returns the safetensors file names."""
    from triage._version import __version__

    lay = get_layout(layout)
    cfg = {} if config is None else _config_dict(config)
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    _clear_previous_export(path)
    files = _save_sharded(dict(tensors), path, max_shard_bytes)
    if lay.name == "modelopt":
        hf_quant, qconfig = modelopt_configs(excluded, weight_only, f"triage-rl-{__version__}")
        (path / HF_QUANT_CONFIG).write_text(json.dumps(hf_quant, indent=2))
    else:
        qconfig = compressed_tensors_config(excluded, weight_only)
    if cfg.get("dtype") or cfg.get("torch_dtype"):
        dtype = None  # the config names its own; else the weights' dtype (loaders read it)
    if config is None or isinstance(config, Mapping):
        cfg["quantization_config"] = qconfig
        if dtype is not None:
            cfg["dtype"] = str(dtype).removeprefix("torch.")  # as save_pretrained records it
        (path / CONFIG).write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str) + "\n")
    else:  # a PretrainedConfig saves itself (a remote-code model's configuration file included)
        config = copy.deepcopy(config)
        config.quantization_config = qconfig
        if dtype is not None:
            config.dtype = dtype
        config.save_pretrained(path)
    return files


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
    if not p.is_file():
        return None
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{p}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{p}: expected a JSON object, got {type(data).__name__}")
    return data


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


#: config.json ``dtype`` values a checkpoint dequantizes to.
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class _Stored:
    """The tensors of a checkpoint folder and the file each one was read from (named in every error)."""

    path: Path
    tensors: dict[str, torch.Tensor]
    origin: dict[str, str]

    @classmethod
    def read(cls, path: Path) -> _Stored:
        """Read the shards named by ``model.safetensors.index.json`` if present, else ``model.safetensors``,
        else every ``*.safetensors``. A listed shard that is missing or unreadable, a tensor the index puts
        in a shard that lacks it, or a tensor in two shards is an error naming the file."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        index = _read_json(path / INDEX)
        if index is not None:
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise ValueError(f"{path / INDEX}: 'weight_map' must map tensor names to shard files")
            files = sorted(set(weight_map.values()))
        elif (path / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path}: no .safetensors files")
        stored = cls(path, {}, {})
        for f in files:
            if not (path / f).is_file():
                raise FileNotFoundError(f"{path}: shard {f!r} listed in {INDEX} is missing")
            try:
                part = load_file(str(path / f))
            except (SafetensorError, OSError) as err:
                raise ValueError(f"{path / f}: not a readable safetensors file ({err})") from None
            for name, t in part.items():
                if name in stored.origin:
                    raise ValueError(f"{path}: tensor {name!r} is in both {stored.origin[name]} and {f}")
                stored.tensors[name] = t
                stored.origin[name] = f
        if index is not None:
            lost = [n for n, f in weight_map.items() if stored.origin.get(n) != f]
            if lost:
                raise ValueError(
                    f"{path / INDEX} puts {len(lost)} tensor(s) in shards that do not hold them, e.g. "
                    f"{lost[0]!r} in {weight_map[lost[0]]}"
                )
        return stored

    def where(self, name: str) -> str:
        return str(self.path / self.origin[name])

    def get(self, name: str, dtype: torch.dtype, what: str) -> torch.Tensor:
        if name not in self.tensors:
            raise KeyError(f"NVFP4 checkpoint {self.path}: missing tensor {name!r} ({what})")
        t = self.tensors[name]
        if t.dtype != dtype:
            raise ValueError(
                f"NVFP4 checkpoint {self.where(name)}: tensor {name!r} has dtype {t.dtype}, expected {dtype} "
                f"({what})"
            )
        return t

    def block_scales(self, name: str) -> torch.Tensor:
        """E4M3 block scales; a NaN (0x7F/0xFF) or sign-set byte is an error (scales are finite, >= 0)."""
        scale = self.get(name, torch.float8_e4m3fn, "E4M3 block scales")
        bits = scale.view(torch.uint8)
        bad = (bits >= 0x80) | (bits == 0x7F)
        if bad.any():
            first = tuple(bad.nonzero()[0].tolist())
            raise ValueError(
                f"NVFP4 checkpoint {self.where(name)}: {name!r} has {int(bad.sum())} block-scale byte(s) that "
                f"are NaN or negative (first at {first}: 0x{int(bits[first]):02X}); E4M3 block scales are "
                "finite and >= 0"
            )
        return scale

    def outer(self, name: str, lay: Layout, dtype: torch.dtype, what: str) -> float:
        """A stored outer scale ``v`` (one fp32 value). Its decode multiplier ``dec`` (``v``, or ``RN(1/v)``
        for encode layouts) must be a normal fp32 number with ``2688·dec``, the largest magnitude the
        tensor can hold, finite in ``dtype``; anything else is an error naming the tensor and file."""
        t = self.get(name, torch.float32, what)
        if t.numel() != 1:
            raise ValueError(
                f"NVFP4 checkpoint {self.where(name)}: {name!r} must hold one value ({what}), has shape "
                f"{tuple(t.shape)}"
            )
        v = t.reshape(())
        dec = float(torch.reciprocal(v)) if lay.stores_encode else float(v)
        limit = torch.finfo(dtype).max / FP4_TIMES_E4M3
        if not (float(v) > 0 and torch.isfinite(v) and torch.finfo(torch.float32).tiny <= dec <= limit):
            raise ValueError(
                f"NVFP4 checkpoint {self.where(name)}: {name!r} = {float(v)!r} ({what}) is not a usable outer "
                f"scale: its decode multiplier {dec!r} must lie in [2^-126, {limit:.4g}] (2688·decode finite "
                f"in {dtype})"
            )
        return float(v)


def _config_dtype(path: Path) -> torch.dtype:
    """config.json's ``dtype`` (or ``torch_dtype``); bfloat16 when it names none."""
    cfg = _read_json(path / CONFIG) or {}
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    if name is None:
        return torch.bfloat16
    key = str(name).removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(
            f"{path / CONFIG}: dtype {name!r} is not a dtype NVFP4 weights dequantize to; expected one of "
            f"{tuple(DTYPES)}"
        )
    return DTYPES[key]


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


def _load(path, dtype, device) -> tuple[Layout, _Stored, dict[str, NVFP4Tensor], list[str]]:
    path = Path(path)
    lay = LAYOUTS[detect_layout(path)]
    stored = _Stored.read(path)
    dtype = dtype or _config_dtype(path)
    out: dict[str, NVFP4Tensor] = {}
    modules = _quantized_modules(stored.tensors, lay)
    for m in modules:
        data = stored.get(f"{m}.{lay.weight}", torch.uint8, "packed E2M1 codes")
        scale = stored.block_scales(f"{m}.{lay.weight_scale}")
        v = stored.outer(f"{m}.{lay.weight_global}", lay, dtype, "weight outer scale")
        n, half_k = data.shape if data.dim() == 2 else (None, None)
        if (
            data.dim() != 2
            or tuple(scale.shape) != (n, 2 * half_k // GROUP_SIZE)
            or (2 * half_k) % GROUP_SIZE
        ):
            raise ValueError(
                f"NVFP4 checkpoint {stored.where(f'{m}.{lay.weight}')}: {m!r}: {lay.weight} "
                f"{tuple(data.shape)} and {lay.weight_scale} {tuple(scale.shape)} are not [N, K/2] and "
                "[N, K/16] with K % 16 == 0"
            )
        recipe = QuantRecipe(profile=lay.profile, scale_source="checkpoint", checkpoint_scale=v)
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
    return lay, stored, out, modules


def load_nvfp4_checkpoint(path, *, dtype: torch.dtype | None = None, device="cpu") -> dict[str, NVFP4Tensor]:
    """``{"<module>.weight": NVFP4Tensor}`` for every quantized Linear of a ModelOpt or compressed-tensors
    checkpoint (layout detected from its configs).

    Each tensor's recipe is ``QuantRecipe(profile=<layout producer>, scale_source="checkpoint",
    checkpoint_scale=<stored outer scale>)``: ``global_scale`` is ``weight_scale_2`` (ModelOpt) or
    ``RN(1/weight_global_scale)`` (compressed-tensors). ``dtype`` (the dequantization default) is taken
    from config.json when not given. Missing or malformed tensors (see :meth:`_Stored.block_scales`,
    :meth:`_Stored.outer`) raise an error naming the tensor and its file.
    """
    return _load(path, dtype, device)[2]


def load_activation_recipes(path) -> dict[str, QuantRecipe]:
    """``{module: QuantRecipe}`` reproducing the checkpoint's static activation quantization on the learner:
    ``scale_source="checkpoint"`` with ``input_scale`` (ModelOpt, decode) or ``input_global_scale``
    (compressed-tensors, encode). Empty for weight-only (W4A16) checkpoints; a W4A4 checkpoint missing a
    quantized module's activation scale is an error naming the tensor."""
    path = Path(path)
    lay, stored, _, modules = _load(path, None, "cpu")
    if _weight_only(path, lay.name):
        return {}
    dtype = _config_dtype(path)
    recipes = {}
    for m in modules:
        v = stored.outer(f"{m}.{lay.input_global}", lay, dtype, "static activation outer scale")
        recipes[m] = QuantRecipe(profile=lay.profile, scale_source="checkpoint", checkpoint_scale=v)
    return recipes


def dequantized_state_dict(
    path, dtype: torch.dtype | None = None, device="cpu", *, fuse_experts: bool = False
) -> dict[str, torch.Tensor]:
    """The checkpoint as a plain state dict: quantized weights dequantized (``e2m1·s·g``, exact in fp32,
    then cast to ``dtype``, default config.json's dtype), other tensors as stored; scale tensors dropped.
    Load it with ``model.load_state_dict(...)`` (also into a model converted by ``triage.kernels.convert``:
    ``NVFP4Linear`` keeps the dequantized values as its master weight and re-quantizes them with its own
    recipe).
    ``fuse_experts=True`` stacks per-expert ``experts.{e}.{gate,up,down}_proj.weight`` back into the
    transformers-5 ``experts.gate_up_proj`` / ``experts.down_proj`` parameters."""
    weights, out = read_nvfp4_checkpoint(path, dtype=dtype, device=device)
    for name, t in weights.items():
        out[name] = t.dequantize()
    return _fuse_experts(out) if fuse_experts else out


def read_nvfp4_checkpoint(
    path, *, dtype: torch.dtype | None = None, device="cpu"
) -> tuple[dict[str, NVFP4Tensor], dict[str, torch.Tensor]]:
    """The checkpoint in two parts: ``{"<module>.weight": NVFP4Tensor}`` of its quantized Linears (as
    :func:`load_nvfp4_checkpoint` gives them) and every other tensor as stored, on ``device`` (the quantized
    modules' codes and scale tensors, weight and input, left out)."""
    lay, stored, weights, modules = _load(path, dtype, device)
    nvfp4_names = {
        f"{m}.{s}"
        for m in modules
        for s in (lay.weight, lay.weight_scale, lay.weight_global, lay.input_global)
    }
    return weights, {name: t.to(device) for name, t in stored.tensors.items() if name not in nvfp4_names}
