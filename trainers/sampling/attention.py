"""Decode attention without ``repeat_kv``: grouped-query attention for one query token per row.

A model with grouped KV heads (Qwen3: 32 query heads over 8 KV heads) runs its attention through
transformers' ``sdpa_attention_forward``. Given an attention mask (the static cache always passes one) it
copies every cached key and value once per query head of its group (``repeat_kv``) before SDPA in
transformers 5.17, and in every version under ``torch.compile`` (later versions pack one query token
themselves, eagerly only): at a decode step that copy reads and writes the whole cache per layer (at 16
rows of a 4B-width model, two 23 µs kernels per layer at a 192-slot cache, growing with the cache). With
one query token per row the group's query heads can instead be the query *positions* of their KV head:

    q [B, H_q, 1, D] → [B, H_kv, G, D],  o = SDPA(q, K, V, mask [B, 1, 1, L]) [B, H_kv, G, D] → [B, 1, H_q, D]

(query head h = kv·G + g reads KV head h // G, as ``repeat_kv`` pairs them; the mask broadcasts over heads
and positions). Each query row's softmax and weighted sum are the same sums over the same keys, so the
outputs are what the repeated path gives up to the SDPA kernel's rounding.

:func:`packed_decode_attention` puts this function in the place of transformers' ``"sdpa"`` attention
function around one decode step (the built-in sampler's static decode step, :mod:`.graphs`); the name stays
``"sdpa"``, so model code that branches on it is unchanged. Every other call (a prompt pass, more than one
query token, no grouping, dropout, a mask per head, a sliding window, any argument beyond the ones a plain
decoder passes) goes to ``sdpa_attention_forward`` unchanged. The swap is process-wide for its duration
(transformers keeps one table of attention functions), which is harmless: the function computes what
``"sdpa"`` computes for any caller.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

#: keyword arguments a plain decoder's attention passes that do not change the attention (any other one with a
#: value sends the call to transformers' own function)
_PLAIN = frozenset({"position_ids", "cache_position", "use_cache", "is_causal", "output_attentions"})


def packed_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query`` [B, H_q, T, D], ``key``/``value``
    [B, H_kv, L, D] → ``(output [B, T, H_q, D], None)``; for T = 1 with grouped KV heads SDPA over the
    packed query (module docstring), else ``sdpa_attention_forward``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, tokens, dim = query.shape
    groups = heads // key.shape[1]
    if (
        tokens != 1
        or groups == 1
        or key.shape[1] * groups != heads
        or dropout
        or (attention_mask is not None and (attention_mask.dim() != 4 or attention_mask.shape[1] != 1))
        or kwargs.get("output_attentions")
        or any(v is not None for k, v in kwargs.items() if k not in _PLAIN)
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    packed = query.reshape(batch, heads // groups, groups, dim)
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(batch, 1, heads, value.shape[-1]), None


def uses_grouped_sdpa(model: torch.nn.Module) -> bool:
    """Whether ``model`` has an attention module with grouped KV heads that runs transformers' SDPA: what
    :func:`packed_decode_attention` would change."""
    return any(
        getattr(module, "num_key_value_groups", 1) > 1
        and getattr(getattr(module, "config", None), "_attn_implementation", None) == "sdpa"
        for module in model.modules()
    )


@contextlib.contextmanager
def packed_decode_attention(active: bool = True):
    """Inside (when ``active``): transformers' ``"sdpa"`` attention function is :func:`packed_sdpa_forward`
    (set in the table models read, ``ALL_ATTENTION_FUNCTIONS``); the previous entry is back on exit."""
    if not active:
        yield
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    local = ALL_ATTENTION_FUNCTIONS._local_mapping
    missing = object()
    before = local.get("sdpa", missing)
    local["sdpa"] = packed_sdpa_forward
    try:
        yield
    finally:
        if before is missing:
            local.pop("sdpa", None)
        else:
            local["sdpa"] = before
