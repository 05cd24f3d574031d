"""Built-in sampler: batched ancestral sampling with a Hugging Face causal LM and its incremental KV cache.

The log-prob of every sampled token is read from the same logits the token was sampled from, during decoding
(prefill once, then one cached step per token): no re-forward. For step t with raw logits z_t:

* sampling distribution: ``softmax(process(z_t))`` where ``process`` is transformers' own logits processors in
  ``generate``'s order: repetition penalty, temperature, top-k, top-p, min-p;
* reported log-prob (``logprobs_mode="temperature"``, default): ``log_softmax(z_t / T)[y_t]``, the quantity
  TRL 1.16's learner computes (it applies only the temperature), so δ = 0 up to numerics when the sampler and
  learner are the same fp32 model and no truncation is used;
* ``logprobs_mode="processed"``: ``log_softmax(process(z_t))[y_t]``, the distribution actually sampled from
  (renormalised over the top-k/top-p/min-p set; vLLM's ``processed_logprobs`` analogue).

Why a decode loop instead of ``model.generate(output_logits=True)``: ``generate`` keeps one (B, V) tensor per
step for the whole completion (a 150k vocabulary × 64 rows × 1k steps is ~38 GB in fp32) only to pick one value
per row; the loop keeps one float per token.

``sampler_model`` picks the weights: ``"shared"`` (default) samples with the trainer's own model (unwrapped
like TRL does for ``generate``); ``"copy"`` keeps a separate copy (optionally cast to ``dtype`` and passed
through ``prepare_model``, e.g. ``lambda m: triage.kernels.convert(m, config)``), synced from
the trainer's weights whenever ``trainer.state.global_step`` changes: built once, then refreshed in place
(:meth:`HFSampler.sync_weights`).

``kv_cache_dtype`` picks the precision of the stored keys/values, as an inference engine's KV cache would:
``None``/``"auto"``/``"native"`` keep them in the model's dtype (transformers' ``DynamicCache``); ``"bf16"``
rounds them through bfloat16 (a no-op on a bf16 model); ``"fp8"``/``"fp8_e4m3"`` store
``e4m3(k / s_k) · s_k`` with one scale per layer for K and one for V, ``s = amax / 448`` calibrated on the
prefill's non-pad positions and then frozen (the emulation of :mod:`triage.trainers.sampling.kvcache`). The
learner's full-sequence forward never rounds its keys/values, so an fp8 cache adds to the engine mismatch δ.

``activation_scale`` picks where the copy's NVFP4 activation outer scales come from: ``"recipe"`` (default)
as its ``quant_recipe`` says (dynamic: from each forward's own input); ``"calibrated"`` as a served NVFP4
checkpoint has them (ModelOpt, compressed-tensors, vLLM): one static input amax per Linear layer, measured
once by :func:`triage.kernels.calibration.calibrate_activation_amax` and then fixed for the whole run
(:meth:`HFSampler._calibrate`), while the weights are re-quantized from the trainer's at every sync.

``fused_weight_scale`` picks the weight outer scales of the copy's fused shards: ``"independent"`` (default)
one per layer, as its recipe says; ``"shared"`` as vLLM serves a checkpoint's q/k/v (and gate/up) shards in one
fused layer: each shard quantized with the group amax (the max over the shards' current per-tensor amax),
recomputed at every weight sync (:func:`triage.kernels.calibration.set_fused_weight_scales`).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from . import graphs
from .base import RANK_SEED_STRIDE, SamplerSource, SamplingParams, trainer_rank
from .graphs import DecodeGraphs, StaticDecode, prefill_width, static_cache_length
from .kvcache import kv_format


def _logits_processors(params: SamplingParams):
    """transformers' processors for ``params``, in ``GenerationMixin._get_logits_processor``'s order."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    procs = LogitsProcessorList()
    if params.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(penalty=params.repetition_penalty))
    if params.temperature != 1.0:
        procs.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k > 0:
        procs.append(TopKLogitsWarper(top_k=params.top_k))
    if params.top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p=params.top_p))
    if params.min_p:
        procs.append(MinPLogitsWarper(min_p=params.min_p))
    return procs


def _new_cache(
    model: torch.nn.Module, kv_cache_dtype: str | None = None, attention_mask: torch.Tensor | None = None
):
    from transformers import DynamicCache

    fmt = kv_format(kv_cache_dtype)
    if fmt != "native":
        from .kvcache import kv_cache

        return kv_cache(model.config, fmt, attention_mask=attention_mask)
    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers
        return DynamicCache()


