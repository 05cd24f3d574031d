"""Decode attention without ``repeat_kv``: grouped-query attention for one query token per row.

A model with grouped KV heads (Qwen3: 32 query heads over 8 KV heads) runs its attention through
transformers' ``sdpa_attention_forward``, which, given an attention mask (the static cache always passes
one), copies every cached key and value once per query head of its group (``repeat_kv``) before SDPA: at a
decode step that copy reads and writes the whole cache per layer (at 16 rows of a 4B-width model, two
23 µs kernels per layer at a 192-slot cache, growing with the cache), and under ``torch.compile`` no
transformers version skips it. With one query token per row the group's query heads can instead be the
query *positions* of their KV head:

    q [B, H_q, 1, D] → [B, H_kv, G, D],  o = SDPA(q, K, V, mask [B, 1, 1, L]) [B, H_kv, G, D] → [B, 1, H_q, D]

(query head h = kv·G + g reads KV head h // G, as ``repeat_kv`` pairs them; the mask broadcasts over heads
and positions). Each query row's softmax and weighted sum are the same sums over the same keys, so the
outputs are what the repeated path gives up to the SDPA kernel's rounding.

:func:`packed_decode_attention` switches a model's SDPA attention modules to this function around one
decode step (the built-in sampler's static decode step, :mod:`.graphs`); every other call (a prompt pass,
more than one query token, dropout, a position bias, a mask per head) goes to transformers' own
``sdpa_attention_forward`` unchanged.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

#: the ``attn_implementation`` name this module registers (with transformers' ``AttentionInterface``)
PACKED_SDPA = "triage_packed_sdpa"
_registered = False


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
        or any(kwargs.get(k) is not None for k in ("position_bias", "softcap", "sliding_window", "s_aux"))
        or kwargs.get("output_attentions")
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    packed = query.reshape(batch, heads // groups, groups, dim)
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(batch, 1, heads, value.shape[-1]), None


def _register() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_SDPA, packed_sdpa_forward)
    try:  # a 2-D mask under this name is built as SDPA's (the decode step passes its own 4-D mask)
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)
    except ImportError:
        pass
    _registered = True


def sdpa_configs(model: torch.nn.Module) -> list:
    """The configs of ``model``'s grouped-KV attention modules that run transformers' SDPA (each once):
    what :func:`packed_decode_attention` switches."""
    configs = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if (
            getattr(module, "num_key_value_groups", 1) > 1
            and getattr(config, "_attn_implementation", None) == "sdpa"
        ):
            configs[id(config)] = config
    return list(configs.values())


@contextlib.contextmanager
def packed_decode_attention(configs: list):
    """Inside: the attention modules of ``configs`` (:func:`sdpa_configs`) run :func:`packed_sdpa_forward`
    (their ``_attn_implementation`` set to :data:`PACKED_SDPA`, without the setter's sub-config walk);
    restored to ``"sdpa"`` on exit."""
    if not configs:
        yield
        return
    _register()
    for config in configs:
        config._attn_implementation_internal = PACKED_SDPA
    try:
        yield
    finally:
        for config in configs:
            config._attn_implementation_internal = "sdpa"
