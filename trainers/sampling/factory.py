"""``make_sampler(kind, **kwargs)``: build a sampler source by name."""

from __future__ import annotations

from typing import Any

from .base import SamplerSource


def sampler_classes() -> dict[str, type[SamplerSource]]:
    """The class of each sampler kind (:data:`SAMPLER_KINDS`), imported on the call."""
    from .hf import HFSampler
    from .offline import OfflineRollouts
    from .sglang import SGLangClient
    from .vllm_server import VLLMServerClient

    return {
        "hf": HFSampler,
        "sglang": SGLangClient,
        "vllm-server": VLLMServerClient,
        "offline": OfflineRollouts,
    }


SAMPLER_KINDS = ("hf", "sglang", "vllm-server", "offline")


def make_sampler(kind: str, **kwargs: Any) -> SamplerSource:
    """A sampler source: ``"hf"`` -> :class:`HFSampler`, ``"sglang"`` -> :class:`SGLangClient`,
    ``"vllm-server"`` -> :class:`VLLMServerClient`, ``"offline"`` -> :class:`OfflineRollouts`.

    ``kwargs`` go to the class (e.g. ``make_sampler("sglang", base_url="http://127.0.0.1:30000")``).
    """
    registry = sampler_classes()
    if kind not in registry:
        raise ValueError(f"unknown sampler kind {kind!r}; choose one of {list(SAMPLER_KINDS)}")
    return registry[kind](**kwargs)
