"""NVFP4 numerics and Triton kernels, imported as ``triage.kernels``.

Depends on torch and triton only; never on ``triage.trainers``. Importing this package is cheap: the
names below load their modules (and triton) on first use.

The layer API: ``convert(model, NVFP4Config(...))`` swaps ``nn.Linear`` layers and fused MoE experts for
``NVFP4Linear`` / ``NVFP4MoeExperts`` (or, with ``frozen``, ``FrozenNVFP4Linear``; ``layers=``: a config of
its own per named module), ``unconvert(model)`` undoes it; ``NVFP4Config.from_recipe(recipe)`` is the config
of one ``QuantRecipe`` (``triage.kernels.conversion``).
"""

from __future__ import annotations

import importlib
import os
import sys

if __name__ == "kernels":
    # Found as a top-level ``kernels`` because a source checkout's root is on sys.path (``python -m ...`` run
    # from it): that name belongs to Hugging Face's ``kernels`` package, which transformers imports when it is
    # installed. Then take the checkout's root off sys.path (this package is ``triage.kernels``, reached through
    # the install) and hand the import to the real package. Without it, stay: transformers finds no
    # distribution named ``kernels`` and goes on without one, as it would without the checkout.
    import importlib.machinery

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    if importlib.machinery.PathFinder.find_spec(__name__, _path) is not None:
        sys.path[:] = _path
        del sys.modules[__name__]
        sys.modules[__name__] = importlib.import_module(__name__)

_LAZY = {
    "NVFP4Config": "triage.kernels.conversion",
    "convert": "triage.kernels.conversion",
    "unconvert": "triage.kernels.conversion",
    "NVFP4Linear": "triage.kernels.linear",
    "NVFP4LinearConfig": "triage.kernels.linear",
    "NVFP4MoeExperts": "triage.kernels.moe.experts",
    "NVFP4MoEConfig": "triage.kernels.moe.experts",
    "FrozenNVFP4Linear": "triage.kernels.frozen_linear",
    "NVFP4FrozenConfig": "triage.kernels.frozen_linear",
    "grouped_gemm": "triage.kernels.moe",
    "grouped_gemm_reference": "triage.kernels.moe",
    "offsets_from_expert_ids": "triage.kernels.moe",
    "DEFAULT_SKIP": "triage.kernels.skip",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'triage.kernels' has no attribute {name!r}")
