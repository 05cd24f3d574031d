"""Fused groups: sibling Linear layers that an engine runs as one GEMM with ONE outer scale, and their amax.

vLLM loads q/k/v into one ``qkv_proj`` and gate/up into one ``gate_up_proj`` (its ``packed_modules_mapping``;
:data:`FUSED_GROUPS` lists the groups) and gives the fused layer one weight outer scale and one input outer
scale. Whoever reproduces that engine quantizes every shard of a group with the same outer scale. This module
defines the group and its amax for all of them: the export (``export_nvfp4_checkpoint(share_fused_scales=
True)``: weights and calibrated activation amaxes), the HF sampler's ``fused_weight_scale="shared"``
(:func:`~triage.kernels.calibration.set_fused_weight_scales`) and the diagnostics' ``fused_scales="shared"``.

* Group (:func:`fused_group_key`, :func:`fused_group_members`): the layers ``<parent>.<leaf>`` of one
  ``parent`` whose leaves are in one entry of ``fused_groups`` (default :data:`FUSED_GROUPS`), those present
  only. A layer in no group is a group of its own.
* Group amax (:func:`group_amax`, :func:`fused_group_amax`): ``A_G = max_{m ∈ G} A_m``, with ``A_m`` a member's
  per-tensor amax (``max |W_m|``, or its calibrated activation amax). ``A_G`` is the amax of the concatenated
  fused tensor, so a shard quantized with the static amax ``A_G`` has exactly the bytes of its rows of the
  fused tensor (1x16 blocks; 16x16 tiles when every shard's row count is a multiple of 16). A NaN ``A_m``
  makes ``A_G`` NaN, whatever the members' order.
* Not here: the compressed-tensors weight rule of the export (llm-compressor's): the group shares
  ``min_{m ∈ G} gs(A_m)``, ``gs`` = :func:`~triage.kernels.nvfp4.export.compressed_tensors_global_scale`.
  ``gs`` does not increase with ``A`` where it is finite, so that minimum is ``gs(A_G)``; but a shard whose
  ``gs`` is not finite gets ``gs = 1`` (an all-zero shard, or ``A_m < 2688/65504`` in fp16), and then the group
  shares ``min(1, ...)`` whatever ``A_G`` is. The export takes that minimum over the members defined here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["FUSED_GROUPS", "fused_group_amax", "fused_group_key", "fused_group_members", "group_amax"]

#: Sibling modules the engines fuse into one GEMM with one outer scale (vLLM ``packed_modules_mapping``):
#: q/k/v, gate/up, MLA's q_a/kv_a (DeepSeek-V2/V3), Mixtral-style expert w1/w3.
FUSED_GROUPS = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("q_a_proj", "kv_a_proj_with_mqa"),
    ("w1", "w3"),
)


def fused_group_key(name: str, fused_groups=FUSED_GROUPS) -> tuple[str, int] | None:
    """``(parent module name, index in fused_groups)`` of a fused-shard layer (``...self_attn.k_proj`` →
    ``("...self_attn", 0)``), else None. Two layers are in one group exactly when their keys are equal."""
    parent, _, leaf = name.rpartition(".")
    for gi, group in enumerate(fused_groups):
        if leaf in group:
            return parent, gi
    return None


def fused_group_members(names: Iterable[str], fused_groups=FUSED_GROUPS) -> dict[str, tuple[str, ...]]:
    """Layer name → the members of its fused group among ``names`` (itself included, in the order of its
    ``fused_groups`` entry), for the names that are fused shards only.

    ``fused_groups``: tuples of leaf module names; a leaf in two of them is an error (its group would be
    ambiguous), as is a group given as one string (``"q_proj"`` instead of ``("q_proj",)``)."""
    groups = _checked(fused_groups)
    keys = {name: key for name in names if (key := fused_group_key(name, groups)) is not None}
    by_key: dict[tuple[str, int], list[str]] = {}
    for name, key in keys.items():
        by_key.setdefault(key, []).append(name)

    def position(name: str) -> int:
        return groups[keys[name][1]].index(name.rpartition(".")[2])

    return {name: tuple(sorted(by_key[key], key=position)) for name, key in keys.items()}


def group_amax(amax: Mapping[str, float], members: Mapping[str, tuple[str, ...]]) -> dict[str, float]:
    """Layer name → its group amax ``A_G = max_{m ∈ G} amax[m]``, ``G = members.get(name, (name,))`` (a layer
    in no group keeps its own amax), for every name of ``amax``; NaN when any ``amax[m]`` is NaN (in any
    order). ``members``: as :func:`fused_group_members` gives them."""
    out = {}
    for name in amax:
        values = [amax[m] for m in members.get(name, (name,))]
        out[name] = math.nan if any(math.isnan(v) for v in values) else max(values)
    return out


def fused_group_amax(weights: Mapping[str, torch.Tensor], fused_groups=FUSED_GROUPS) -> dict[str, float]:
    """Layer name → the amax of its fused group (:func:`group_amax` of the shards' ``max |W|``, over the
    shards present in ``weights``), for the fused-shard layers of ``weights`` only."""
    members = fused_group_members(weights, fused_groups)
    return group_amax({name: float(weights[name].detach().abs().amax()) for name in members}, members)


def _checked(fused_groups) -> tuple[tuple[str, ...], ...]:
    """``fused_groups`` as a tuple of tuples of leaf names; ``ValueError`` naming ``fused_groups`` when an
    entry is a string or holds a non-string, or a leaf is in two entries."""
    groups, seen = [], {}
    for gi, group in enumerate(fused_groups):
        if not isinstance(group, (tuple, list)) or not all(isinstance(leaf, str) for leaf in group):
            raise ValueError(f"fused_groups[{gi}] must be a tuple of module names, got {group!r}")
        for leaf in group:
            if seen.setdefault(leaf, gi) != gi:
                raise ValueError(
                    f"fused_groups: {leaf!r} is in fused_groups[{seen[leaf]}] and fused_groups[{gi}]; a layer "
                    "belongs to one fused group"
                )
        groups.append(tuple(group))
    return tuple(groups)