DECODES = ("auto", "dynamic", "static", "cuda_graph")
#: The decode loop checks whether every row has finished (a host read of a device flag, which waits for the
#: GPU) once per this many steps, not after every token.
DONE_CHECK_EVERY = 8
#: where the sampler copy's NVFP4 activation outer scales come from (``HFSampler(activation_scale=...)``)
ACTIVATION_SCALES = ("recipe", "calibrated")
#: the weight outer scales of the sampler copy's fused shards (``HFSampler(fused_weight_scale=...)``)
FUSED_WEIGHT_SCALES = ("independent", "shared")
#: attention implementations whose 4-D decode mask the static/graph paths can build (bool: True = attend)
_STATIC_ATTENTION = ("sdpa", "eager", "triage_strict")


def _resolve_decode(decode: str, model: torch.nn.Module, device: torch.device) -> str:
    """``decode`` → the path that runs: ``"auto"`` is ``"cuda_graph"`` on a CUDA device when the model allows a
    static cache (its attention builds the 4-D decode mask, every layer is full attention), else
    ``"dynamic"``; an explicit choice the model cannot run is an error."""
    if decode not in DECODES:
        raise ValueError(f"decode must be one of {DECODES}, got {decode!r}")
    from .kvcache import static_cache_refusal

    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl not in _STATIC_ATTENTION:
        refusal = f"the decode mask is built for attn_implementation in {_STATIC_ATTENTION}, not {impl!r}"
    else:
        refusal = static_cache_refusal(config)
    if decode == "auto":
        return "cuda_graph" if device.type == "cuda" and refusal is None else "dynamic"
    if decode != "dynamic" and refusal is not None:
        raise ValueError(f"decode={decode!r} needs a static KV cache: {refusal} (use decode='dynamic')")
    if decode == "cuda_graph" and device.type != "cuda":
        raise ValueError(f"decode='cuda_graph' needs a CUDA device; the model is on {device}")
    return decode


