"""How one engine computes a model's Linear layers: ``Precision`` and the model conversion it implies.

A ``Precision`` names one point on every axis the seed ablates:

* ``mode``: ``"bf16"`` (the Linear layers as they are, in the path's dtype), ``"w4a16"`` (NVFP4 weights,
  activations unquantized — Hopper vLLM's Marlin path) or ``"w4a4"`` (NVFP4 weights and activations);
* ``act_scale``: the activation outer scale — ``"tensor"`` (one dynamic amax over every token of the call),
  ``"token"`` (one per row: ``QuantRecipe(scale="row")``) or ``"static"`` (a calibrated amax per layer);
* ``weights_from``: ``"online"`` (quantize the master weights in memory) or ``"checkpoint"`` (the offline
  route: cast the master to the checkpoint dtype, quantize with ``checkpoint_profile``, write an NVFP4
  checkpoint, load its codes back — :mod:`.checkpoint`);
* ``fused_scales``: ``"independent"`` (q, k, v, gate, up each get their own weight outer scale) or
  ``"shared"`` (one outer scale per fused group q/k/v and gate/up: the group amax, as a fused QKV weight
  or vLLM's ``max`` over shards gives);
* ``profile``, ``weight_block``: whose quantizer formulas and which weight tiles (``QuantRecipe``).

Conversion (:func:`convert_linears`) replaces the decoder layers' ``nn.Linear`` modules (never ``lm_head``)
in place by a :class:`QuantLinear` (or, for the W4A4 online learner, the kernels' ``NVFP4Linear`` when
available). Both call the same ``triage.kernels.nvfp4`` quantizer and GEMM, so two paths with the same
recipes compute the same numbers. On CPU the backends are pinned to the torch reference quantizer and
the CPU BLAS (never the Triton interpreter); see :class:`QuantLinear`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from triage.kernels.nvfp4 import NVFP4Tensor, QuantRecipe, quantize
from triage.kernels.nvfp4.gemm import gemm, gemm_w4a16

__all__ = [
    "ACT_SCALES",
    "FUSED_GROUPS",
    "MODES",
    "Precision",
    "QuantLinear",
    "activation_recipe",
    "calibrate_activation_amax",
    "convert_linears",
    "decoder_linears",
    "weight_recipe",
]

MODES = ("bf16", "w4a16", "w4a4")
ACT_SCALES = ("tensor", "token", "static")
WEIGHT_SOURCES = ("online", "checkpoint")
FUSED_SCALES = ("independent", "shared")
#: Linear layers that inference engines fuse into one GEMM (one weight, hence one outer scale when shared).
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class Precision:
    """One engine's Linear-layer numerics (see the module docstring for each axis)."""

    mode: str = "bf16"
    act_scale: str = "tensor"
    profile: str = "te"
    weight_block: str = "1x16"
    weights_from: str = "online"
    checkpoint_profile: str = "modelopt"
    checkpoint_dtype: torch.dtype = torch.bfloat16
    fused_scales: str = "independent"
    #: decoder-layer indices to convert (None: all); a partial set plants a mismatch in those layers.
    layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name, allowed in (
            ("mode", MODES),
            ("act_scale", ACT_SCALES),
            ("weights_from", WEIGHT_SOURCES),
            ("fused_scales", FUSED_SCALES),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"Precision.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        # Let QuantRecipe validate profile / block names with its own messages.
        QuantRecipe(profile=self.profile, block=self.weight_block)
        QuantRecipe(profile=self.checkpoint_profile)
        if self.layers is not None and not all(isinstance(i, int) and i >= 0 for i in self.layers):
            raise ValueError(
                f"Precision.layers must be None or non-negative layer indices, got {self.layers!r}"
            )

    @property
    def quantized(self) -> bool:
        return self.mode != "bf16"

    def label(self) -> str:
        """Short description, e.g. ``w4a4 act=token te online``."""
        if not self.quantized:
            return "bf16"
        parts = [self.mode]
        if self.mode == "w4a4":
            parts.append(f"act={self.act_scale}")
        parts.append(self.checkpoint_profile if self.weights_from == "checkpoint" else self.profile)
        parts.append(self.weights_from)
        if self.fused_scales == "shared":
            parts.append("shared-fused")
        return " ".join(parts)


def weight_recipe(precision: Precision, profile: str | None = None, amax: float | None = None) -> QuantRecipe:
    """The weight recipe: per-tensor outer scale, dynamic or (shared fused scales) the group ``amax``."""
    profile = profile or precision.profile
    if amax is None:
        return QuantRecipe(block=precision.weight_block, scale="tensor", profile=profile)
    return QuantRecipe(
        block=precision.weight_block, scale="tensor", scale_source="static", static_amax=amax, profile=profile
    )


def activation_recipe(precision: Precision, amax: float | None = None) -> QuantRecipe | None:
    """The activation recipe (None for bf16 / w4a16). ``amax``: the calibrated amax for ``"static"``."""
    if precision.mode != "w4a4":
        return None
    if precision.act_scale == "token":
        return QuantRecipe(scale="row", profile=precision.profile)
    if precision.act_scale == "static":
        if amax is None:
            raise ValueError("Precision(act_scale='static') needs a calibrated activation amax per layer")
        return QuantRecipe(scale="tensor", scale_source="static", static_amax=amax, profile=precision.profile)
    return QuantRecipe(scale="tensor", profile=precision.profile)


class QuantLinear(nn.Module):
    """``y = x·Ŵᵀ + b`` with a fixed NVFP4 weight Ŵ (codes given at construction, as an engine loads them).

    W4A4 (``input_recipe`` set) quantizes x per call; W4A16 (``input_recipe`` None) uses x as it is. The
    products ``(q·s)_x·(q·s)_w`` are exact; what differs between engines is the accumulation:

    * CUDA: :func:`~triage.kernels.nvfp4.gemm.gemm` / ``gemm_w4a16`` with ``backend="auto"`` (Triton for
      small M, expand + cuBLAS for large M — the reduction order depends on M);
    * CPU: the same expand + GEMM recipe on the CPU BLAS: expand both operands to their exact ``q·s``
      (``NVFP4Tensor.block_values``),
      one fp32 (W4A4) or x-dtype (W4A16) matmul, outer scales in the epilogue (order depends on M, too);
    * ``reference_gemm=True`` (strict alignment): the fp64 reference GEMM, rounded once — batch-invariant.
    """

    def __init__(
        self,
        weight: NVFP4Tensor,
        bias: torch.Tensor | None,
        input_recipe: QuantRecipe | None,
        reference_gemm: bool = False,
    ) -> None:
        super().__init__()
        if len(weight.shape) != 2:
            raise ValueError(f"QuantLinear: weight must be 2-D [out, in], got {tuple(weight.shape)}")
        self.weight_q = weight
        self.out_features, self.in_features = tuple(weight.shape)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.input_recipe = input_recipe
        self.reference_gemm = reference_gemm
        self._expanded: dict[torch.dtype, torch.Tensor] = {}

    def _weight_expanded(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._expanded:
            self._expanded[dtype] = self.weight_q.block_values().to(dtype)[:, : self.in_features]
        return self._expanded[dtype]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"QuantLinear: input has last dim {x.shape[-1]}, expected {self.in_features}")
        lead, k = x.shape[:-1], self.in_features
        x2 = x.reshape(-1, k)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        cuda, strict = x.device.type == "cuda", self.reference_gemm
        half = x.dtype in (torch.bfloat16, torch.float16)
        if self.input_recipe is None:  # W4A16
            if strict:
                w = self.weight_q
                y = x2.double() @ (w.block_values().double() * w.global_scale.double())[:, :k].T
                y = (y if bias is None else y + bias.double()).to(x.dtype)
            elif cuda and half:
                y = gemm_w4a16(x2, self.weight_q, bias=bias, backend="auto")
            else:
                acc = x2.float() @ self._weight_expanded(torch.float32).T
                y = acc * self.weight_q.global_scale.float()
                y = (y if bias is None else y + bias.float()).to(x.dtype)
        else:  # W4A4
            xq = quantize(x2, self.input_recipe, backend="auto" if cuda else "torch")
            if strict or cuda:
                backend = "reference" if strict else "auto"
                y = gemm(xq, self.weight_q, out_dtype=x.dtype, bias=bias, backend=backend)
            else:
                acc = xq.block_values()[:, :k] @ self._weight_expanded(torch.float32).T
                y = acc * xq.global_scale.float().reshape(-1, 1) * self.weight_q.global_scale.float()
                y = (y if bias is None else y + bias.float()).to(x.dtype)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        mode = "w4a16" if self.input_recipe is None else f"w4a4 act={self.input_recipe.scale}"
        return (
            f"in={self.in_features}, out={self.out_features}, {mode}, weight={self.weight_q.recipe.profile}"
        )


def decoder_linears(model: nn.Module) -> list[tuple[str, int, nn.Linear]]:
    """``(qualified name, decoder layer index, module)`` of every ``nn.Linear`` inside a decoder layer."""
    out = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and not isinstance(module, QuantLinear):
            m = _LAYER_RE.search(name)
            if m:
                out.append((name, int(m.group(1)), module))
    return out


@torch.no_grad()
def calibrate_activation_amax(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
) -> dict[str, float]:
    """Static activation amax of every decoder Linear: max |input| over one forward of the batch."""
    amax: dict[str, float] = {}
    handles = []
    for name, _, module in decoder_linears(model):

        def hook(mod, args, name=name):
            value = float(args[0].detach().abs().amax())
            amax[name] = max(amax.get(name, 0.0), value)

        handles.append(module.register_forward_pre_hook(hook))
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    bad = [n for n, v in amax.items() if not (v > 0 and v < float("inf"))]
    if bad:
        raise ValueError(f"calibration gave a non-positive or non-finite activation amax for {bad[:3]}")
    return amax


def _group_key(name: str) -> tuple[str, int] | None:
    """(parent module name, fused group index) of a fused-shard Linear, else None."""
    parent, _, leaf = name.rpartition(".")
    for gi, group in enumerate(FUSED_GROUPS):
        if leaf in group:
            return parent, gi
    return None


def _quantized_weights(
    model: nn.Module,
    targets: list[tuple[str, int, nn.Linear]],
    precision: Precision,
    master: nn.Module | None,
) -> dict[str, NVFP4Tensor]:
    """NVFP4 weight of every target, online or through an NVFP4 checkpoint, with independent or shared
    outer scales. Weights are taken from ``master`` (same module names; default ``model``)."""
    source = dict(master.named_modules()) if master is not None else dict(model.named_modules())
    qb = "auto" if next(model.parameters()).device.type == "cuda" else "torch"
    weights = {name: source[name].weight.detach() for name, _, _ in targets}
    if precision.weights_from == "checkpoint":
        weights = {n: w.to(precision.checkpoint_dtype) for n, w in weights.items()}
    profile = precision.checkpoint_profile if precision.weights_from == "checkpoint" else precision.profile
    group_amax: dict[tuple[str, int], float] = {}
    if precision.fused_scales == "shared":
        for name, w in weights.items():
            key = _group_key(name)
            if key is not None:
                group_amax[key] = max(group_amax.get(key, 0.0), float(w.float().abs().amax()))
    out = {}
    for name, w in weights.items():
        key = _group_key(name)
        amax = group_amax.get(key) if key is not None else None
        out[name] = quantize(w, weight_recipe(precision, profile, amax), backend=qb)
    if precision.weights_from == "checkpoint":
        from .checkpoint import roundtrip

        out = roundtrip(out, profile)
    return out


def convert_linears(
    model: nn.Module,
    precision: Precision,
    calibration: dict[str, float] | None = None,
    master: nn.Module | None = None,
    learner: bool = False,
) -> nn.Module:
    """Replace (in place) the decoder Linear layers of ``model`` as ``precision`` says; returns ``model``.

    ``calibration``: per-layer activation amax (``act_scale="static"``); ``master``: the model whose
    weights are quantized (default ``model``; pass the fp32 master when ``model`` is a bf16 copy).
    ``learner=True`` with online W4A4 uses the trainer's own ``triage.kernels.NVFP4Linear`` (sharing the
    master's weight, quantized by the layer's cache, as in training); everything else a :class:`QuantLinear`.
    """
    if not precision.quantized:
        return model
    targets = [t for t in decoder_linears(model) if precision.layers is None or t[1] in set(precision.layers)]
    if not targets:
        raise ValueError(
            f"convert_linears: no decoder nn.Linear matched (layers={precision.layers!r}); is this a "
            "decoder model with `.layers.<i>.` module names?"
        )
    for name, _, module in targets:
        if module.in_features % 16:
            raise ValueError(
                f"convert_linears: layer {name!r} has in_features={module.in_features}, not a multiple of 16"
            )
    if precision.act_scale == "static" and precision.mode == "w4a4":
        missing = [n for n, _, _ in targets if calibration is None or n not in calibration]
        if missing:
            raise ValueError(f"act_scale='static' needs a calibrated amax for {missing[:3]} (calibration=)")
    if learner and precision.mode == "w4a4" and precision.weights_from == "online":
        return _convert_learner(model, targets, precision, calibration, master)
    qweights = _quantized_weights(model, targets, precision, master)
    for name, _, module in targets:
        amax = calibration.get(name) if calibration else None
        new = QuantLinear(qweights[name], module.bias, activation_recipe(precision, amax))
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
    return model


def _convert_learner(model, targets, precision: Precision, calibration, master) -> nn.Module:
    """Online W4A4 learner: ``NVFP4Linear`` layers over the master's (fp32) weights, one config per layer."""
    from triage.kernels.linear import NVFP4Linear, NVFP4LinearConfig

    source = dict((master or model).named_modules())
    cuda = next(model.parameters()).device.type == "cuda"
    group_amax: dict[tuple[str, int], float] = {}
    if precision.fused_scales == "shared":
        for name, _, _ in targets:
            key = _group_key(name)
            if key is not None:
                amax = float(source[name].weight.detach().float().abs().amax())
                group_amax[key] = max(group_amax.get(key, 0.0), amax)
    for name, _, _ in targets:
        key = _group_key(name)
        config = NVFP4LinearConfig(
            input_recipe=activation_recipe(precision, calibration.get(name) if calibration else None),
            weight_recipe=weight_recipe(precision, amax=group_amax.get(key) if key is not None else None),
            gemm_backend="auto" if cuda else "reference",
            quant_backend="auto" if cuda else "torch",
        )
        new = NVFP4Linear.from_linear(source[name], config)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
    return model
