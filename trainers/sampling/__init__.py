"""Sampler sources: TRL 1.16 ``rollout_func``s for any engine (HF generate, SGLang, vLLM server, offline).

Use one as ``GRPOTrainer(..., rollout_func=make_sampler("hf"))``; every source validates its output
(:func:`validate_rollout`). See ``docs/sampling.md``.
"""

from .base import SamplerSource, SamplingParams, encode_prompts
from .factory import SAMPLER_KINDS, make_sampler
from .hf import HFSampler, sample_with_kv_cache
from .http_json import EngineError, HTTPOptions
from .offline import OfflineRollouts
from .sglang import SGLangClient
from .validation import RolloutValidationError, validate_rollout
from .vllm_server import VLLMServerClient

__all__ = [
    "SAMPLER_KINDS",
    "EngineError",
    "HFSampler",
    "HTTPOptions",
    "OfflineRollouts",
    "RolloutValidationError",
    "SGLangClient",
    "SamplerSource",
    "SamplingParams",
    "VLLMServerClient",
    "encode_prompts",
    "make_sampler",
    "sample_with_kv_cache",
    "validate_rollout",
]