@torch.no_grad()
def sample_with_kv_cache(
    model: torch.nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    params: SamplingParams,
    eos_ids: Sequence[int],
    generator: torch.Generator | None = None,
    logprobs_mode: Literal["temperature", "processed"] = "temperature",
    pad_id: int = 0,
    kv_cache_dtype: str | None = None,
    decode: str = "dynamic",
    decode_state: DecodeGraphs | None = None,
    compile_decode: bool = False,
    cache_width: int | None = None,
) -> dict[str, list[list]]:
    """Sample one completion per prompt with left padding and an incremental KV cache.

    ``kv_cache_dtype``: precision of the stored keys/values (module docstring; ``None`` = the model's).
    ``decode``: ``"dynamic"`` (transformers' growing ``DynamicCache``), ``"static"`` (a pre-allocated
    ``StaticCache`` of :func:`~triage.trainers.sampling.graphs.static_cache_length` positions — prompt width
    (padded to :func:`~triage.trainers.sampling.graphs.prefill_width` with prefill graphs on) +
    ``max_new_tokens`` − 1, rounded up to a bucket — and a 4-D mask updated in place), ``"cuda_graph"``
    (the static path with each decode step replayed from a CUDA graph,
    :class:`~triage.trainers.sampling.graphs.GraphStep`) or ``"auto"`` (``"cuda_graph"`` on CUDA, else
    ``"dynamic"``). The static cache attends over the whole buffer with the unwritten positions masked, so
    its attention may round differently from the dynamic cache's in the last bits. It holds all those
    positions for every row from the start, where the dynamic cache grows to the longest completion so far:
    with a long ``max_new_tokens``, bound the rows per call (``HFSampler(batch_size=...)``) or decode
    ``"dynamic"``.
    ``decode_state``: a :class:`~triage.trainers.sampling.graphs.DecodeGraphs` whose static cache, buffers and graph
    the static paths reuse from earlier calls of the same shape and leave for later ones (None: built for this
    call alone). ``compile_decode``: the static paths' decode step through ``torch.compile``
    (:mod:`triage.trainers.sampling.graphs`); the dynamic path ignores it. ``cache_width``: size the static
    cache for prompts this wide at least (``HFSampler`` passes its call's widest prompt, so that every chunk of
    a call shares one cache length, hence one kept state per chunk size).

    Returns ``{"completion_ids", "logprobs"}``; a completion ends with (and includes) the first EOS id, or stops
    at ``params.max_new_tokens``. A finished row keeps being fed ``pad_id`` until the first check after every
    row has finished (one every :data:`DONE_CHECK_EVERY` steps); those steps are not recorded, but they advance
    ``generator`` (up to ``DONE_CHECK_EVERY`` − 1 more draws than stopping at the last row's EOS).
    """
    if logprobs_mode not in ("temperature", "processed"):
        raise ValueError(f"logprobs_mode must be 'temperature' or 'processed', got {logprobs_mode!r}")
    fmt = kv_format(kv_cache_dtype)
    if not prompt_ids:
        return {"completion_ids": [], "logprobs": []}
    empty = [i for i, p in enumerate(prompt_ids) if len(p) == 0]
    if empty:
        raise ValueError(
            f"prompt entry {empty[0]} has no token; the sampler needs at least one context token"
        )
    device = next(model.parameters()).device
    decode = _resolve_decode(decode, model, device)
    static = decode != "dynamic"
    batch, width = len(prompt_ids), max(len(p) for p in prompt_ids)
    # with prefill graphs on (graphs.CAPTURE_PREFILL), both static paths pad to the width's bucket: a kept graph
    # per bucket, the same prompt forward on both
    bucket = prefill_width if static and graphs.CAPTURE_PREFILL else (lambda w: w)
    width = bucket(width)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((batch, width), dtype=torch.long, device=device)
    for i, p in enumerate(prompt_ids):
        input_ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long, device=device)
        mask[i, width - len(p) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    eos = torch.tensor(sorted(set(int(e) for e in eos_ids)), dtype=torch.long, device=device)
    processors = _logits_processors(params)
    from .kvcache import cache_argument

    cache_name = cache_argument(model)
    if static:
        # every chunk of a call (cache_width: its widest prompt) gets the same length
        length = static_cache_length(max(width, bucket(cache_width or 1)), params.max_new_tokens)
        shape = (batch, length, fmt, decode == "cuda_graph", cache_name, compile_decode)
        if decode_state is not None:
            state = decode_state.state(model, *shape)
        else:  # this call's alone: freed with it
            state = StaticDecode(model, *shape)
        logits = state.prefill(input_ids, mask, positions)
    else:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(base.forward).parameters else {}
        cache = _new_cache(model, kv_cache_dtype, attention_mask=mask)
        out = model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{cache_name: cache},
            **keep,
        )
        logits = out.logits[:, -1, :]
    # what repetition penalty looks at (prompt + completion so far), as in generate; pads become the id one
    # past the logits, which the processor clamps into an extra column and drops (a pad is not a seen token)
    seen = input_ids.masked_fill(mask == 0, logits.shape[-1])
    next_pos = positions[:, -1] + 1
    if static:
        # decode inputs as static buffers, updated in place: the token, its position, and the 4-D mask over
        # the whole cache (prompt keys as the padding mask says, generated keys switched on as written)
        state.start(mask, next_pos, logits.dtype)
    track_seen = params.repetition_penalty != 1.0  # the one processor that reads the tokens so far
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    broken = torch.zeros(batch, dtype=torch.bool, device=device)  # an alive row's distribution was NaN
    tokens, logps, alive = [], [], []
    for i in range(params.max_new_tokens):
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        scores = processors(seen, logits.clone()) if len(processors) else logits
        probs = torch.softmax(scores, dim=-1)
        # a NaN or Inf logit (or an all -inf row) makes softmax's whole row NaN: one column tells
        broken |= probs[:, 0].isnan() & ~finished
        token = _draw(probs, generator)
        ref = logits / params.temperature if logprobs_mode == "temperature" else scores
        logp = torch.log_softmax(ref, dim=-1).gather(1, token[:, None]).squeeze(1)
        token = torch.where(finished, torch.full_like(token, pad_id), token)
        tokens.append(token)
        logps.append(logp)
        alive.append(~finished)
        finished = finished | torch.isin(token, eos)
        # a host read waits for the GPU; reading `finished` (and `broken`) every DONE_CHECK_EVERY steps lets the
        # host queue that many steps ahead. The steps after every row finished feed pads and are not recorded (a
        # row's alive steps are a prefix), so the returned completions are the same; they only draw more random
        # numbers.
        last = i == params.max_new_tokens - 1
        if last or (i + 1) % DONE_CHECK_EVERY == 0:
            done, bad = torch.stack((finished.all(), broken.any())).tolist()
            if bad:
                rows = broken.nonzero().flatten().tolist()
                raise ValueError(
                    f"sample_with_kv_cache: the sampling distribution of prompt(s) {rows} is NaN at a sampling "
                    f"step ≤ {i} (0: the token after the prompt; the model's logits are NaN or Inf there): nothing "
                    f"to sample from"
                )
            if done or last:
                break
        if track_seen:
            seen = torch.cat([seen, token[:, None]], dim=1)
        if static:
            logits = state.advance(token, width + i)  # the key this step writes: position width + i
        else:
            mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype, device=device)], dim=1)
            out = model(
                input_ids=token[:, None],
                attention_mask=mask,
                position_ids=next_pos[:, None],
                use_cache=True,
                **{cache_name: cache},
            )
            logits = out.logits[:, -1, :]
            next_pos = next_pos + 1

    tokens_t, logps_t, alive_t = (torch.stack(x, dim=1).cpu() for x in (tokens, logps, alive))
    completion_ids, logprobs = [], []
    for i in range(batch):
        n = int(alive_t[i].sum())  # alive steps are a prefix: a row stays finished
        completion_ids.append(tokens_t[i, :n].tolist())
        logprobs.append(logps_t[i, :n].tolist())
    return {"completion_ids": completion_ids, "logprobs": logprobs}


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``probs`` [B, V]: ``torch.multinomial(probs, 1, generator=generator)``'s draw by its
    own one-sample route, ``argmax(p / q)`` with ``q ~ Exp(1)`` from ``generator`` (the Gumbel-max trick), so
    the same tokens and the same generator state, without its validity check (reductions at every step and,
    on CUDA, depending on the torch version a host read or a device-side assert, which leaves the CUDA
    context unusable): the loop flags NaN rows itself and raises at its done checks."""
    q = torch.empty_like(probs).exponential_(1, generator=generator)
    torch.div(probs, q, out=q)
    return q.argmax(-1)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of its element size: ``torch.equal`` on these compares bit patterns (NaN = NaN,
    any dtype, fp8 included)."""
    return t.view(_BITS[t.element_size()]) if t.element_size() in _BITS else t


