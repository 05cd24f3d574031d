"""TRL integration, imported as ``triage.trainers``.

``TriageGRPOConfig`` / ``TriageGRPOTrainer`` are imported lazily (on first attribute access), so importing a
light submodule such as ``triage.trainers.tiny`` does not pull in TRL.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "TriageGRPOConfig": "triage.trainers.config",
    "TriageGRPOTrainer": "triage.trainers.grpo_trainer",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'triage.trainers' has no attribute {name!r}")
