"""Sampler KV-cache precision: a ``transformers`` cache that stores keys and values in FP8 (or bf16).

An inference engine with an FP8 KV cache writes every key/value it computes through ``float8_e4m3fn``
with a scale and reads them back for attention; the learner's full-sequence forward never does. This
emulation rounds every stored state:

    k̂ = clamp(k / s_k, ±448) → e4m3 → · s_k      (likewise v; s = amax / 448)

with the scale ``s`` calibrated on the first ``update`` (the prefill) and then frozen, one per layer and
``granularity``: ``"tensor"`` (one scale for K, one for V) or ``"head"`` (one per KV head). Given the
prefill's ``attention_mask`` (B, T), the amax is taken over its valid positions only (padding is no token).
The states attention sees are the rounded ones, prefill included. ``fmt="bf16"`` rounds through bfloat16
instead (no scale): a bf16 cache under an fp32 model.

Static caches. ``kv_cache(..., max_cache_len=L)`` builds transformers' ``StaticCache`` instead (pre-allocated
(B, H, L, D) buffers written in place, a device-side length counter), whose rounding layers are
:class:`QuantizedStaticKVLayer`: the cache a CUDA-graph decode needs (the built-in sampler's ``decode``).

transformers versions. The cache is transformers' own ``DynamicCache`` (or ``StaticCache``) built from the
model config, with its full-attention ``cache_utils.DynamicLayer`` (``StaticLayer``) layers replaced by
:class:`QuantizedKVLayer` (:class:`QuantizedStaticKVLayer`): the per-layer cache API that transformers 5.17
(the GPU image) and 5.24 share.
What differs between them is the name of the forward argument that takes the cache — ``past_key_values``
(5.17) or ``cache`` (5.24, the old name a deprecated alias) — which :func:`cache_argument` detects from the
model's signature. Layers that are not plain ``DynamicLayer`` (sliding-window, chunked, linear-attention or
KV-sharing layers) are refused by name rather than silently replaced by full-attention ones.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import DynamicLayer, StaticLayer

__all__ = [
    "KV_CACHE_DTYPES",
    "KV_FORMATS",
    "QuantizedKVLayer",
    "QuantizedStaticKVLayer",
    "cache_argument",
    "kv_cache",
    "kv_format",
    "static_cache_refusal",
]

KV_FORMATS = ("native", "bf16", "fp8")
KV_CACHE_DTYPES = ("auto", "native", "bf16", "fp8", "fp8_e4m3")
_KV_FORMAT = {
    None: "native",
    "auto": "native",
    "native": "native",
    "bf16": "bf16",
    "fp8": "fp8",
    "fp8_e4m3": "fp8",
}


def kv_format(kv_cache_dtype: str | None) -> str:
    """A sampler's ``kv_cache_dtype`` (vLLM's names; None: the model's own cache) → the format name of
    :func:`kv_cache` (one of :data:`KV_FORMATS`)."""
    if not (kv_cache_dtype is None or isinstance(kv_cache_dtype, str)) or kv_cache_dtype not in _KV_FORMAT:
        raise ValueError(
            f"kv_cache_dtype must be None or one of {KV_CACHE_DTYPES} (the HF sampler emulates an fp8 e4m3 "
            f"cache only), got {kv_cache_dtype!r}"
        )
    return _KV_FORMAT[kv_cache_dtype]


GRANULARITIES = ("tensor", "head")
_FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


class _RoundedKV:
    """Mixin for a transformers cache layer: keys/values are rounded through ``fmt`` before they are stored
    (see the module docstring); the layer class it is mixed into decides how they are stored."""

    def __init__(
        self,
        fmt: str = "fp8",
        granularity: str = "tensor",
        attention_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if fmt not in ("bf16", "fp8"):
            raise ValueError(f"QuantizedKVLayer: fmt must be 'bf16' or 'fp8', got {fmt!r}")
        if granularity not in GRANULARITIES:
            raise ValueError(
                f"QuantizedKVLayer: granularity must be one of {GRANULARITIES}, got {granularity!r}"
            )
        self.fmt, self.granularity = fmt, granularity
        self.attention_mask = attention_mask  # the prefill's (B, T); calibration skips its 0 positions
        self.scales: tuple[torch.Tensor, torch.Tensor] | None = None
        self._stale = False  # recalibrate() was called: the next update calibrates into the same tensors

    def recalibrate(self, attention_mask: torch.Tensor | None) -> None:
        """Calibrate the scales anew on the next ``update`` (a reused static cache's prefill), on
        ``attention_mask``'s positions, writing them into the scale tensors already held (a captured graph
        reads them where they are)."""
        self.attention_mask = attention_mask
        self._stale = self.scales is not None

    def _scale(self, x: torch.Tensor) -> torch.Tensor:
        a = x.detach().float().abs()
        if self.attention_mask is not None:  # (B, H, T, D) keys/values; pad positions do not calibrate
            a = a * self.attention_mask.to(device=a.device, dtype=a.dtype)[:, None, :, None]
        amax = a.amax() if self.granularity == "tensor" else a.amax(dim=(0, 2, 3), keepdim=True)
        if not torch.isfinite(amax).all():
            raise ValueError(
                "QuantizedKVLayer: the prefill keys/values hold NaN/Inf; cannot calibrate the FP8 scale"
            )
        return (amax / _FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)

    def round(self, x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        if self.fmt == "bf16":
            return x.to(torch.bfloat16).to(x.dtype)
        q = (x.float() / scale).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
        return (q.float() * scale).to(x.dtype)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.fmt == "fp8" and (self.scales is None or self._stale):
            scales = (self._scale(key_states), self._scale(value_states))
            if self.scales is None:
                self.scales = scales
            else:
                for kept, new in zip(self.scales, scales):
                    kept.copy_(new)
            self._stale = False
        ks, vs = self.scales if self.scales is not None else (None, None)
        return super().update(self.round(key_states, ks), self.round(value_states, vs), *args, **kwargs)


class QuantizedKVLayer(_RoundedKV, DynamicLayer):
    """A ``DynamicLayer`` whose stored keys/values are rounded through ``fmt`` (see the module docstring)."""


class QuantizedStaticKVLayer(_RoundedKV, StaticLayer):
    """A ``StaticLayer`` (pre-allocated, written in place) whose stored keys/values are rounded through ``fmt``.

    The scales are calibrated on the first ``update`` (the prefill, eager) and then frozen device tensors,
    so later updates launch only device work: the layer can be captured in a CUDA graph."""


def static_cache_refusal(config) -> str | None:
    """Why :func:`kv_cache` cannot build a static cache for ``config`` (a layer of transformers'
    ``StaticCache`` for it that is not a plain full-attention ``StaticLayer``: sliding-window, chunked, ...),
    or ``None`` when it can. Builds no buffers (static layers allocate on their first update)."""
    for i, layer in enumerate(StaticCache(config=config, max_cache_len=1).layers):
        if type(layer) is not StaticLayer:
            return (
                f"layer {i} of this model's cache is a {type(layer).__name__}; the static cache covers "
                "full-attention layers (cache_utils.StaticLayer) only"
            )
    return None


def kv_cache(
    config,
    fmt: str = "native",
    granularity: str = "tensor",
    attention_mask: torch.Tensor | None = None,
    max_cache_len: int | None = None,
) -> DynamicCache | StaticCache:
    """A fresh cache for ``config``: ``DynamicCache`` for ``"native"``, else one ``QuantizedKVLayer`` per layer;
    with ``max_cache_len``, a ``StaticCache`` of that length (``QuantizedStaticKVLayer`` layers).

    ``attention_mask``: the prefill's (B, T) mask; the fp8 scales are calibrated on its valid positions only."""
    if fmt not in KV_FORMATS:
        raise ValueError(f"kv cache format must be one of {KV_FORMATS}, got {fmt!r}")
    static = max_cache_len is not None
    if static and (not isinstance(max_cache_len, int) or max_cache_len < 1):
        raise ValueError(f"kv_cache: max_cache_len must be a positive int, got {max_cache_len!r}")
    cache = StaticCache(config=config, max_cache_len=max_cache_len) if static else DynamicCache(config=config)
    plain, rounded = (StaticLayer, QuantizedStaticKVLayer) if static else (DynamicLayer, QuantizedKVLayer)
    if static and (refusal := static_cache_refusal(config)) is not None:
        raise ValueError(f"kv_cache(max_cache_len=...): {refusal}")
    if fmt == "native":
        return cache
    if not cache.layers:
        raise ValueError(
            f"kv_cache({fmt!r}): the config gives no cache layers to quantize ({type(config).__name__})"
        )
    for i, layer in enumerate(cache.layers):
        if type(layer) is not plain:
            raise ValueError(
                f"kv_cache({fmt!r}): layer {i} of this model's cache is a {type(layer).__name__}; the {fmt} "
                f"emulation covers full-attention layers (cache_utils.{plain.__name__}) only"
            )
    extra = {"max_cache_len": max_cache_len} if static else {}
    cache.layers = [rounded(fmt, granularity, attention_mask, **extra) for _ in cache.layers]
    return cache


def cache_argument(model: torch.nn.Module) -> str:
    """The name of the forward argument that takes a KV cache: ``"cache"`` where the model's signature has
    it (transformers 5.24), else ``"past_key_values"`` (5.17). A PEFT wrapper is looked through."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