def _in_place_blocker(dup: torch.nn.Module, source: torch.nn.Module) -> str | None:
    """Why ``dup.load_state_dict(source.state_dict())`` would not give what rebuilding ``dup`` gives, or ``None``.

    In-place loading writes ``source``'s entries into ``dup``'s, cast to their dtypes, name for name. It equals
    a rebuild when the build kept every entry a cast of the source's (same keys, same shapes, each entry of
    ``dup`` bit for bit the source's cast to its dtype) and computed nothing else from the weight values. A
    ``prepare_model`` that renames, reshapes, drops or rewrites weights fails this check; one that only swaps
    module classes (the NVFP4 conversions) passes."""
    mine, theirs = dup.state_dict(), source.state_dict()
    if mine.keys() != theirs.keys():
        only_copy, only_source = sorted(mine.keys() - theirs.keys()), sorted(theirs.keys() - mine.keys())
        return (
            "the copy's state_dict keys differ from the trainer model's: "
            f"only in the copy {only_copy[:3]}, only in the trainer model {only_source[:3]}"
        )
    for key, mine_t in mine.items():
        theirs_t = theirs[key]
        if not (isinstance(mine_t, torch.Tensor) and isinstance(theirs_t, torch.Tensor)):
            return f"state_dict entry {key!r} is not a tensor"
        if mine_t.shape != theirs_t.shape:
            return (
                f"{key!r} has shape {tuple(mine_t.shape)} in the copy, {tuple(theirs_t.shape)} in the trainer "
                "model"
            )
        cast = theirs_t.to(device=mine_t.device, dtype=mine_t.dtype)
        if not torch.equal(_bits(mine_t), _bits(cast)):
            return f"{key!r} of the copy is not the trainer model's {key!r} cast to {mine_t.dtype}"
    return None


