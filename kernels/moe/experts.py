"""NVFP4 MoE experts for Qwen3-MoE (transformers 5.x), installed by :func:`triage.kernels.convert`.

In transformers 5.x, ``Qwen3MoeSparseMoeBlock`` holds a router ``gate`` (``Qwen3MoeTopKRouter``, a plain
[E, H] parameter) and ``experts`` (``Qwen3MoeExperts``): fused 3-D parameters ``gate_up_proj`` [E, 2I, H]
and ``down_proj`` [E, H, I], called as ``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``.
:func:`~triage.kernels.convert` swaps every such experts module for :class:`NVFP4MoeExperts`, which keeps the
same parameters (same names, same tensors: optimizers and state dicts are unaffected) and computes

    rows sorted by expert → NVFP4 grouped GEMM (gate_up) → SiLU(gate)·up → NVFP4 grouped GEMM (down)
    → × routing weight → scatter-add back to tokens.

The router stays in high precision (untouched). Activations are quantized once per token before the top-k
gather (one per-tensor amax shared by every expert that reads them), weights once per optimizer step
(cached on :func:`~triage.kernels.linear.weight_key`: the optimizer-step generation, the parameter's version
and storage; any ``torch.optim`` optimizer, fused ones included, invalidates it). A NaN or ±Inf in an
operand the layer quantizes makes the output (or gradient) NaN, as in ``NVFP4Linear``. Backward, straight-through: ``"bf16-backward"`` (default, as the dense
``NVFP4Linear``) uses the original high-precision activations and master weights; ``"dequantized"`` (TE's
``backward_override="dequantized"``) the NVFP4-dequantized operands the forward used. Both run bf16 grouped
matmuls with fp32 accumulation. ``"nvfp4-backward"`` mirrors the dense layer's TE-style mode: dgrad
``dx[r] = Q(dy)[r] · Q(W_e)`` on the grouped NVFP4 GEMM, with ``dy`` quantized 1×16 (stochastic, one
per-tensor amax for all experts) and ``Q(W_e)ᵀ`` the forward's 16×16-block quantization transposed per expert
(exact reuse, so the weight recipe must use ``block="16x16"``); wgrad ``dW_e = Q_H(dy_eᵀ)·Q_H(x_eᵀ)`` with
the Hadamard transform and 1×16 blocks along the tokens, all experts at once:

1. the sorted rows go to a padded token layout (:func:`~.grouped_gemm.padded_segments`): expert e's
   segment starts at a multiple of 16 (exclusive cumsum of ``ceil16(n_e)``), zeros between segments and in
   the unused tail, static length ``ceil16(T + 15·E)`` (no host read of the offsets);
2. ``dyᵀ`` [N, L] and ``x_rowsᵀ`` [K, L] are quantized ONCE each with ``wgrad`` (``dy``: the recipe's
   rounding, stochastic by default, one seed; ``x``: always nearest, as the dense layer), on CUDA (and
   under the Triton interpreter, unless ``backend="reference"``) straight from the sorted rows of ``dy`` / the tokens of ``x`` by
   :func:`~triage.kernels.nvfp4.quantize_columns.quantize_columnwise` (the layout, the top-k gather and the
   transpose happen inside the quantizer: nothing [L, C] is written; byte-identical to quantizing the
   materialized transposed layout, which the plain-CPU path still does). No 16-block
   straddles two experts, so every block (Hadamard rotation, block scale, codes) is the one a per-expert
   quantization of the zero-padded ``dy_eᵀ`` / ``x_eᵀ`` would give — except the outer scale: ONE amax per
   operand over all experts (as the dgrad's ``dy`` already has), not one per expert;
3. one grouped ragged-K launch (:func:`~.grouped_gemm.grouped_wgrad`) computes every ``dW_e`` over its
   padded segment (fp32 accumulation, outer scales in an fp32 epilogue; an expert without tokens gets 0).

A constant number of launches per backward, no host sync per expert.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch
from torch import nn

from triage.kernels.linear import nan_if_nonfinite, transpose_16x16, weight_key
from triage.kernels.nvfp4.api import dequantize, quantize
from triage.kernels.nvfp4.recipe import LayerConfig, QuantRecipe
from triage.kernels.nvfp4.tensor import NVFP4Tensor

from .grouped_gemm import (
    check_offsets,
    expand_experts,
    grouped_gemm,
    grouped_mm,
    grouped_wgrad,
    offsets_from_expert_ids,
    pad_segments,
    padded_segments,
)

#: The dense layer's backward settings plus ``"dequantized"`` (module docstring).
MOE_BACKWARD_MODES = ("bf16-backward", "dequantized", "nvfp4-backward")


@dataclass(frozen=True)
class NVFP4MoEConfig(LayerConfig):
    """How :class:`NVFP4MoeExperts` quantize and differentiate (the fields of
    :class:`~triage.kernels.NVFP4LinearConfig`, plus ``validate``).

    Attributes:
        activation: recipe of the expert inputs (per-tensor dynamic amax by default).
        weight: recipe of the expert weights (``scale="expert"``: one outer scale per expert).
        grad: recipe of ``dy`` for the nvfp4-backward dgrad (1×16, stochastic).
        wgrad: recipe of both wgrad operands (``dyᵀ``, ``xᵀ``) in nvfp4-backward: Hadamard, 1×16 along
            tokens, each expert's segment padded to 16; ``xᵀ`` always rounds to nearest (as the dense
            layer). Each operand is quantized once for all experts, so its outer scale (``scale="tensor"``:
            one amax; ``"row"``: one per row) spans every expert's tokens, not one expert's.
        backward: ``"bf16-backward"`` (master operands), ``"dequantized"`` (the forward's NVFP4 operands) or
            ``"nvfp4-backward"`` (quantized dgrad and wgrad; needs ``weight.block="16x16"``).
        gemm_backend: grouped-GEMM backend (see :func:`~triage.kernels.moe.grouped_gemm.grouped_gemm`).
        quant_backend: passed to :func:`~triage.kernels.nvfp4.quantize` (``"auto"``: Triton on CUDA, the
            byte-identical torch reference elsewhere).
        validate: check expert ids (one host sync per layer call); :func:`grouped_nvfp4_linear` checks its
            ``offsets`` and ``gather`` instead.
    """

    backward_modes: ClassVar[tuple[str, ...]] = MOE_BACKWARD_MODES

    weight: QuantRecipe = field(default_factory=lambda: QuantRecipe(scale="expert"))
    validate: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.weight.scale == "row" and self.weight.block == "16x16":
            raise ValueError("NVFP4MoEConfig.weight: 16x16 blocks cannot have per-row scales")
        if self.backward == "nvfp4-backward":
            if self.weight.block != "16x16" or self.weight.scale not in ("expert", "tensor", "none"):
                raise ValueError(
                    "NVFP4MoEConfig: backward='nvfp4-backward' reuses each expert's W_q for W_eᵀ, which needs "
                    "weight=QuantRecipe(scale='expert', block='16x16') (got "
                    f"block={self.weight.block!r}, scale={self.weight.scale!r})"
                )
            if self.grad.hadamard:
                raise ValueError("NVFP4MoEConfig.grad (dgrad dy) cannot use Hadamard: W_qᵀ did not")
            if self.grad.scale == "expert" or self.wgrad.scale == "expert":
                raise ValueError("NVFP4MoEConfig.grad/wgrad: per-expert outer scales do not apply to dy or x")


def _gather_rows(t: NVFP4Tensor, idx: torch.Tensor | None) -> NVFP4Tensor:
    """Rows ``idx`` of a 2-D NVFP4 tensor (codes, block scales and per-row outer scales move together)."""
    if idx is None:
        return t
    g = t.global_scale
    return NVFP4Tensor(
        data=t.data[idx],
        scale=t.scale[idx],
        global_scale=g[idx] if g.numel() > 1 else g,
        recipe=t.recipe,
        shape=torch.Size((idx.numel(), t.shape[-1])),
        dtype=t.dtype,
        global_encode_scale=t.global_encode_scale,
        amax=t.amax,
    )


class _QuantizedWeight:
    """One quantization of one expert weight: ``wq``, its exact bf16 expansion (or None) and, built on first
    use, the per-expert ``W_qᵀ`` of the nvfp4-backward dgrad."""

    def __init__(self, wq: NVFP4Tensor, expanded: torch.Tensor | None) -> None:
        self.wq, self.expanded = wq, expanded
        self._transposed: NVFP4Tensor | None = None

    def transposed(self) -> NVFP4Tensor:
        if self._transposed is None:
            self._transposed = transpose_16x16(self.wq)
        return self._transposed


class _WeightCache:
    """The :class:`_QuantizedWeight` of one parameter, valid while its :func:`~triage.kernels.linear.weight_key`
    (optimizer-step generation, version, storage, dtype, shape, device) is unchanged."""

    def __init__(self) -> None:
        self.backwards = 0  # nvfp4-backward calls: seeds the stochastic rounding (kept by clear())
        self.clear()

    def clear(self) -> None:
        self.key = None
        self.source: torch.Tensor | None = None
        self.entry: _QuantizedWeight | None = None

    def get(
        self, weight: torch.Tensor, recipe: QuantRecipe, expanded: bool, backend: str
    ) -> _QuantizedWeight:
        key = (*weight_key(weight), recipe, expanded)
        if key != self.key:
            w = weight.detach()
            wq = nan_if_nonfinite(quantize(w, recipe, backend=backend), w)
            self.entry = _QuantizedWeight(wq, expand_experts(wq, torch.bfloat16) if expanded else None)
            self.key = key
            # keeps the keyed storage alive, so its address (in the key) cannot be reused by a new weight
            # while this entry is cached; a reference to the master weight, not a copy (an old weight
            # replaced through ``param.data`` stays allocated until the next forward)
            self.source = w
        return self.entry


class _GroupedNVFP4Linear(torch.autograd.Function):
    """``y[r] = Q(x)[gather[r]] · Q(W)[e(r)]ᵀ`` for rows r sorted by expert (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, gather, offsets, cfg, cache):
        triton_expanded = cfg.gemm_backend == "triton_expanded" or (
            cfg.gemm_backend == "auto" and _auto_backend(x) == "triton_expanded"
        )
        # tokens quantized once (before the top-k gather); their exact q·s written in the same pass
        xd = x.detach()
        emit = torch.bfloat16 if triton_expanded else None
        xq = nan_if_nonfinite(quantize(xd, cfg.activation, backend=cfg.quant_backend, emit_expanded=emit), xd)
        entry = cache.get(weight, cfg.weight, triton_expanded, cfg.quant_backend)
        wq, w_exp = entry.wq, entry.expanded
        y = grouped_gemm(
            xq,
            wq,
            offsets,
            out_dtype=x.dtype,
            backend=cfg.gemm_backend,
            w_expanded=w_exp,
            a_rows=gather,
            validate=False,
        )
        ctx.cfg = cfg
        ctx.x_shape = x.shape
        ctx.cache = cache
        ctx.weight = entry  # the forward's quantization, whatever the cache holds by the backward
        if cfg.backward == "nvfp4-backward":
            ctx.quantized = None
            ctx.save_for_backward(gather, offsets, x, weight)
        elif cfg.backward == "dequantized":
            ctx.quantized = (_gather_rows(xq, gather), wq)
            ctx.save_for_backward(gather, offsets)
        else:
            ctx.quantized = None
            ctx.save_for_backward(gather, offsets, x, weight)
        return y

    @staticmethod
    def backward(ctx, dy):
        if ctx.cfg.backward == "nvfp4-backward":
            return _nvfp4_backward(ctx, dy)
        saved = ctx.saved_tensors  # unpacked once: non-reentrant gradient checkpointing allows only one
        gather, offsets = saved[:2]
        dtype = dy.dtype
        if ctx.quantized is not None:
            a, wq = ctx.quantized
            x_rows, w = (
                dequantize(a, dtype, backend=ctx.cfg.quant_backend),
                dequantize(wq, dtype, backend=ctx.cfg.quant_backend),
            )
        else:
            x, w = saved[2], saved[3].to(dtype)
            x_rows = x[gather] if gather is not None else x
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx_rows = grouped_mm(dy, w.contiguous(), offsets, trans_b=True)  # dy[rows e] · W[e]
            if gather is None:
                dx = dx_rows
            else:
                dx = dy.new_zeros(ctx.x_shape).index_add_(0, gather, dx_rows)
        if ctx.needs_input_grad[1]:
            dw = grouped_mm(dy.t(), x_rows.to(dtype).contiguous(), offsets)  # dy[rows e]ᵀ · x[rows e]
        return dx, dw, None, None, None, None


def _nvfp4_backward(ctx, dy):
    """dgrad on the grouped NVFP4 GEMM with the transposed forward weights; grouped wgrad (module doc)."""
    gather, offsets, x, weight = ctx.saved_tensors
    cfg, cache = ctx.cfg, ctx.cache
    cache.backwards += 1
    seed = (cfg.grad.seed + 1000003 * cache.backwards) % 2**32
    dtype = dy.dtype
    dy = dy.contiguous()
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dyq = nan_if_nonfinite(quantize(dy, cfg.grad, backend=cfg.quant_backend, seed=seed), dy)
        dx_rows = grouped_gemm(
            dyq, ctx.weight.transposed(), offsets, out_dtype=dtype, backend=cfg.gemm_backend, validate=False
        )
        dx = dx_rows if gather is None else dy.new_zeros(ctx.x_shape).index_add_(0, gather, dx_rows)
    if ctx.needs_input_grad[1]:
        w_seed = (seed + 1) % 2**32  # not the dgrad's seed
        out_dtype = weight.dtype if weight.dtype in (torch.float32, torch.bfloat16, torch.float16) else None
        dw = nvfp4_wgrad(
            dy, x.to(dtype), offsets, cfg, w_seed, gather=gather, out_dtype=out_dtype or torch.float32
        )
        dw = dw if out_dtype else dw.to(weight.dtype)
    return dx, dw, None, None, None, None


def nvfp4_wgrad(
    dy: torch.Tensor,
    x: torch.Tensor,
    offsets: torch.Tensor,
    cfg: NVFP4MoEConfig,
    seed: int,
    *,
    gather: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """nvfp4-backward weight gradient [E, N, K] of all experts: 2 columnwise quantizations into the padded
    token layout → 1 grouped launch (module docstring). ``dy`` [R, N] rows sorted by expert, ``x`` [T, K]
    (row r reads ``x[gather[r]]``) or [R, K] without ``gather``; ``seed`` seeds ``dy``'s stochastic
    rounding (one seed for every expert)."""
    rows = dy.shape[0]
    padded, dest, length = padded_segments(offsets, rows)
    # operands for the chosen backend: expansions written by the quantizer in the same pass
    expanded = cfg.gemm_backend in ("triton_expanded", "grouped_mm") or (
        cfg.gemm_backend == "auto" and _auto_backend(dy) in ("triton_expanded", "grouped_mm")
    )
    emit = torch.bfloat16 if expanded else None
    x_recipe = replace(cfg.wgrad, rounding="nearest")
    from triage.kernels.nvfp4.device import interpreting

    # CUDA (or the interpreter, unless the reference GEMM was asked for): straight from the sorted rows,
    # byte-identical to the materialized path of the else branch
    if dy.is_cuda or (interpreting() and cfg.gemm_backend != "reference"):
        from triage.kernels.nvfp4.quantize_columns import quantize_columnwise

        dyq = quantize_columnwise(
            dy, cfg.wgrad, seed=seed, dest=dest, length=length, emit_expanded=emit, backend="triton"
        )  # [N, L]
        xq = quantize_columnwise(
            x, x_recipe, gather=gather, dest=dest, length=length, emit_expanded=emit, backend="triton"
        )  # [K, L]
    else:  # the reference path: the padded layout materialized and transposed
        dyt = pad_segments(dy, dest, length).t().contiguous()  # [N, L]
        xt = pad_segments(x, dest, length, gather).t().contiguous()  # [K, L]
        dyq = quantize(dyt, cfg.wgrad, backend=cfg.quant_backend, seed=seed, emit_expanded=emit)
        xq = quantize(xt, x_recipe, backend=cfg.quant_backend, emit_expanded=emit)
    dyq, xq = nan_if_nonfinite(dyq, dy), nan_if_nonfinite(xq, x)  # NaN/Inf in dy or x: NaN dW (linear.py)
    return grouped_wgrad(dyq, xq, padded, out_dtype=out_dtype, backend=cfg.gemm_backend, validate=False)


def _auto_backend(x: torch.Tensor) -> str:
    from triage.kernels.nvfp4.device import triton_runs_on

    from .grouped_gemm import LARGE_BACKEND

    return LARGE_BACKEND if triton_runs_on(x.device) else "reference"


def grouped_nvfp4_linear(x, weight, offsets, cfg: NVFP4MoEConfig, gather=None, cache=None) -> torch.Tensor:
    """Differentiable grouped NVFP4 linear: rows ``x[gather]`` (or ``x``) sorted by expert, ``weight``
    [E, N, K] (high-precision master), ``offsets`` [E+1]. Returns [rows, N] in x's dtype.

    With ``cfg.validate``, ``gather`` (entries in [0, T)) and ``offsets`` (E+1 bounds from 0 to the routed
    row count, never decreasing) are checked first (host syncs)."""
    if cfg.validate:
        _check_routing(x, weight, offsets, gather)
    return _GroupedNVFP4Linear.apply(x, weight, gather, offsets, cfg, cache or _WeightCache())


def _check_routing(x, weight, offsets, gather) -> None:
    rows = x.shape[0]
    if gather is not None:
        if gather.dim() != 1 or gather.dtype.is_floating_point or gather.dtype == torch.bool:
            raise TypeError(f"gather must be a 1-D integer tensor, got {gather.dtype} {tuple(gather.shape)}")
        if bool(((gather < 0) | (gather >= x.shape[0])).any()):
            raise ValueError(f"gather has entries outside [0, {x.shape[0]}) (rows of x)")
        rows = gather.numel()
    check_offsets(offsets, rows, weight.shape[0])


def is_fused_experts(module: nn.Module) -> bool:
    """A transformers-5 fused experts module: 3-D ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]."""
    gu, dn = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (
        isinstance(gu, torch.Tensor)
        and isinstance(dn, torch.Tensor)
        and gu.dim() == 3
        and dn.dim() == 3
        and hasattr(module, "num_experts")
        and gu.shape[0] == dn.shape[0] == module.num_experts
    )


class NVFP4MoeExperts(nn.Module):
    """Drop-in NVFP4 replacement of transformers' ``Qwen3MoeExperts`` (same parameters, same call)."""

    def __init__(self, experts: nn.Module, config: NVFP4MoEConfig | None = None) -> None:
        super().__init__()
        self.config = config or NVFP4MoEConfig()
        if not is_fused_experts(experts):
            raise TypeError(
                f"NVFP4MoeExperts replaces a fused experts module (3-D gate_up_proj [E, 2I, H] and down_proj "
                f"[E, H, I], num_experts = E), got {type(experts).__name__}"
            )
        for pname in ("gate_up_proj", "down_proj"):
            kdim = getattr(experts, pname).shape[-1]
            if kdim % 16 and not self.config.weight.pad:
                raise ValueError(
                    f"NVFP4MoeExperts: {pname} has K={kdim}, not a multiple of 16 (the NVFP4 block size)"
                )
        self.num_experts = experts.num_experts
        self.hidden_dim = experts.hidden_dim
        self.intermediate_dim = experts.intermediate_dim
        self.gate_up_proj = experts.gate_up_proj
        self.down_proj = experts.down_proj
        self.act_fn = experts.act_fn
        self._caches = (_WeightCache(), _WeightCache())
        # the replaced module, unregistered (its parameters are the ones above): to_experts() puts it back
        object.__setattr__(self, "_replaced", experts)

    def to_experts(self) -> nn.Module:
        """The original (high-precision) experts module, holding this module's current parameters."""
        original = self._replaced
        original.gate_up_proj, original.down_proj = self.gate_up_proj, self.down_proj
        return original

    def invalidate_cache(self) -> None:
        """Drop the cached quantized weights (the stochastic-rounding call counters are kept)."""
        for cache in self._caches:
            cache.clear()

    def _graph_key(self) -> tuple:
        """What a captured CUDA graph of this module's forward reads beside its parameters
        (:func:`~triage.kernels.capture.graph_key`): the config and the cached quantized weights, named by the
        weight keys they were quantized under and the weights' current keys (any weight change changes it:
        the caches quantize into new tensors)."""
        from triage.kernels.linear import weight_key

        weights = (weight_key(self.gate_up_proj), weight_key(self.down_proj))
        return (self.config, *weights, *(cache.key for cache in self._caches))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        cfg = self.config
        hidden = self.gate_up_proj.shape[-1]
        if hidden_states.dim() != 2 or hidden_states.shape[1] != hidden:
            raise ValueError(
                f"NVFP4MoeExperts: hidden_states must be [T, {hidden}], got {tuple(hidden_states.shape)}"
            )
        if top_k_index.dim() != 2 or top_k_index.shape[0] != hidden_states.shape[0]:
            raise ValueError(
                f"NVFP4MoeExperts: top_k_index must be [T, k] with T = {hidden_states.shape[0]} (the rows of "
                f"hidden_states), got {tuple(top_k_index.shape)}"
            )
        if top_k_weights.shape != top_k_index.shape:
            raise ValueError(
                f"NVFP4MoeExperts: top_k_weights must have top_k_index's shape {tuple(top_k_index.shape)}, "
                f"got {tuple(top_k_weights.shape)}"
            )
        if hidden_states.shape[0] == 0:
            # no tokens (nn.Linear's rule; the quantizer needs data): an empty [0, H] output, still connected
            # to the inputs and the expert weights so that backward gives them zero gradients
            dtype = hidden_states.dtype
            gate, up = nn.functional.linear(hidden_states, self.gate_up_proj[0].to(dtype)).chunk(2, dim=-1)
            out = nn.functional.linear(self.act_fn(gate) * up, self.down_proj[0].to(dtype))
            return out * top_k_weights.sum(-1, keepdim=True).to(dtype)
        k = top_k_index.shape[-1]
        order, offsets = offsets_from_expert_ids(top_k_index, self.num_experts, validate=cfg.validate)
        token = order // k
        # offsets and token come from the checked ids: no second validation (grouped_nvfp4_linear's)
        gate_up = _GroupedNVFP4Linear.apply(
            hidden_states, self.gate_up_proj, token, offsets, cfg, self._caches[0]
        )
        gate, up = gate_up.chunk(2, dim=-1)
        h = self.act_fn(gate) * up
        out = _GroupedNVFP4Linear.apply(h, self.down_proj, None, offsets, cfg, self._caches[1])
        out = out * top_k_weights.reshape(-1)[order, None].to(out.dtype)
        final = torch.zeros_like(hidden_states)
        return final.index_add_(0, token, out.to(final.dtype))

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"num_experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, "
            f"backward={c.backward!r}, gemm_backend={c.gemm_backend!r}"
        )
