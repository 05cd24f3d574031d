"""The static decode state of the built-in sampler: a static KV cache, the decode step's input buffers and its
CUDA graph, kept from one :func:`~triage.trainers.sampling.hf.sample_with_kv_cache` call to the next.

A decode step reads three input buffers updated in place (the token, its position, the 4-D attention mask
over the whole cache) and the static cache, and returns the last position's logits. With
``decode="cuda_graph"`` the step is captured once and replayed (:class:`GraphStep`). Capturing is not free: an
eager warm-up step first (lazy allocations, kernel compilation, weight caches), then the capture, each a full
eager forward's host time, per call where the graph lives for one call. :class:`DecodeGraphs` keeps the
state instead (the built-in ``HFSampler`` keeps one per sampler), so that the next call of the same shape
resets the cache in place and replays at once:

* prefill: the static paths pass the prompt's forward an explicit 4-D mask (:func:`prefill_mask`: causal,
  pad keys off) and its inputs as static buffers. With :data:`CAPTURE_PREFILL` (the default) both pad the
  prompts on the left to :func:`prefill_width` (a bucket of the widest prompt's width), and with a kept
  CUDA-graph state the prefill of each width is captured the second time that width comes (the first runs
  eagerly: the warm-up) and replayed after that, :data:`PREFILL_KEPT` widths per state at most (the least recently used dropped first), their graphs in
  one memory pool (each prefill's logits are read before the next prefill replays): a call on a kept state
  then runs no eager forward at all. Not with an fp8 KV cache (its prefill calibrates the scales with a host
  check) nor for more than :data:`PREFILL_GRAPH_MAX_TOKENS` prompt tokens (rows × padded width: the GPU time
  of such a prefill hides its host time): the prefill then runs eagerly on every call.

* shape: one state per model, batch, cache length, KV format, decode path (static or graph; compiled or not),
  cache argument name, attention implementation, parameter dtype and device and autocast dtype, held without
  holding the model (a state goes when its model is freed);
  the cache length is :func:`static_cache_length` of the prompt width and ``max_new_tokens`` (rounded up to a
  bucket, so that calls whose prompts differ a little in width share a state; ``HFSampler`` sizes every
  chunk of a call by the call's widest prompt); :data:`KEPT` states at most (the last used: an
  ``HFSampler(batch_size=...)`` call's full chunks and its last, smaller one).
* weights: a kept graph is replayed only while :func:`~triage.kernels.capture.graph_key` of the model is the
  one it was captured under (every parameter, buffer and NVFP4 weight cache at the same address, the
  configs, train/eval mode, PEFT adapter switches, host-read decode scales): checked at the start of each
  call's prefill (the check refreshes the NVFP4 weight caches, as a forward would), and every graph of the
  state goes when it changed. Values written in place (a weight sync into the sampler
  copy, an optimizer step on the trainer's model) are read by the replay; anything reallocated (a rebuilt
  copy, an NVFP4 cache quantized into new tensors) or changed in Python drops the graph, and the next steps
  warm up and capture again. The sampler's copy refreshes its NVFP4 caches in place
  (:func:`~triage.kernels.capture.keep_weight_addresses`), so one capture serves every weight sync, except
  where a sync changes a config (``fused_weight_scale="shared"``: new static weight scales) or a host-read
  scale (more than ``SMALL_M`` rows per decode step with static activation scales: cuBLAS alpha GEMMs).
* compiled (``compile_decode=True``): the step's forward goes through ``torch.compile`` (inductor; static
  shapes), so that the norms, RoPE, activations and residual adds of an eager Hugging Face layer fuse into
  fewer kernels; the NVFP4 layers are one custom op each (``triage::nvfp4_linear``,
  ``triage::frozen_nvfp4_linear``), their sibling groups still one launch. The graph captures the compiled
  step. Compiling costs time at the first step of each new shape (a minute or more at Qwen3-4B size), and
  torch's recompile limit (``torch._dynamo.config.recompile_limit``, 8 by default) bounds the shapes one
  process compiles; past it the step runs uncompiled.
* memory: a kept state holds its KV cache (batch × cache length × layers × KV heads × head dim × 2 values)
  and its graphs' private memory pools (the decode step's, and its prefills' one: the activations of up to
  :data:`PREFILL_GRAPH_MAX_TOKENS` tokens through one layer) between calls, while the learner trains; ``HFSampler(keep_decode=False)``
  frees them at the end of every call instead (each call then captures anew).
* bits: a call on a kept state computes what a call on a fresh state computes (the cache is zeroed, the fp8
  KV scales recalibrated in place on the prefill, the same length), except that with a kept graph its
  prefill and first decode step are replays where a new graph runs them eagerly; a replay runs the captured kernels,
  which need not be the eager ones bit for bit (docs/benchmarks.md saw equal bits at decode batch ≤ 16 on a
  10M-parameter model, not at 128, nor at batch 16 at Qwen3-4B width).
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable

import torch

from .attention import packed_decode_attention, uses_grouped_sdpa

__all__ = [
    "DecodeGraphs",
    "GraphStep",
    "StaticDecode",
    "prefill_mask",
    "prefill_width",
    "static_cache_length",
]

#: States a :class:`DecodeGraphs` keeps (least recently used dropped first).
KEPT = 2
#: The cache-length bucket: lengths round up to a multiple of max(BUCKET_MIN, next_power_of_2(n) / BUCKET_SPLIT).
BUCKET_MIN, BUCKET_SPLIT = 64, 16
#: The prompt-width bucket of the static paths: widths round up to a multiple of
#: max(PREFILL_BUCKET_MIN, next_power_of_2(width) / PREFILL_BUCKET_SPLIT).
PREFILL_BUCKET_MIN, PREFILL_BUCKET_SPLIT = 16, 8
#: Prefill graphs (one per padded prompt width) a kept CUDA-graph state keeps (least recently used dropped first).
PREFILL_KEPT = 4
#: Prefills of more tokens (rows × padded width) than this run eagerly: their GPU time hides the host's, and a
#: capture would hold their activations.
PREFILL_GRAPH_MAX_TOKENS = 2048
#: Whether kept CUDA-graph states capture the prefill and the static paths pad prompts to a width bucket (module
#: docstring); False: the prefill runs eagerly every call, on the prompts' own width.
CAPTURE_PREFILL = True


def prefill_width(width: int) -> int:
    """The width the static paths left-pad a call's prompts to: ``width`` rounded up to a multiple of
    ``max(16, next_power_of_2(width) / 8)`` (fewer than ``max(16, width / 4)`` pad columns more), so that calls
    whose widest prompts differ a little share one captured prefill."""
    step = max(PREFILL_BUCKET_MIN, (1 << (width - 1).bit_length()) // PREFILL_BUCKET_SPLIT)
    return -(-width // step) * step


def prefill_mask(
    attention_mask: torch.Tensor, length: int, additive_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The prompt forward's 4-D mask ``[B, 1, W, length]`` over a static cache whose first ``W`` positions the
    prompt fills: query ``q`` sees key ``k`` iff ``k ≤ q`` and ``attention_mask[b, k]`` (a pad key is never
    seen; a pad query sees only pads, or nothing). ``True`` = attend (SDPA); with ``additive_dtype`` (eager
    attention, which adds the mask) 0 or that dtype's minimum instead."""
    batch, width = attention_mask.shape
    device = attention_mask.device
    keys = torch.arange(length, device=device)
    causal = keys[None, :] <= torch.arange(width, device=device)[:, None]  # [W, L]; k >= W never: k > q
    padded = torch.zeros((batch, length), dtype=torch.bool, device=device)
    padded[:, :width] = attention_mask.bool()
    allowed = (causal[None] & padded[:, None, :])[:, None]
    if additive_dtype is None:
        return allowed
    off = torch.full((), torch.finfo(additive_dtype).min, dtype=additive_dtype, device=device)
    return torch.where(allowed, torch.zeros((), dtype=additive_dtype, device=device), off)