class HFSampler(SamplerSource):
    """Sample with a transformers causal LM; log-probs from the incremental KV-cache path.

    Args:
        model: model to sample from when used without a trainer (``generate``); with a trainer, ``"shared"``
            uses the trainer's model and ``"copy"`` a copy of it.
        sampler_model: ``"shared"`` (default) or ``"copy"``.
        dtype: dtype of the copy (``"copy"`` only; ``None`` keeps the trainer's dtype).
        prepare_model: ``prepare_model(copy) -> model`` applied to the copy after the cast (``"copy"`` only),
            e.g. an NVFP4 conversion. It must keep every weight's name, shape and value (up to the cast) and
            compute nothing from the weights: later syncs refresh the copy in place (:meth:`sync_weights`).
        params: sampling parameters (``None``: from ``trainer.args``; required for :meth:`generate` alone).
        seed: seed of the sampler's own ``torch.Generator`` (``None``: drawn once from torch's global RNG, so
            ``transformers.set_seed`` makes runs reproducible); offset by 1000003 × the process index.
        batch_size: rows per decode batch (``None``: all prompt entries at once).
        logprobs_mode: ``"temperature"`` (default, what TRL's learner computes) or ``"processed"``.
        kv_cache_dtype: precision of the KV cache (module docstring): ``None`` (default: the model's dtype),
            ``"bf16"`` or ``"fp8_e4m3"`` (alias ``"fp8"``).
        decode: the decode path of :func:`sample_with_kv_cache`: ``"auto"`` (default: a static KV cache with
            CUDA-graph replay on CUDA, the dynamic cache elsewhere), ``"dynamic"``, ``"static"`` or ``"cuda_graph"``.
        refresh: how a sync updates the copy after the first: ``"in_place"`` (default: the trainer's weights
            copied into it) or ``"rebuild"`` (deep copy → cast → ``prepare_model`` at every sync; for a
            ``prepare_model`` that computes something from the weights, e.g. a calibration).
        activation_scale: ``"recipe"`` (default: the copy's NVFP4 layers scale their activations as their
            recipe says) or ``"calibrated"`` (``"copy"`` with an NVFP4 ``prepare_model`` whose activation
            recipe is per tensor and dynamic): the emulation of a served checkpoint's static activation
            scales. The first build of the copy runs the first prompts batch the sampler generates for
            (each distinct prompt alone, no padding) through the copy as cast, *before* ``prepare_model``
            (the un-quantized model in the copy's dtype, as a checkpoint is calibrated from its bf16 weights),
            records each decoder Linear's max |input| (:func:`~triage.kernels.calibration.calibrate_activation_amax`;
            with several processes the max over all of them) and gives every ``NVFP4Linear`` of the prepared
            copy ``QuantRecipe(scale_source="static", static_amax=...)``
            (:func:`~triage.kernels.calibration.set_static_activation_scales`). The amax are kept
            (:attr:`activation_amax`) for the rest of the run: an in-place refresh leaves the layers' recipes
            as they are, a rebuild applies the same amax again.
        fused_weight_scale: ``"independent"`` (default: each NVFP4 layer of the copy scales its weight as its
            recipe says) or ``"shared"`` (``"copy"`` with an NVFP4 ``prepare_model`` whose weight recipe has one
            dynamic outer scale per tensor): the emulation of vLLM's fused q/k/v and gate/up layers, which
            quantize every shard with ONE outer scale, the group amax. Every build of the copy and every
            in-place refresh, once the new weights are written, gives each fused-shard ``NVFP4Linear``
            ``QuantRecipe(scale_source="static", static_amax=<max over its group's current weight amax>)``
            (:func:`~triage.kernels.calibration.set_fused_weight_scales`); other layers keep their own scale.
        keep_decode: keep the static KV cache, the decode step's buffers and its CUDA graph from one call to
            the next (default; :mod:`triage.trainers.sampling.graphs`): a call of a shape seen before
            (batch rows, bucketed cache length) prefills and replays at once, across weight syncs, instead of
            warming up and capturing anew. They stay allocated between calls (while the learner trains):
            ``False`` frees them after every call.
        compile_decode: run the decode step's forward through ``torch.compile`` (static and CUDA-graph decode;
            :mod:`triage.trainers.sampling.graphs`): fewer, fused kernels per step, for a compile at the first
            step of each new shape.
    """

    name = "hf"

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        *,
        sampler_model: Literal["shared", "copy"] = "shared",
        dtype: torch.dtype | None = None,
        prepare_model: Callable[[torch.nn.Module], torch.nn.Module | None] | None = None,
        params: SamplingParams | None = None,
        seed: int | None = None,
        batch_size: int | None = None,
        logprobs_mode: Literal["temperature", "processed"] = "temperature",
        weight_sync: Callable[[Any], None] | None = None,
        validate: bool = True,
        kv_cache_dtype: str | None = None,
        decode: str = "auto",
        refresh: Literal["in_place", "rebuild"] = "in_place",
        activation_scale: Literal["recipe", "calibrated"] = "recipe",
        fused_weight_scale: Literal["independent", "shared"] = "independent",
        keep_decode: bool = True,
        compile_decode: bool = False,
    ):
        super().__init__(params=params, weight_sync=weight_sync, validate=validate)
        if sampler_model not in ("shared", "copy"):
            raise ValueError(f"sampler_model must be 'shared' or 'copy', got {sampler_model!r}")
        if (
            dtype is not None or prepare_model is not None or refresh != "in_place"
        ) and sampler_model != "copy":
            raise ValueError(
                "dtype, prepare_model and refresh apply to a separate copy: pass sampler_model='copy'"
            )
        if logprobs_mode not in ("temperature", "processed"):
            raise ValueError(f"logprobs_mode must be 'temperature' or 'processed', got {logprobs_mode!r}")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        kv_format(kv_cache_dtype)
        if decode not in DECODES:
            raise ValueError(f"decode must be one of {DECODES}, got {decode!r}")
        if refresh not in ("in_place", "rebuild"):
            raise ValueError(f"refresh must be 'in_place' or 'rebuild', got {refresh!r}")
        if activation_scale not in ACTIVATION_SCALES:
            raise ValueError(f"activation_scale must be one of {ACTIVATION_SCALES}, got {activation_scale!r}")
        if activation_scale == "calibrated" and (sampler_model != "copy" or prepare_model is None):
            raise ValueError(
                "activation_scale='calibrated' calibrates the NVFP4 layers of a sampler copy: pass "
                "sampler_model='copy' and an NVFP4 prepare_model (sampler_kwargs precision: nvfp4)"
            )
        if fused_weight_scale not in FUSED_WEIGHT_SCALES:
            raise ValueError(
                f"fused_weight_scale must be one of {FUSED_WEIGHT_SCALES}, got {fused_weight_scale!r}"
            )
        if fused_weight_scale == "shared" and (sampler_model != "copy" or prepare_model is None):
            raise ValueError(
                "fused_weight_scale='shared' sets the weight scales of the NVFP4 layers of a sampler copy: pass "
                "sampler_model='copy' and an NVFP4 prepare_model (sampler_kwargs precision: nvfp4)"
            )
        self.activation_scale = activation_scale
        self.fused_weight_scale = fused_weight_scale
        #: the calibrated activation amax by layer name (``activation_scale="calibrated"``; None until the
        #: first build), fixed for the rest of the run
        self.activation_amax: dict[str, float] | None = None
        self._calibration_prompts: list[list[int]] | None = None
        self.decode = decode
        self.keep_decode = keep_decode
        self.compile_decode = compile_decode
        #: the static decode states kept across calls (``keep_decode``)
        self.decode_graphs = DecodeGraphs()
        self.refresh = refresh
        self.model = model
        self.sampler_model = sampler_model
        self.dtype = dtype
        self.prepare_model = prepare_model
        self.seed = seed
        self.batch_size = batch_size
        self.logprobs_mode = logprobs_mode
        self.kv_cache_dtype = kv_cache_dtype
        self.copy: torch.nn.Module | None = None
        self._blocker: str | None = None  # why the built copy cannot be refreshed in place (None: it can)
        self._warned = False
        self._generator: torch.Generator | None = None
        self._restored_state: torch.Tensor | None = (
            None  # a checkpoint's generator state, applied on first use
        )

    # -- generation ------------------------------------------------------------------------------------------
    def _generator_for(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            seed = self.seed if self.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
            seed += RANK_SEED_STRIDE * self.rank  # processes of one run must not draw the same samples
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(seed)
            if self._restored_state is not None:
                self._generator.set_state(self._restored_state)
                self._restored_state = None
        return self._generator

    def state_dict(self) -> dict:
        """The sampler generator's state (per process; empty before the first rollout) and the calibrated
        activation amax (``activation_scale="calibrated"``, once calibrated: a resumed run keeps its scales)."""
        out = {} if self.activation_amax is None else {"activation_amax": dict(self.activation_amax)}
        if self._generator is None:
            if self._restored_state is not None:
                out["generator"] = self._restored_state.tolist()
            return out
        return {"generator": self._generator.get_state().tolist(), **out}

    def load_state_dict(self, state: dict) -> None:
        if state.get("activation_amax") is not None and self.activation_scale == "calibrated":
            self.activation_amax = {str(k): float(v) for k, v in state["activation_amax"].items()}
        if "generator" in state:
            self._restored_state = torch.tensor(state["generator"], dtype=torch.uint8)
            self._generator = None  # rebuilt on the model's device at the next rollout, then restored

    def generate(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams | None = None,
        eos_ids: Sequence[int] | None = None,
        model: torch.nn.Module | None = None,
    ) -> dict:
        """Sample one completion per prompt with ``model`` (default: the constructor's model)."""
        model = model if model is not None else self.model
        if model is None:
            raise ValueError("HFSampler.generate needs a model (constructor argument or call argument)")
        params = params if params is not None else self.params
        if params is None:
            raise ValueError(
                "HFSampler.generate needs SamplingParams (constructor argument or call argument)"
            )
        gen_config = getattr(model, "generation_config", None)
        if eos_ids is None:
            eos_ids = getattr(gen_config, "eos_token_id", None)
            eos_ids = [eos_ids] if isinstance(eos_ids, int) else list(eos_ids or [])
        pad_id = getattr(gen_config, "pad_token_id", None)
        pad_id = pad_id if pad_id is not None else (eos_ids[0] if eos_ids else 0)
        device = next(model.parameters()).device
        generator = self._generator_for(device)
        step = self.batch_size or max(len(prompt_ids), 1)
        widest = max((len(p) for p in prompt_ids), default=0)
        result = {"completion_ids": [], "logprobs": []}
        was_training = model.training
        model.eval()
        try:
            for start in range(0, len(prompt_ids), step):
                part = sample_with_kv_cache(
                    model,
                    prompt_ids[start : start + step],
                    params,
                    eos_ids,
                    generator=generator,
                    logprobs_mode=self.logprobs_mode,
                    pad_id=int(pad_id),
                    kv_cache_dtype=self.kv_cache_dtype,
                    decode=self.decode,
                    decode_state=self.decode_graphs if self.keep_decode else None,
                    compile_decode=self.compile_decode,
                    cache_width=widest,
                )
                for k in result:
                    result[k].extend(part[k])
        finally:
            model.train(was_training)
        return result

    # -- trainer integration ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _unwrapped(self, trainer: Any):
        """The trainer's model unwrapped for generation (DDP/DeepSpeed/FSDP), like TRL's ``generate`` path."""
        from trl.models import unwrap_model_for_generation

        args = trainer.args
        dist = getattr(trainer, "_dist", None)
        summon = (
            dist.summon_full_params(trainer.model_wrapped, recurse=False)
            if dist
            else contextlib.nullcontext()
        )
        with (
            unwrap_model_for_generation(
                trainer.model_wrapped,
                trainer.accelerator,
                gather_deepspeed3_params=getattr(args, "ds3_gather_for_generation", True),
                gradient_checkpointing_kwargs=getattr(args, "gradient_checkpointing_kwargs", None),
            ) as unwrapped,
            summon,
        ):
            yield unwrapped

    def _build_copy(self, source: torch.nn.Module) -> torch.nn.Module:
        dup = copy.deepcopy(source)
        # Instance-level ``forward`` overrides are closures over the *source* model (TRL's fused LM head keeps
        # ``original_forward`` of the trainer's model; deepcopy cannot reach into closures), so the copy would
        # silently run the trainer's weights. The sampler wants the class forward anyway: drop the overrides.
        for module in dup.modules():
            module.__dict__.pop("forward", None)
        for name in ("activation_checkpointing_disable", "gradient_checkpointing_disable"):  # new name first
            if hasattr(dup, name):
                getattr(dup, name)()
                break
        if self.dtype is not None or self.prepare_model is not None:
            # other numerics than the learner's: start from its high-precision form (an NVFP4 learner's
            # NVFP4Linear / NVFP4MoeExperts back to nn.Linear / the original experts, same parameters); a frozen
            # NVFP4 base stays: its codes are the weights, shared with the learner
            from triage.kernels import unconvert

            unconvert(dup, frozen=False)
        if self.dtype is not None:
            dup = dup.to(self.dtype)
        # ``.to(dtype)`` also casts RoPE's ``inv_freq`` buffers, which ``from_pretrained(dtype=...)`` and the
        # engines keep in fp32 (non-persistent: a later sync never repairs them): restore the source's, before
        # a calibration forward (which must see the model the copy serves)
        for name, buf in source.named_buffers():
            if name.endswith("inv_freq"):
                module, _, attr = name.rpartition(".")
                target = dup.get_submodule(module)
                target._buffers[attr] = buf.detach().to(target._buffers[attr].device, copy=True)
        if self.activation_scale == "calibrated" and self.activation_amax is None:
            self.activation_amax = self._calibrate(dup)
        if self.prepare_model is not None:
            prepared = self.prepare_model(dup)
            dup = prepared if prepared is not None else dup
        if self.activation_scale == "calibrated":
            from triage.kernels.calibration import set_static_activation_scales

            try:
                set_static_activation_scales(dup, self.activation_amax)
            except ValueError as err:
                raise ValueError(f"HFSampler(activation_scale='calibrated'): {err}") from None
        self._share_fused_weight_scales(dup)
        from triage.kernels.siblings import link_siblings

        link_siblings(dup)  # a copy loads unlinked: q/k/v and gate/up one decode launch per group again
        from triage.kernels.capture import keep_weight_addresses

        keep_weight_addresses(
            dup
        )  # its W_q re-quantized in place at each sync: a kept decode graph stays valid
        dup.requires_grad_(False)
        return dup.eval()

    def _share_fused_weight_scales(self, model: torch.nn.Module) -> None:
        """``fused_weight_scale="shared"``: the fused shards' weight outer scale from their group's current
        amax (after every write of new weights: a build, an in-place refresh)."""
        if self.fused_weight_scale != "shared":
            return
        from triage.kernels.calibration import set_fused_weight_scales

        try:
            set_fused_weight_scales(model)
        except ValueError as err:
            raise ValueError(f"HFSampler(fused_weight_scale='shared'): {err}") from None

    @torch.no_grad()
    def _calibrate(self, model: torch.nn.Module) -> dict[str, float]:
        """The static activation amax of ``model`` (the un-quantized copy) on the calibration prompts: each
        distinct prompt forwarded alone (no pad token reaches a layer), the max per layer over them and, with
        several processes, over all of them (one set of scales, as one served checkpoint has)."""
        from triage.kernels.calibration import calibrate_activation_amax

        if not self._calibration_prompts:
            raise ValueError(
                "HFSampler(activation_scale='calibrated') calibrates on the first prompts batch it generates "
                "for: build the copy through a rollout call (sampler(prompts, trainer))"
            )
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        amax: dict[str, float] = {}
        try:
            for prompt in dict.fromkeys(tuple(p) for p in self._calibration_prompts):
                ids = torch.tensor([prompt], dtype=torch.long, device=device)
                positions = torch.arange(len(prompt), device=device)[None]
                one = calibrate_activation_amax(model, ids, torch.ones_like(ids), positions)
                for name, value in one.items():
                    amax[name] = max(amax.get(name, 0.0), value)
        finally:
            model.train(was_training)
        if not amax:
            raise ValueError(
                "HFSampler(activation_scale='calibrated'): the model has no Linear layer inside a decoder layer "
                "(`.layers.<i>.` module names) to calibrate"
            )
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            names = sorted(amax)
            values = torch.tensor([amax[n] for n in names], dtype=torch.float64, device=device)
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
            amax = dict(zip(names, values.tolist()))
        self._calibration_prompts = None
        return amax

    def sync_weights(self, trainer: Any) -> None:
        """Make the sampler copy serve the trainer's current weights (``"copy"`` only).

        The first sync builds the copy (:meth:`_build_copy`: deep copy → cast → ``prepare_model``); every later
        sync refreshes it in place: ``copy.load_state_dict(trainer_model.state_dict())``, i.e. each parameter
        and persistent buffer is written with ``copy_`` (cast to the copy's dtype), so the copy's NVFP4 layers
        re-quantize lazily on their next forward (the write bumps the weight's ``_version``, part of their
        weight-cache key). That equals a rebuild exactly when the copy's state is the trainer's state cast,
        name for name: checked on every build (:func:`_in_place_blocker`); when it is not (a ``prepare_model``
        that renames, reshapes or rewrites weights) or the in-place load fails, the copy is rebuilt, with a
        one-time warning saying why. ``refresh="rebuild"`` rebuilds at every sync. A ``torch.compile``-wrapped
        trainer model is copied without the wrapper: the copy runs eagerly. With ``fused_weight_scale="shared"``
        both paths then set the fused shards' weight scales from the new weights' group amax.
        """
        if self.sampler_model == "copy":
            from accelerate.utils import is_compiled_module

            with self._unwrapped(trainer) as source, torch.no_grad():
                # accelerate's unwrap keeps a ``torch.compile`` wrapper (``_orig_mod.*`` keys, an instance
                # ``forward`` over the trainer's module, dropped by the build): copy the module it wraps
                source = source._orig_mod if is_compiled_module(source) else source
                if not self._refreshed_in_place(source):
                    self.decode_graphs.clear()  # they hold the old copy
                    self.copy = None  # free the old copy before building the new one
                    self.copy = self._build_copy(source)
                    if self.refresh == "in_place":
                        self._blocker = _in_place_blocker(self.copy, source)
                        if self._blocker is not None:
                            self._warn_once(f"{self._blocker}; it is rebuilt at every weight sync instead")
        super().sync_weights(trainer)

    def _refreshed_in_place(self, source: torch.nn.Module) -> bool:
        """Whether the copy can be refreshed in place, and so was (``source``'s state loaded into it)."""
        if self.copy is None or self.refresh == "rebuild" or self._blocker is not None:
            return False
        try:
            self.copy.load_state_dict(source.state_dict())
        except RuntimeError as err:  # keys or shapes changed since the build: the message names them
            self._warn_once(
                f"loading the trainer model's state failed ({' '.join(str(err).split())}); rebuilt"
            )
            return False
        self._share_fused_weight_scales(self.copy)  # the group amax of the weights just written
        return True

    def _warn_once(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"HFSampler: the sampler copy cannot be refreshed in place: {message} (deep copy, cast, "
                "prepare_model)",
                RuntimeWarning,
                stacklevel=3,
            )

    def __call__(self, prompts: list, trainer: Any) -> dict:
        from .base import trainer_eos_ids, trainer_prompt_ids

        self.rank = trainer_rank(trainer)
        prompt_ids = trainer_prompt_ids(prompts, trainer)
        if self.activation_scale == "calibrated" and self.activation_amax is None:
            self._calibration_prompts = prompt_ids  # the first batch calibrates the copy's activation scales
        self.maybe_sync_weights(trainer)
        params, eos_ids = self.params_for(trainer), trainer_eos_ids(trainer)
        if self.sampler_model == "copy":
            out = self.generate(prompt_ids, params, eos_ids, model=self.copy)
        else:
            with self._unwrapped(trainer) as model:
                out = self.generate(prompt_ids, params, eos_ids, model=model)
        return self.finish({"prompt_ids": prompt_ids, **out}, prompts, trainer)
