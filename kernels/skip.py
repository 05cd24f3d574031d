"""Which modules stay in high precision: one list and one matcher for conversion and export.

:func:`~triage.kernels.convert` (``NVFP4Config.skip``: the learner's NVFP4 and frozen layers, the
experts) and :func:`~triage.kernels.nvfp4.export_nvfp4_checkpoint` (the sampler's checkpoint) both skip the
modules whose qualified name matches one of the ``skip`` fnmatch patterns, default :data:`DEFAULT_SKIP`. One
list for both sides because a learner matches a sampler only if both quantize the same layers: an engine
computes in NVFP4 exactly the layers its checkpoint quantizes, so the learner converts what the export
quantizes.

:data:`DEFAULT_SKIP` is the union of what either side must keep in high precision:

* the output head and the embeddings (``lm_head``; ``embed_tokens``, ``embed_in``, GPT-2's ``wte`` / ``wpe``);
* norms (never Linear layers, but their 2-D state-dict entries must not be exported as weights);
* MoE routers and shared-expert gates (Qwen2/3-MoE ``mlp.gate``, Mixtral ``block_sparse_moe.gate``, ``router``,
  ``shared_expert_gate``), which engines and ModelOpt keep unquantized;
* sequence-classification heads (``score``, ``classifier``).

The export additionally keeps every ``nn.Embedding`` whatever its name (a rule on module types, not names).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

__all__ = ["DEFAULT_SKIP", "skip_patterns", "skipped"]

#: Module-name patterns (fnmatch, on the qualified name) kept in high precision by conversion and export.
DEFAULT_SKIP = (
    "lm_head",
    "*.lm_head",
    "*embed*",  # embed_tokens, embed_in (GPT-NeoX), embed_positions, word_embeddings
    "wte",
    "*.wte",
    "wpe",
    "*.wpe",
    "*norm*",
    "*.mlp.gate",
    "*block_sparse_moe.gate",
    "*router*",
    "*shared_expert_gate",
    "*score",
    "*classifier*",
)


def skip_patterns(skip: str | Iterable[str]) -> tuple[str, ...]:
    """``skip`` as a tuple of patterns: one pattern string, or an iterable of pattern strings."""
    patterns = (skip,) if isinstance(skip, str) else tuple(skip)
    bad = [p for p in patterns if not isinstance(p, str)]
    if bad:
        raise TypeError(f"skip: every pattern must be a str (fnmatch on module names), got {bad[0]!r}")
    return patterns


def skipped(name: str, skip: str | Iterable[str]) -> bool:
    """Whether the module ``name`` (qualified, e.g. ``model.layers.0.mlp.gate``) matches a ``skip`` pattern."""
    return any(fnmatch.fnmatchcase(name, p) for p in skip_patterns(skip))
