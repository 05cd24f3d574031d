"""Strict alignment: make a full-sequence forward and an incremental decode compute the same per-token math.

A learner scores a response with one forward over all its tokens (GEMMs with M = B·T rows, causal
attention over T queries); a sampler scores it one token at a time against a KV cache (M = B rows, one
query per step). With ordinary kernels the reduction order of a GEMM, a norm or an attention row depends
on M and on the sequence length, so the two engines round differently and δ ≠ 0 even in fp32 — and a
4-bit activation quantizer turns a one-ulp difference into a different code now and then.

``strict_alignment(model)`` installs batch-invariant versions of every reduction, in place, until exit:

* Linear (``nn.Linear``): ``y = RN_dtype(Σ_k x_k·w_k)`` accumulated in fp64. Each product of fp32 (or
  bf16) operands is exact in fp64 and the fp64 sum is rounded once to the model dtype, so the result does
  not depend on the summation order (up to an fp64-ulp tie at an fp32 rounding boundary, probability
  ~K·2⁻²⁹ per output). The kernels' NVFP4 layers (``NVFP4Linear``, ``FrozenNVFP4Linear``) switch to the
  fp64 reference GEMM; a weight-only ``FrozenNVFP4Linear`` computes ``x·Ŵᵀ`` in fp64 for every activation
  dtype (its own fp32-activation path is an fp32 matmul, and the reference GEMM takes bf16/fp16 only).
* Attention: registered as ``attn_implementation="triage_strict"``: scores, softmax and the weighted sum of
  values in fp64 per query row; masked keys contribute exact zeros, so a query sees the same sum whether
  the keys come from a full causal block or from a cache.
* RMSNorm (every module named ``*RMSNorm``): the mean of squares in fp64.
* Rotary embeddings: cos/sin computed in fp64 from the position, then rounded.

Log-softmax is a per-row op in both paths (the built-in sampler and the learner call the same
``torch.log_softmax`` on an fp32 row), so it needs no change. What strict mode cannot remove is a
*recipe* difference: the two paths must quantize with the same recipe, and activation outer scales must
be per token or static (a tensor-wide amax depends on which tokens share the call — see
:func:`check_strict_pair`). The cost: fp64 GEMMs (measured by ``triage diagnose`` and the H200 bench).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from dataclasses import replace

import torch
from torch import nn

from triage.kernels.frozen_linear import FrozenNVFP4Linear
from triage.kernels.linear import NVFP4Linear

from .precision import Precision

__all__ = ["STRICT_ATTENTION", "check_strict_pair", "strict_alignment", "strict_attention_forward"]

STRICT_ATTENTION = "triage_strict"


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


def strict_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
):
    """Eager attention in fp64: ``softmax(q·kᵀ·scaling + mask)·v`` per query row, rounded once."""
    groups = query.shape[1] // key.shape[1]
    k = _repeat_kv(key, groups).double()
    v = _repeat_kv(value, groups).double()
    scores = torch.matmul(query.double(), k.transpose(2, 3)) * scaling
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask[..., : k.shape[-2]], float("-inf"))
        else:
            scores = scores + attention_mask[..., : k.shape[-2]].double()
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # a fully masked (padding) query row
    out = torch.matmul(probs, v).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


def _register_attention() -> None:
    """Register the fp64 attention and its mask builder (both interfaces exist in transformers 5.17 and 5.24).

    Without a registered mask function, transformers' mask preprocessing returns NO mask for an unknown
    ``attn_implementation``: the attention would silently see every key. So a transformers lacking
    ``AttentionMaskInterface`` is refused rather than run."""
    from transformers import AttentionInterface

    try:
        from transformers.masking_utils import AttentionMaskInterface, eager_mask
    except ImportError as err:
        import transformers

        raise RuntimeError(
            f"strict_alignment needs transformers.masking_utils.AttentionMaskInterface (transformers "
            f"{transformers.__version__} has none; 5.17 and 5.24 do): a custom attention would get no causal mask"
        ) from err
    AttentionInterface.register(STRICT_ATTENTION, strict_attention_forward)
    AttentionMaskInterface.register(STRICT_ATTENTION, eager_mask)


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    bias = None if self.bias is None else self.bias.double()
    return nn.functional.linear(x.double(), self.weight.double(), bias).to(x.dtype)


def _frozen_w4a16_forward(self: FrozenNVFP4Linear, x: torch.Tensor) -> torch.Tensor:
    """``x·Ŵᵀ + b`` in fp64 (``Ŵ = q·s·g``: exact products in fp64), rounded once to x's dtype."""
    w = self.quantized_weight()
    what = w.block_values().double() * w.global_scale.double().reshape(-1, 1)
    bias = None if self.bias is None else self.bias.double()
    return nn.functional.linear(x.double(), what[:, : self.in_features], bias).to(x.dtype)


