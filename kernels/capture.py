"""Keeping a captured CUDA graph of a model's forward valid across calls.

A CUDA graph replays the kernels it captured on the memory they read then: the values may change between
replays (a parameter written in place is read anew), the addresses may not. A graph of a model's decode step
(the built-in sampler's, :class:`~triage.trainers.sampling.graphs.DecodeGraphs`) can therefore be kept from one
call to the next exactly while every tensor it reads sits where it sat at capture:

* :func:`graph_key` — the addresses a captured forward of ``model`` reads: every parameter and buffer, and
  what each NVFP4 layer keeps beside them (its config, its sibling group, its cached quantized weight;
  :meth:`NVFP4Linear._graph_key`, refreshed first as a forward would). Equal keys: a kept graph replays the
  model as it is now. The key holds the objects it names (configs, sibling groups), so no address or id in
  it can be reused by a new object while a key is kept.
* :func:`keep_weight_addresses` — an ``NVFP4Linear`` re-quantizes its weight lazily after every update, into
  new tensors by default (a W_q someone holds keeps its values). For a grad-free model whose W_q nobody else
  holds (the sampler's copy), this makes the layers write each new quantization into the cached tensors
  instead, so that a weight sync (``load_state_dict``, an optimizer step) leaves :func:`graph_key` unchanged
  and a kept graph serves the new weights.

Python state a capture baked in beyond tensors: a config's static scale or a route chosen by shape is part of
the layers' configs, hence of the key; a decode scale a cuBLAS GEMM read to the host (an ``NVFP4Linear`` above
``SMALL_M`` rows with static activation scales) is in the key by value, so a weight sync that changes it makes
the next call capture anew; train/eval mode and a PEFT layer's active, disabled and merged adapters are in it
too. Shapes are part of the caller's key (batch, cache length). Other Python attributes a forward reads (a
custom module's flags) are not: change them only between calls that capture anew.
"""

from __future__ import annotations

from torch import nn

__all__ = ["graph_key", "keep_weight_addresses"]


def graph_key(model: nn.Module) -> tuple:
    """What a captured forward of ``model`` reads, as addresses and objects (module docstring). Cost: one pass
    over the modules (~1 µs per parameter on a CPU host)."""
    parts: list = []
    for module in model.modules():
        parts.append(module.training)
        cls = type(module)  # class attributes looked up on the class: no Module.__getattr__ miss per module
        if isinstance(getattr(cls, "active_adapters", None), property):  # a PEFT layer (transformers': a method)
            parts.append(_adapters(module, module.active_adapters))
        for group in (module._parameters, module._buffers):
            for name, t in group.items():
                if t is not None:
                    parts.append((name, t.data_ptr(), tuple(t.shape), t.dtype, t.device))
        if getattr(cls, "_graph_key", None) is not None:
            parts.append(module._graph_key())
    return tuple(parts)


def keep_weight_addresses(model: nn.Module) -> int:
    """Make every ``NVFP4Linear`` of ``model`` refresh its cached W_q in place (module docstring); returns how
    many layers. Only for a model whose quantized weights nothing else holds: no autograd graph of an earlier
    forward (it saved the old W_q for its backward), no ``quantized_weight()`` result kept for comparison."""
    from triage.kernels.linear import NVFP4Linear

    n = 0
    for module in model.modules():
        if isinstance(module, NVFP4Linear):
            module._weight_cache.in_place = True
            n += 1
    return n


def _adapters(module: nn.Module, active) -> tuple:
    """A PEFT tuner layer's Python switches a capture bakes in: active, disabled, merged adapters (names and
    flags only: the key must not hold the module, or a kept state would keep its model alive)."""
    disabled = getattr(module, "disable_adapters", None)
    merged = getattr(module, "merged_adapters", None)
    return (
        tuple(str(a) for a in active) if isinstance(active, (list, tuple)) else str(active),
        None if callable(disabled) else bool(disabled),
        tuple(str(a) for a in merged) if isinstance(merged, (list, tuple)) else None,
    )
