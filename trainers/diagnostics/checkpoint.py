"""Offline conversion: write NVFP4 weights as an inference checkpoint and load the codes back.

The sampler of an RL run usually does not quantize the learner's weights itself: the weights are saved
(in bf16), converted offline by a checkpoint producer (ModelOpt, llm-compressor) and loaded by the engine,
which then uses the stored codes and scales as they are. This module is the documented stand-in for that
route until ``triage.kernels`` ships its own NVFP4 checkpoint export: it writes the tensors in the two
formats' layouts with ``safetensors`` and reads them back into ``NVFP4Tensor`` s.

=================  ==================================  =========================================
format             tensors per Linear ``<name>``       outer scale stored as
=================  ==================================  =========================================
modelopt           weight (u8 [N, K/2]),               ``weight_scale_2`` = decode scale (amax/2688)
                   weight_scale (e4m3 [N, K/16])
compressed-tensors weight_packed, weight_scale         ``weight_global_scale`` = encode scale (2688/amax)
=================  ==================================  =========================================

The te / torchao profiles are written in the ModelOpt layout (decode scale). Loading sets the decode
scale to what the engine uses: the stored decode scale, or ``1 / weight_global_scale`` (one fp32 division,
as vLLM's compressed-tensors loader inverts it).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from triage.kernels.nvfp4 import NVFP4Tensor

__all__ = ["load_nvfp4_checkpoint", "roundtrip", "save_nvfp4_checkpoint"]


def _layout(profile: str) -> str:
    return "compressed-tensors" if profile == "compressed-tensors" else "modelopt"


def save_nvfp4_checkpoint(weights: dict[str, NVFP4Tensor], path: str | os.PathLike, profile: str) -> Path:
    """Write ``{linear name: NVFP4Tensor}`` to ``path`` (a ``.safetensors`` file) in ``profile``'s layout."""
    from safetensors.torch import save_file

    tensors = {}
    for name, t in weights.items():
        if t.global_scale.numel() != 1:
            raise ValueError(
                f"{name}: an NVFP4 checkpoint stores one outer scale per weight, got {t.global_scale.shape}"
            )
        g = t.global_scale.reshape(1).float()
        if _layout(profile) == "modelopt":
            tensors[f"{name}.weight"] = t.data.contiguous()
            tensors[f"{name}.weight_scale_2"] = g.contiguous()
        else:
            enc = t.global_encode_scale.reshape(1).float() if t.global_encode_scale is not None else 1.0 / g
            tensors[f"{name}.weight_packed"] = t.data.contiguous()
            tensors[f"{name}.weight_global_scale"] = enc.contiguous()
        tensors[f"{name}.weight_scale"] = t.scale.contiguous()
    path = Path(path)
    save_file({k: v.cpu() for k, v in tensors.items()}, str(path))
    return path


def load_nvfp4_checkpoint(
    path: str | os.PathLike, like: dict[str, NVFP4Tensor], profile: str, device: torch.device | str = "cpu"
) -> dict[str, NVFP4Tensor]:
    """Read the tensors ``save_nvfp4_checkpoint`` wrote; ``like`` gives names, shapes and recipes."""
    from safetensors.torch import load_file

    stored = load_file(str(path), device=str(device))
    out = {}
    for name, ref in like.items():
        try:
            if _layout(profile) == "modelopt":
                data, decode = stored[f"{name}.weight"], stored[f"{name}.weight_scale_2"]
            else:
                data = stored[f"{name}.weight_packed"]
                decode = (
                    torch.ones_like(stored[f"{name}.weight_global_scale"])
                    / stored[f"{name}.weight_global_scale"]
                )
            scale = stored[f"{name}.weight_scale"]
        except KeyError as err:
            raise ValueError(f"NVFP4 checkpoint {path} has no tensor {err} for layer {name!r}") from None
        out[name] = replace(ref, data=data, scale=scale, global_scale=decode.reshape(()), amax=None)
    return out


def roundtrip(weights: dict[str, NVFP4Tensor], profile: str) -> dict[str, NVFP4Tensor]:
    """Save to a temporary checkpoint and load back (the engine's view of the converted weights)."""
    if not weights:
        return {}
    device = next(iter(weights.values())).data.device
    with tempfile.TemporaryDirectory() as tmp:
        path = save_nvfp4_checkpoint(weights, Path(tmp) / "model.safetensors", profile)
        return load_nvfp4_checkpoint(path, weights, profile, device)