def _rmsnorm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    dtype = hidden_states.dtype
    h = hidden_states.double()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * h.to(torch.float32).to(dtype)


def _rotary_forward(self: nn.Module, x: torch.Tensor, position_ids: torch.Tensor):
    freqs = position_ids[..., None].double() * self.inv_freq.to(device=x.device).double()
    emb = torch.cat((freqs, freqs), dim=-1)
    scale = float(getattr(self, "attention_scaling", 1.0))
    return (emb.cos() * scale).to(x.dtype), (emb.sin() * scale).to(x.dtype)


def _patch(module: nn.Module, fn, undo: list) -> None:
    had = "forward" in module.__dict__
    old = module.__dict__.get("forward")
    module.forward = types.MethodType(fn, module)
    undo.append(lambda: setattr(module, "forward", old) if had else module.__dict__.pop("forward", None))


@contextlib.contextmanager
def strict_alignment(model: nn.Module) -> Iterator[nn.Module]:
    """Batch-invariant numerics on ``model`` (in place) inside the ``with`` block; restored on exit."""
    _register_attention()
    undo: list = []
    config = model.config
    old_attn = config._attn_implementation
    try:
        for module in model.modules():
            name = type(module).__name__
            if type(module) is nn.Linear:
                _patch(module, _linear_forward, undo)
            elif isinstance(module, FrozenNVFP4Linear) and module.config.compute == "w4a16":
                _patch(module, _frozen_w4a16_forward, undo)
            elif isinstance(module, (NVFP4Linear, FrozenNVFP4Linear)):
                old_cfg = module.config
                module.config = replace(old_cfg, gemm_backend="reference")
                undo.append(lambda m=module, c=old_cfg: setattr(m, "config", c))
            elif name.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
                _patch(module, _rmsnorm_forward, undo)
            elif name.endswith("RotaryEmbedding") and hasattr(module, "inv_freq"):
                if getattr(module, "rope_type", "default") != "default":
                    raise ValueError(f"strict_alignment: rope_type={module.rope_type!r} is not supported")
                _patch(module, _rotary_forward, undo)
        config._attn_implementation = STRICT_ATTENTION
        for sub in model.modules():  # sub-configs (text config of a multimodal model)
            cfg = getattr(sub, "config", None)
            if cfg is not None and cfg is not config and hasattr(cfg, "_attn_implementation"):
                undo.append(lambda c=cfg, a=cfg._attn_implementation: setattr(c, "_attn_implementation", a))
                cfg._attn_implementation = STRICT_ATTENTION
        yield model
    finally:
        config._attn_implementation = old_attn
        for fn in reversed(undo):
            fn()


def check_strict_pair(learner: Precision, sampler: Precision, kv_cache: str = "native") -> None:
    """Raise ``ValueError`` (naming the field) unless strict alignment can make the pair agree: the same
    recipe on both sides, activation outer scales per token or static, and the sampler's KV cache in the
    model dtype."""
    fields = (
        "mode",
        "act_scale",
        "profile",
        "weight_block",
        "weights_from",
        "checkpoint_profile",
        "fused_scales",
    )
    for f in fields:
        a, b = getattr(learner, f), getattr(sampler, f)
        if a != b:
            raise ValueError(f"strict alignment needs the same recipe on both paths: {f} is {a!r} vs {b!r}")
    if learner.layers != sampler.layers:
        raise ValueError(f"strict alignment: converted layers differ ({learner.layers} vs {sampler.layers})")
    if learner.mode == "w4a4" and learner.act_scale == "tensor":
        raise ValueError(
            "strict alignment: act_scale='tensor' makes a token's activation codes depend on the other tokens "
            "of the call (context dependence); use act_scale='token' or 'static'"
        )
    if kv_cache != "native":
        raise ValueError(f"strict alignment: the sampler's KV cache must be 'native', got {kv_cache!r}")