def static_cache_length(width: int, max_new_tokens: int) -> int:
    """Positions of the static cache for prompts ``width`` wide and ``max_new_tokens`` new tokens: the last
    sampled token is never fed back, so ``n = width + max(max_new_tokens − 1, 1)`` suffice, rounded up to a
    multiple of ``max(64, next_power_of_2(n) / 16)``: fewer than ``max(64, n / 8)`` positions more than
    needed, masked like the not-yet-written ones."""
    n = width + max(max_new_tokens - 1, 1)
    step = max(BUCKET_MIN, (1 << (n - 1).bit_length()) // BUCKET_SPLIT)
    return -(-n // step) * step


class GraphStep:
    """One forward on static buffers (``step()`` → last-position logits: a decode step, or a prefill),
    replayed from a CUDA graph once captured.

    The first call after :meth:`reset` runs eagerly: it warms every lazy allocation (static-cache buffers,
    kernel compilation, weight caches). The next captures the step and replays it; later calls replay. A
    capture that fails (an op that synchronises with the host, say) is reported once with a warning and the
    step runs eagerly until the next :meth:`reset`. ``what`` names the step in that warning; ``pool``: a
    CUDA-graph memory pool to capture into (``torch.cuda.graph_pool_handle()``), shared with graphs that never
    replay at the same time and whose outputs are read before the next of them replays."""

    def __init__(self, step: Callable[[], torch.Tensor], what: str = "decode step", pool=None):
        self.step, self.what, self.pool = step, what, pool
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.calls, self.failed, self.captures = 0, False, 0

    def reset(self) -> None:
        """Drop the graph (its memory pool is freed): the next call warms up again."""
        self.graph, self.logits, self.calls, self.failed = None, None, 0, False

    def __call__(self) -> torch.Tensor:
        self.calls += 1
        if self.graph is not None:
            self.graph.replay()
            return self.logits
        if self.failed or self.calls == 1:
            return self.step()
        from triage.kernels.linear import capture_scope
        from triage.kernels.nvfp4.gemm_decode import graph_counters

        graph = torch.cuda.CUDAGraph()
        try:
            # one split-K counter buffer for the graph; sibling layers share input quantizations within it
            pool = {} if self.pool is None else {"pool": self.pool}  # a memory pool shared with other graphs
            with torch.cuda.graph(graph, **pool), graph_counters(), capture_scope():
                logits = self.step()
        except Exception as err:  # noqa: BLE001 - any capture failure falls back to the eager path
            self.failed = True
            warnings.warn(
                f"HFSampler: CUDA-graph capture of the {self.what} failed ({type(err).__name__}: {err}); "
                f"running the {self.what} eagerly with the static cache instead",
                RuntimeWarning,
                stacklevel=3,
            )
            torch.cuda.synchronize()
            return self.step()
        self.graph, self.logits = graph, logits
        self.captures += 1
        graph.replay()  # capture records the step without running it
        return self.logits


#: The ``torch.compile`` backend of a compiled decode step (``compile_decode``).
COMPILE_BACKEND = "inductor"
_COMPILED: dict[str, Callable] = {}


def _step(model: torch.nn.Module, **inputs) -> torch.Tensor:
    """One decode forward: the last position's logits."""
    return model(**inputs).logits[:, -1, :]


def _compiled_step() -> Callable:
    """:func:`_step` through ``torch.compile`` (static shapes: one graph per batch and cache length), one per
    backend for the process. The model is an argument, so nothing here keeps a model alive."""
    if COMPILE_BACKEND not in _COMPILED:
        _COMPILED[COMPILE_BACKEND] = torch.compile(_step, dynamic=False, backend=COMPILE_BACKEND)
    return _COMPILED[COMPILE_BACKEND]


class StaticDecode:
    """A static KV cache for ``batch`` rows and ``length`` positions, the step's input buffers and the step
    (eager, or a :class:`GraphStep`): what one decode runs on, reusable by the next call of the same shape
    (module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        batch: int,
        length: int,
        fmt: str,
        graph: bool,
        cache_name: str,
        compiled: bool = False,
    ) -> None:
        from .kvcache import kv_cache

        device = next(model.parameters()).device
        self._model = weakref.ref(model)  # a kept state does not keep its model alive (DecodeGraphs drops it)
        self.length, self.cache_name = length, cache_name
        self.cache = kv_cache(model.config, fmt, max_cache_len=length)
        self.token = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.position = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.mask4: torch.Tensor | None = None  # built on the first call: its dtype is the logits'
        self.on = self.off = None
        forward = weakref.WeakMethod(self._forward)  # no cycle: a state is freed as soon as it is dropped
        self.graph_step = GraphStep(lambda: forward()()) if graph else None
        self.weights: tuple | None = None  # graph_key(model) the kept graphs were captured under
        self.prefills: OrderedDict[int, _Prefill] = OrderedDict()  # per padded prompt width
        self.prefill_pool = None  # their graphs' shared memory pool
        self.calls = 0
        self.compiled = compiled
        self.packed = uses_grouped_sdpa(model)  # whether a decode step runs packed grouped-query attention
        # eager attention adds its masks (0 or min), SDPA reads bool ones (the attention kind is in a state's key)
        self.additive = model.config._attn_implementation == "eager"
        # the forward's keyword for "last position's logits only", where it has one
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.keep = (
            {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(base.forward).parameters else {}
        )

    @property
    def model(self) -> torch.nn.Module:
        return self._model()

    def _forward(self) -> torch.Tensor:
        step = _compiled_step() if self.compiled else _step
        with packed_decode_attention(self.packed):  # grouped KV heads without repeat_kv (.attention)
            return step(
                self.model,
                input_ids=self.token,
                attention_mask=self.mask4,
                position_ids=self.position,
                use_cache=True,
                **{self.cache_name: self.cache},
            )

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor):
        """This call's prompt forward into the emptied cache → the last position's logits [B, V]: with
        :func:`prefill_mask`, on the static buffers of its width; with a graph state, first the
        weights check (:func:`~triage.kernels.capture.graph_key`: every kept graph goes when it changed), then
        the width's kept prefill graph (module docstring)."""
        batch, width = input_ids.shape
        if self.calls:
            self.cache.reset()
        calibrates = False  # an fp8 KV cache calibrates its scales on the prefill, with a host check
        for layer in self.cache.layers:
            if hasattr(layer, "recalibrate"):
                layer.recalibrate(attention_mask)
                calibrates |= getattr(layer, "fmt", None) == "fp8"
        self.calls += 1
        if self.graph_step is not None:
            from triage.kernels.capture import graph_key

            key = graph_key(self.model)
            if key != self.weights:  # the weights moved: every kept graph goes (the next calls capture again)
                for step in self._graph_steps():
                    step.reset()
                self.weights = key
        mask = prefill_mask(attention_mask, self.length, self.model.dtype if self.additive else None)
        captured = (
            self.graph_step is not None
            and CAPTURE_PREFILL
            and not calibrates
            and batch * width <= PREFILL_GRAPH_MAX_TOKENS
        )
        if not captured:
            return self._prefill_forward(input_ids, mask, position_ids)
        kept = self.prefills.pop(width, None)
        if kept is None or kept.mask.dtype != mask.dtype:
            while len(self.prefills) >= PREFILL_KEPT:
                self.prefills.popitem(last=False)
            if self.prefill_pool is None:  # one memory pool for the state's prefill graphs (module docstring)
                self.prefill_pool = torch.cuda.graph_pool_handle()
            kept = _Prefill(self, input_ids, mask, position_ids)
        self.prefills[width] = kept
        kept.ids.copy_(input_ids)
        kept.mask.copy_(mask)
        kept.positions.copy_(position_ids)
        logits = kept.step()
        if kept.step.calls == 2:  # captured just now (or failed to)
            self._captured(kept.step)
        return logits

    def _prefill_forward(self, input_ids, mask, position_ids) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
            **{self.cache_name: self.cache}, **self.keep,
        )  # fmt: skip
        return out.logits[:, -1, :]

    def _graph_steps(self) -> list[GraphStep]:
        return [s for s in (self.graph_step, *(p.step for p in self.prefills.values())) if s is not None]

    def _captured(self, step: GraphStep) -> None:
        """``step`` was captured just now: the weights key as it read them; a graph captured before under
        another key goes (its warm-up moved a tensor the others read)."""
        from triage.kernels.capture import graph_key

        key = graph_key(self.model)
        if key != self.weights:
            for other in self._graph_steps():
                if other is not step:
                    other.reset()
            self.weights = key

    def start(self, attention_mask: torch.Tensor, next_position: torch.Tensor, dtype: torch.dtype) -> None:
        """After the prefill: the mask over the prompt keys (generated keys switched on as written) and the
        first decode position."""
        batch, width = attention_mask.shape
        mask_dtype = dtype if self.additive else torch.bool
        if self.mask4 is None or self.mask4.dtype != mask_dtype:  # new, or the logits' dtype changed
            self.on, self.off = (0.0, torch.finfo(dtype).min) if self.additive else (True, False)
            self.mask4 = torch.empty((batch, 1, 1, self.length), dtype=mask_dtype, device=self.token.device)
            if self.graph_step is not None:
                self.graph_step.reset()  # a graph would read the old mask
        self.mask4.fill_(self.off)
        self.mask4[:, 0, 0, :width].masked_fill_(attention_mask.bool(), self.on)
        self.position.copy_(next_position[:, None])

    def advance(self, token: torch.Tensor, written: int) -> torch.Tensor:
        """One decode step: feed ``token`` (B,), switch on the key position it is written to, return the
        logits of the next position."""
        self.token.copy_(token[:, None])
        self.mask4[:, 0, 0, written] = self.on
        step = self.graph_step
        if step is None:
            logits = self._forward()
        else:
            logits = step()
            if step.calls == 2:  # captured just now (or failed to): the key of what it read, as it read it
                self._captured(step)
        self.position.add_(1)
        return logits


class _Prefill:
    """A kept state's prefill of one padded prompt width: its input buffers (ids, 4-D mask, positions) and its
    :class:`GraphStep` (the first call eager, the second captured)."""

    def __init__(self, state: StaticDecode, input_ids, mask, position_ids) -> None:
        ids, mask, positions = (torch.empty_like(t) for t in (input_ids, mask, position_ids))
        self.ids, self.mask, self.positions = ids, mask, positions
        forward = weakref.WeakMethod(state._prefill_forward)  # no cycle through the state nor this object
        self.step = GraphStep(
            lambda: forward()(ids, mask, positions), what="prefill", pool=state.prefill_pool
        )


class DecodeGraphs:
    """The :class:`StaticDecode` states kept across calls (module docstring): at most :data:`KEPT`, the least
    recently used dropped first. ``clear()`` frees them all (a rebuilt sampler copy, ``keep_decode=False``)."""

    def __init__(self) -> None:
        self.states: OrderedDict[tuple, StaticDecode] = OrderedDict()
        self._watched: set[int] = set()  # ids of the models a finalizer drops the states of

    def clear(self) -> None:
        self.states.clear()

    def __reduce__(self):
        return DecodeGraphs, ()  # a copy or a pickle starts empty (the states are this process's GPU memory)

    def state(self, model: torch.nn.Module, *shape) -> StaticDecode:
        """The kept state for ``model`` and ``shape`` (:class:`StaticDecode`'s arguments after the model), or a
        new one (dropping the oldest beyond :data:`KEPT` first)."""
        param = next(model.parameters())
        autocast = torch.is_autocast_enabled(param.device.type)
        key = (id(model), *shape, model.config._attn_implementation, param.dtype, param.device,
               autocast and torch.get_autocast_dtype(param.device.type))  # fmt: skip
        state = self.states.pop(key, None)
        if state is None or state.model is not model:
            while len(self.states) >= KEPT:
                self.states.popitem(last=False)
            state = StaticDecode(model, *shape)
            if id(model) not in self._watched:  # a freed model's states go with it
                self._watched.add(id(model))
                weakref.finalize(model, _forget_model, weakref.ref(self), id(model))
        self.states[key] = state
        return state


def _forget_model(graphs: weakref.ref, model_id: int) -> None:
    """A model was freed: drop its states from the :class:`DecodeGraphs` (if that still exists)."""
    kept = graphs()
    if kept is not None:
        kept._watched.discard(model_id)
        for key in [k for k in kept.states if k[0] == model_id]:
            del kept.states[key]
