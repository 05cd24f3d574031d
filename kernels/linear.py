"""``NVFP4Linear``: a drop-in ``nn.Linear`` whose forward GEMM runs in NVFP4 (models are converted by
:func:`triage.kernels.convert`).

Forward (both backward settings)::

    x_q = quantize(x, activation)            # 1×16 blocks along K, per call (once per input: share_inputs)
    W_q = quantize(W, weight)                # cached until W changes; per call if capturable (see below)
    y   = gemm(x_q, W_q) + b                 # exact products, fp32 accumulation, one rounding

Backward, ``backward="bf16-backward"`` (straight-through; the fast setting)::

    dx = dy · W        dW = dyᵀ · x        db = Σ dy

in the high-precision dtype, on the *unquantized* master weight W and input x. Straight-through means
the quantizer's derivative is taken to be the identity: ∂y/∂x ≈ W and ∂y/∂W ≈ x although the forward
used W_q and x_q. The quantization error is invisible to the gradient.

Backward, ``backward="nvfp4-backward"`` (Transformer-Engine style, also straight-through)::

    dx = gemm(Q_sr(dy), W_qᵀ)                          # dgrad: dy 1×16 along N, stochastic rounding
    dW = gemm(Q_sr,H(dyᵀ), Q_H(xᵀ))                    # wgrad: both operands 1×16 along the tokens M,
                                                       # through the 16-point Hadamard transform H
    db = Σ dy

(the wgrad operands dyᵀ, xᵀ are quantized straight from the row-major dy, x by
:func:`~triage.kernels.nvfp4.quantize_columns.quantize_columnwise`: no transposed copy, same bytes)

W_qᵀ reuses the forward quantization: with 16×16 weight blocks (``weight.block="16x16"``) the
per-tile scale is the same for W and Wᵀ, so W_qᵀ is W_q's codes and scales transposed (no second
quantization, bit-identical to quantizing Wᵀ). H is orthogonal and applied to both wgrad operands along
the contraction dim, so H·Hᵀ = I cancels inside the product; it spreads outliers before quantizing.
Stochastic rounding keeps the gradient estimator unbiased; its seed is ``grad.seed`` plus a per-
module call counter (deterministic run to run, different every step: :func:`_rounding_seeds`; a
``capturable`` layer counts its forwards instead, below).

Forward GEMM: for more than ``SMALL_M`` rows the activation quantizer also writes the exact bf16 ``q·s``
(``emit_expanded``) and the GEMM runs on expansions (see :mod:`triage.kernels.nvfp4.matmul`); decode-sized
inputs on the decode kernel (:func:`~triage.kernels.nvfp4.matmul.decode_route`: ``gemm_backend="triton"``, or
``"auto"`` below sm_100) stream the packed weight instead, reading x (and dy in the nvfp4 dgrad) as its exact
fp16 ``q·s``, which the Triton quantizer writes in the same pass.

Weight cache. ``W_q`` (and, for the large-M path, its exact bf16 expansion ``q·s`` and its per-tensor decode
scale as a host float) is cached on the module and reused while :func:`weight_key` of the weight is unchanged:

    (weight generation, W._version, W.data_ptr(), dtype, shape, device)

The *weight generation* is a process-wide counter bumped after every ``step()`` of every
``torch.optim.Optimizer`` (one global ``register_optimizer_step_post_hook``, installed when this module is
imported): fused AdamW (transformers' default ``adamw_torch_fused``) and fused SGD write the parameters
without bumping ``_version``, and so does FSDP2's re-gather of sharded parameters, so the version alone
cannot tell. Within one optimizer step the weights are fixed, so every forward of the step (old-logprob
pass, the training forward of each micro-batch, the gradient-checkpointing recompute, sampling from the
learner) quantizes each weight once; the first forward after a step quantizes anew. ``_version`` catches
in-place writes through autograd-visible ops between steps (``param.copy_()`` / ``param.add_()`` under
``no_grad``, ``load_state_dict``); ``data_ptr`` catches a replaced ``param.data`` (the cache holds a
reference to the weight it quantized, not a copy, so that storage cannot be freed and its address reused
while cached). The one write no key can see is a raw ``param.data`` write outside an optimizer step (for
example a hand-written ``p.data.add_(...)`` update loop): call :func:`invalidate_weight_caches` (every
NVFP4 layer) or :meth:`NVFP4Linear.invalidate_cache` (one layer) after it.

Non-finite values. The quantizers keep the engines' bytes (a NaN becomes a finite code there), so the layer
decides: a NaN or ±Inf in an operand it quantizes (x, W; dy, xᵀ, dyᵀ in ``nvfp4-backward``) makes the
outer decode scale it feeds NaN (:func:`nan_if_nonfinite`), so every output that scale multiplies is NaN,
as ``nn.Linear`` would be where that value enters (a superset of its NaNs). With a per-tensor (or
per-expert) scale that is the whole GEMM output: one non-finite value makes the shared scale meaningless.
With a per-row scale (1×16 blocks: a recipe cannot pair it with 16×16 tiles) it is the operand's row alone
(an x row: that output row; a W row: that output column), exactly ``nn.Linear``'s NaNs: the row's blocks
and scale hold no other row's values, so the other rows quantize as they would without it.
The check is one max-|x| reduction on the device per quantized operand (per weight update for W), no
host sync; for every operand (x, W, dy, xᵀ, dyᵀ) with a dynamic per-tensor scale, or a per-row one over 1×16
blocks, on the Triton quantizers the kernel makes the check itself, from the amax pass or row sweep it runs
anyway (``rows_plan(nonfinite=True)``, ``columns_plan(nonfinite=True)``: the same NaN-or-not decision and the
same finite bits, no extra launch).

Shared input quantization (``NVFP4LinearConfig.share_inputs``, on by default). Sibling layers that read one
input tensor (q/k/v read one hidden state, gate/up another) quantize it once: :func:`quantize_input` keeps the
last input's x_q and gives it to the next call that quantizes the same unchanged tensor object with the same
recipe, as an engine's fused ``qkv_proj`` / ``gate_up_proj`` quantizes its input once. The same bytes; a
transformer decoder layer quantizes 4 activations (qkv, o, gate/up, down) instead of 7, each with its
non-finite check. Inside a CUDA-graph capture only within :func:`capture_scope` (one graph). The key, and
the writes into x that no key can see: :func:`quantize_input`.

Call plans. What a call derives from its input's signature alone (rows, the large-M choice, the Triton
quantizers' tiles and launch arguments, the checks ``quantize`` makes, the GEMMs' plans) is a
:class:`_CallPlan`, built once per (shape, dtype, device) under the layer's current config and kept in one
cache for all layers (:func:`_plan`: keyed also by the weight's shape and dtype and the bias's dtype, so
layers of equal configs and shapes share plans); a call only allocates and launches. The one host read
left is a cuBLAS GEMM's ``alpha`` (large M, see :mod:`triage.kernels.nvfp4.matmul`): a dynamic activation
scale read per call, the cached weight's once per update.

Capturable (``NVFP4LinearConfig(capturable=True)``): a call that a CUDA graph can capture and replay. W_q
is quantized on the device at every forward (no weight-cache check, which is Python a replay would skip),
the GEMM plans read no outer scale on the host (``gemm_plan(host_scales=False)``: the Triton GEMM, or
cuBLAS with an fp32 output, where the cached layer's would take cuBLAS's host alpha), and the
stochastic-rounding seeds of nvfp4-backward are an int64 device tensor, which the quantizers read on the
device. The seed rule: the seeds are drawn by the **forward**, where a backward can follow (grad mode on
and x, W or b requiring grad): the layer's count ``_sr_calls`` (a buffer, ``[2n, 2n + 1]`` after n draws)
is advanced in place by a device op, as BatchNorm's forward advances its running statistics, and the
backward of that forward uses ``grad.seed + 2n``, ``grad.seed + 2n + 1`` (:func:`_device_seeds`), saved
with its other tensors. So each replay of a captured forward draws the next seeds. A no-grad forward (old
log-probs, sampling) draws nothing. A recomputed forward (activation checkpointing) draws again and its
backward uses the recompute's seeds: non-reentrant checkpointing (whose first forward runs with grad)
advances the count twice per step, reentrant (first forward under no_grad) once. When each forward with
grad has one backward (no checkpointing), the n-th backward gets the cached layer's n-th seeds (the
cached layer counts backwards, on the host), so the two layers give the same bits wherever both run the
same GEMM; a second backward through one forward (``retain_graph``) reuses its seeds.

torch.compile. Under compilation the layer is the ``torch.library`` custom op ``triage::nvfp4_linear``
(:func:`nvfp4_linear_op`, backward :func:`nvfp4_linear_backward_op`), or for a capturable config
``triage::nvfp4_linear_capturable`` (:func:`nvfp4_linear_capturable_op`, backward
:func:`nvfp4_linear_capturable_backward_op`; only the cached layer's ops are tagged ``cudagraph_unsafe``):
the same forward and backward code, weight cache (or per-call W_q) and plans as the eager path, as one
opaque op each, so ``fullgraph=True`` works and the bits are the eager ones. The cached op finds its layer
(weight cache, host seed count) by the layer's op id, a CPU tensor input of the graph. The capturable op
takes no layer: its inputs are x, W, b, the seeds (a device tensor, drawn beside it by the layer's
forward) and the config's key, a ``str`` constant shared by every layer of an equal config (one graph for
all of them); nothing in its graph is a CPU tensor, which a CUDA graph could not hold.

Gradients are returned in the dtypes of x and W. The quantization and both backward GEMMs run with the
backends of :mod:`triage.kernels.nvfp4` (Triton on CUDA, torch reference on CPU; ``backend=`` overrides).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import weakref
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from triage.kernels.nvfp4.format import pack_nibbles, unpack_nibbles
from triage.kernels.nvfp4.recipe import LayerConfig, QuantRecipe
from triage.kernels.nvfp4.tensor import NVFP4Tensor

if TYPE_CHECKING:
    from triage.kernels.nvfp4.quantize_columns import ColumnsPlan
    from triage.kernels.nvfp4.quantize_rows import RowsPlan

__all__ = [
    "BACKWARD_MODES",
    "NVFP4Linear",
    "NVFP4LinearConfig",
    "invalidate_weight_caches",
    "nan_if_nonfinite",
    "nvfp4_linear_backward_op",
    "nvfp4_linear_capturable_backward_op",
    "nvfp4_linear_capturable_op",
    "nvfp4_linear_op",
    "transpose_16x16",
    "weight_key",
]

BACKWARD_MODES = ("bf16-backward", "nvfp4-backward")
#: Call signatures whose plans are kept, for all layers together (:func:`_plan`; oldest dropped first).
_PLANS_KEPT = 256

#: The weight generation (module docstring): bumped after every optimizer step and by
#: :func:`invalidate_weight_caches`; part of every quantized-weight cache key.
_generation = 0


def invalidate_weight_caches() -> None:
    """Make every NVFP4 layer (``NVFP4Linear``, ``NVFP4MoeExperts``) quantize its weights anew on its next
    forward. Needed only after writing weights outside a ``torch.optim.Optimizer`` step in a way autograd's
    version counter does not see (raw ``param.data`` writes); optimizer steps do this automatically."""
    global _generation
    _generation += 1


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    invalidate_weight_caches()
    _forget_input()  # a fused optimizer may have written an input tensor without a version bump


register_optimizer_step_post_hook(_after_optimizer_step)


def weight_key(weight: torch.Tensor) -> tuple:
    """The cache key of a weight's quantization: ``(generation, _version, data_ptr, dtype, shape, device)``
    (module docstring: what each entry catches)."""
    return (_generation, weight._version, weight.data_ptr(), weight.dtype, tuple(weight.shape), weight.device)


def nan_if_nonfinite(q: NVFP4Tensor, source: torch.Tensor) -> NVFP4Tensor:
    """``q`` (the quantization of ``source``) with a NaN outer decode scale if ``source`` holds a NaN or ±Inf,
    else ``q`` with the same values: ``g' = g + 0·max|source|`` (``0·max`` is 0, or NaN for a NaN/Inf max);
    per row (:func:`row_local`: ``g'_r = g_r + 0·max|source_r|``) for a per-row scale over 1×16 blocks.

    The quantizer maps NaN to finite codes (the engines' bytes) and Inf to a saturated block; every GEMM
    applies the outer scale in its epilogue, so a NaN ``g'`` makes every output of a product with ``q`` NaN.
    With the Hadamard transform ``q`` holds the rotated ``source``, which is non-finite where a block's
    rotation exceeds the dtype's range (docs/nvfp4.md §6): a dynamic outer scale's amax (of the rotated
    values) is then Inf, and counts like ``max|source|`` (static, checkpoint and ``scale="none"`` have no
    amax: such a block saturates). One reduction on the device, no host sync."""
    return replace(q, global_scale=nonfinite_scale(q, source))


def row_local(recipe: QuantRecipe) -> bool:
    """Whether the non-finite rule acts per row for operands quantized with ``recipe`` (module docstring):
    a per-row outer scale over 1×16 blocks, whose every block and scale belong to one row (``QuantRecipe``
    refuses per-row scales with 16×16 tiles; the block test keeps the rule whole-tensor if it ever did not)."""
    return recipe.scale == "row" and recipe.block == "1x16"


def nonfinite_scale(q: NVFP4Tensor, source: torch.Tensor) -> torch.Tensor:
    """The outer decode scale of :func:`nan_if_nonfinite`: ``g + 0·max|source|`` (+ ``0·max(amax)`` with
    the Hadamard rule), two device ops (``add(g, peak, alpha=0)`` is ``g + 0·peak``), no host sync; the
    maxima per row where :func:`row_local` (``source`` then has ``q``'s shape: its rows are q's rows)."""
    g, amax = q.global_scale, q.amax
    rotated = q.recipe.hadamard and q.recipe.scale_source == "dynamic" and amax is not None
    if row_local(q.recipe) and tuple(source.shape) == tuple(q.shape):
        peak = torch.linalg.vector_norm(source.detach(), float("inf"), dim=-1, keepdim=True, dtype=torch.float32)
        g = torch.add(g, peak.reshape(g.shape), alpha=0)
        return torch.add(g, amax.reshape(g.shape), alpha=0) if rotated else g
    peak = torch.linalg.vector_norm(source.detach(), float("inf"), dtype=torch.float32)  # NaN/Inf iff one
    g = torch.add(g, peak, alpha=0)
    return torch.add(g, amax.amax(), alpha=0) if rotated else g


@dataclass(frozen=True)
class NVFP4LinearConfig(LayerConfig):
    """How an :class:`NVFP4Linear` quantizes and differentiates (defaults: Transformer Engine's NVFP4 recipe).

    Attributes:
        activation: activations x (forward), 1×16 blocks along K.
        weight: weights W; 16×16 blocks so that ``nvfp4-backward`` can reuse W_q for Wᵀ.
        grad: output gradients dy in ``nvfp4-backward`` (1×16, stochastic rounding).
        wgrad: both wgrad operands (dyᵀ, xᵀ) in ``nvfp4-backward``: Hadamard + 1×16 along tokens,
            ``pad=True`` so any token count works (zero padding contributes nothing to dyᵀ·x).
        backward: ``"bf16-backward"`` or ``"nvfp4-backward"`` (see the module docstring).
        gemm_backend / quant_backend: passed to :func:`~triage.kernels.nvfp4.gemm` and
            :func:`~triage.kernels.nvfp4.quantize` (``"auto"`` picks by device).
        capturable: a call can be captured in a CUDA graph and replayed (``torch.cuda.graph``, or
            ``torch.compile(mode="reduce-overhead")``: its op is not tagged ``cudagraph_unsafe``), as torch
            optimizers' ``capturable=True``: W is quantized on the device at every forward instead of
            through the weight cache, GEMMs read no outer scale on the host, the nvfp4-backward seeds are
            read on the device (module docstring, "Capturable"). The same bits as the cached layer where
            both run the same GEMM. Cost: the memory-bound passes over W at every forward. By the byte
            count (an estimate, not a measurement), a bf16 W costs ~8.6 B per element (read by the amax
            pass, the quantizer and the non-finite check; codes, scales and the bf16 expansion written)
            against 6·M FLOP per element for a training step's GEMMs on M tokens (forward, dgrad, wgrad);
            at an H100's peak rates (3.35 TB/s, 989 TFLOP/s dense bf16) that is 8.6·989 / (3.35·6·M) ≈
            420/M of the GEMM time: ~2.6 % at M = 16384 tokens, ~5 % at 8192, three times that share for
            a forward-only pass (old log-probs). nvfp4-backward adds W_qᵀ's transposition. Seeds: drawn by
            each forward that a backward can follow (grad mode on, an input requiring grad), not by the
            backward; a no-grad forward draws none, a recomputed (checkpointed) forward draws again (module
            docstring, "Capturable"). Under ``torch.compile`` the op takes no CPU tensor and no per-layer
            constant (the config is a ``str`` key shared by equal configs), so cudagraph trees
            (``mode="reduce-overhead"``) hold its graph (on an H100: replays bit-identical to the eager
            cached layer; docs/kernels.md, "GPU check"). Switching a live layer to ``capturable`` continues its device seed count (0 unless it
            ran capturable before), not the host count the cached layer keeps: the seeds of its first
            backward calls then repeat earlier ones.
        share_inputs: sibling layers that read one input tensor (q/k/v, gate/up) quantize it once, as the
            engines' fused ``qkv_proj`` / ``gate_up_proj`` do: a layer reuses the previous call's x_q when it
            quantized the same unchanged tensor with the same recipe (:func:`quantize_input`: the key, and
            the writes no key sees). The same bytes either way; eager calls, and captured calls within a
            :func:`capture_scope` (not under ``torch.compile``). False quantizes at every call.
    """

    backward_modes: ClassVar[tuple[str, ...]] = BACKWARD_MODES

    weight: QuantRecipe = field(default_factory=lambda: QuantRecipe(block="16x16"))
    capturable: bool = False
    share_inputs: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("activation", "weight", "grad", "wgrad"):
            if getattr(self, name).scale == "expert":
                raise ValueError(f"NVFP4LinearConfig.{name}: per-expert scales belong to the MoE layer")
        if self.activation.hadamard or self.weight.hadamard:
            raise ValueError("NVFP4LinearConfig: the forward operands cannot use the Hadamard transform")
        if self.backward == "nvfp4-backward":
            if self.weight.block != "16x16":
                raise ValueError(
                    "NVFP4LinearConfig: backward='nvfp4-backward' reuses W_q for Wᵀ, which needs "
                    f"weight.block='16x16' (got {self.weight.block!r})"
                )
            if self.grad.hadamard:
                raise ValueError("NVFP4LinearConfig.grad (dgrad dy) cannot use Hadamard: W_qᵀ did not")
        for name in ("capturable", "share_inputs"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"NVFP4LinearConfig.{name} must be a bool, got {getattr(self, name)!r}")
        _register_config(self)

    def __setstate__(self, state: dict) -> None:
        """Unpickled (or deep-copied): the same fields, and the key registered in this process too."""
        self.__dict__.update(state)
        _register_config(self)


#: Every capturable NVFP4LinearConfig by its key (:func:`_register_config`): the capturable op names its
#: config by the key, a ``str`` argument, so that the compiled graph holds a constant shared by all layers of
#: equal configs (no per-layer input, no recompile per layer) and the op body finds the config here. Only
#: capturable configs are kept (nothing else looks a config up by its key): code that makes a new cached
#: config at every step (a sampler's per-sync weight scales) does not grow it; a capturable config made per
#: step would (and would recompile a compiled graph, whose key is a constant).
_CONFIGS: dict[str, NVFP4LinearConfig] = {}


def _register_config(config: NVFP4LinearConfig) -> None:
    """Give ``config`` its key, ``config._op_key``: its ``repr`` (every field, deterministic: equal configs
    have one key, run to run), and register a capturable config under that key (the first of equal configs
    stays)."""
    key = repr(config)
    object.__setattr__(config, "_op_key", key)  # frozen: not a field (no part of eq, hash or repr)
    if config.capturable:
        _CONFIGS.setdefault(key, config)


def _config_of(key: str) -> NVFP4LinearConfig:
    config = _CONFIGS.get(key)
    if config is None:
        raise RuntimeError(f"triage::nvfp4_linear_capturable: no NVFP4LinearConfig has the key {key!r}")
    return config


def _quantize(
    x: torch.Tensor,
    recipe: QuantRecipe,
    backend: str,
    seed: int | None = None,
    expanded: torch.dtype | None = None,
    plan: RowsPlan | None = None,
) -> NVFP4Tensor:
    """``quantize(x, recipe)`` (+ the exact ``q·s`` in dtype ``expanded``, bf16 or fp16, when given) under the
    non-finite rule. ``plan``: the Triton quantizer's plan for x's signature (:func:`_rows_plan`), run
    directly when x fits it."""
    if plan is not None and x.is_contiguous() and not (plan.pairs and x.storage_offset() % 2):
        q = plan.run(x, seed)
        if not plan.nonfinite:  # else the kernel applied the rule (rows_plan)
            q.global_scale = nonfinite_scale(q, x)  # q is ours alone: no copy of the dataclass
        return q
    from triage.kernels.nvfp4 import quantize

    q = quantize(x, recipe, backend=backend, seed=seed, emit_expanded=expanded)
    return nan_if_nonfinite(q, x)


#: The most recent forward input's quantization (:func:`quantize_input`): ``(weakref to x, key, x_q)``.
_last_input: tuple | None = None
#: Whether a :func:`capture_scope` is open: captured calls share only inside one.
_capture_scope = False
#: Custom-op implementations running (a compiled graph's calls): they quantize their input per call, since
#: compiled code writes and reuses its buffers without bumping version counters (:func:`quantize_input`).
_op_depth = 0
#: Custom-op calls so far (each implementation entered): a sibling group's kept output is claimed inside ops
#: only by the op calls right after its launch (:class:`~triage.kernels.siblings.SiblingGroup`).
_op_serial = 0
#: Bumped whenever everything kept for sibling layers is dropped (:func:`_forget_input` without ``ref``):
#: part of :func:`input_key`, so work kept before (sibling outputs included) never matches after.
_input_epoch = 0


def _forget_input(ref: weakref.ref | None = None) -> None:
    """Drop the kept input quantization (all of it, or only if it is the one of ``ref``: x was freed)."""
    global _last_input, _input_epoch
    if ref is None:
        _input_epoch += 1
    last = _last_input
    if last is not None and (ref is None or last[0] is ref):
        _last_input = None


def input_key(x: torch.Tensor) -> tuple | None:
    """The key under which sibling layers reuse work done on their input ``x`` (:func:`quantize_input`,
    :class:`~triage.kernels.siblings.SiblingGroup`): x's ``_version``, data pointer, shape, strides and
    offset, the current CUDA stream and :data:`_input_epoch` (bumped at optimizer steps and on entering or
    leaving a :func:`capture_scope`); compared together with x's identity (a weak reference). None where no
    key can tell x unchanged or the reuse is not allowed: under ``torch.compile``, for inference tensors (no
    version counter) and inside a CUDA-graph capture outside a :func:`capture_scope`."""
    if torch.compiler.is_compiling() or x.is_inference():
        return None
    stream = None
    if x.is_cuda:
        if torch.cuda.is_current_stream_capturing() and not _capture_scope:
            return None
        stream = torch.cuda.current_stream(x.device).cuda_stream
    return (_input_epoch, x._version, x.data_ptr(), x.shape, x.stride(), x.storage_offset(), stream)


@contextlib.contextmanager
def _op_call():
    """Around a custom op's implementation: no input quantization is shared inside (:func:`quantize_input`)."""
    global _op_depth, _op_serial
    _op_depth += 1
    _op_serial += 1
    try:
        yield
    finally:
        _op_depth -= 1


@contextlib.contextmanager
def capture_scope():
    """Open inside ``torch.cuda.graph(...)``, around ONE capture on one stream: layer calls captured within
    it share input quantizations (:func:`quantize_input`); the kept one is dropped on entry and exit, so no
    graph reads another graph's (or eager work's) x_q. Captured calls outside a scope quantize every time.
    The built-in sampler's CUDA-graph decode step opens it."""
    global _capture_scope
    if _capture_scope:
        raise RuntimeError("capture_scope: already open (one capture at a time)")
    _forget_input()
    _capture_scope = True
    try:
        yield
    finally:
        _capture_scope = False
        _forget_input()


def quantize_input(
    x: torch.Tensor,
    recipe: QuantRecipe,
    backend: str,
    expanded: torch.dtype | None = None,
    plan: RowsPlan | None = None,
    share: bool = True,
) -> NVFP4Tensor:
    """The forward activation ``x_q = Q(x)`` of a layer's input ``x`` (quantized as its ``[rows, K]`` view)
    under the non-finite rule (:func:`_quantize`), computed once for sibling layers that read one input
    (``share=False``: computed at every call; the layer configs' ``share_inputs``).

    A layer that quantizes the very tensor object the previous call quantized, unchanged as far as torch can
    tell (the same ``x._version``, data pointer, shape, strides and offset, no optimizer step in between),
    with the same recipe, backend and expansion dtype, on the same CUDA stream, gets that call's ``x_q``: the
    same bytes, one quantizer pass and one non-finite check instead of one per sibling (q/k/v read one hidden
    state, gate/up another, as the engines' fused ``qkv_proj`` / ``gate_up_proj`` quantize it once). Only the
    last input is kept, by a weak reference (dropped when x is freed; while x lives, e.g. saved for a
    backward, its x_q stays too). Inside a CUDA-graph capture calls share only within a
    :func:`capture_scope` (one graph). Not shared: stochastic rounding (each call draws its own), inference
    tensors (no version counter), inside the custom ops (a compiled graph's code writes and reuses its buffers
    without bumping version counters: each op quantizes per call; a sibling group's one launch still
    quantizes once for its members). What no key
    can see: writes into x that bypass autograd's version counter (``x.data`` writes, numpy / DLPack
    aliases, another tensor set to x's storage, a custom kernel writing x in place) between two layer calls
    on the same x object: pass a new tensor, or use ``share_inputs=False``."""
    global _last_input
    key = input_key(x) if share and recipe.rounding == "nearest" and not _op_depth else None
    if key is None:
        return _quantize(x.reshape(-1, x.shape[-1]), recipe, backend, expanded=expanded, plan=plan)
    key = (*key, recipe, backend, expanded)
    last = _last_input
    if last is not None and last[0]() is x and last[1] == key:
        return last[2]
    xq = _quantize(x.reshape(-1, x.shape[-1]), recipe, backend, expanded=expanded, plan=plan)
    _last_input = (weakref.ref(x, _forget_input), key, xq)
    return xq


def _triton_quantizes(backend: str, device: torch.device) -> bool:
    """Whether ``quantize(..., backend=backend)`` runs the Triton quantizer on ``device``."""
    from triage.kernels.nvfp4.device import available

    return backend == "triton" or (backend == "auto" and available(device))


def _rows_plan(
    recipe: QuantRecipe,
    backend: str,
    shape: tuple,
    dtype: torch.dtype,
    device: torch.device,
    expanded: torch.dtype | None,
) -> RowsPlan | None:
    """The Triton quantizer's :class:`~triage.kernels.nvfp4.quantize_rows.RowsPlan` for a contiguous input of
    ``shape``/``dtype`` on ``device`` when ``quantize(..., backend=backend)`` would run Triton there, after
    the checks ``quantize`` makes on every call (they depend on the signature alone); else None."""
    from triage.kernels.nvfp4.api import check_quantize_options
    from triage.kernels.nvfp4.device import check_runnable, interpreting
    from triage.kernels.nvfp4.quantize_rows import rows_plan
    from triage.kernels.nvfp4.reference import check_input

    check_quantize_options("quantize", backend, None, None)
    if not _triton_quantizes(backend, device):
        return None
    meta = torch.empty(shape, dtype=dtype, device="meta")
    check_input(meta, recipe)
    check_runnable(torch.empty(0, device=device))
    return rows_plan(torch.Size(shape), dtype, recipe, expanded, True, None, None, None, interpreting(), True)


def _quantize_t(
    x: torch.Tensor,
    recipe: QuantRecipe,
    backend: str,
    seed: int | None = None,
    expanded: bool = False,
    plan: ColumnsPlan | None = None,
) -> NVFP4Tensor:
    """``quantize(x.T, recipe)`` of a 2-D ``x`` without the transposed copy (Triton backends; the torch
    backend materializes ``x.T``): 1×16 blocks along x's rows (the tokens), byte-identical; ``expanded``:
    also the exact bf16 ``q·s``, written in the same pass. ``plan``: the columnwise quantizer's plan for
    x's signature (:func:`_columns_plan`), run directly when x takes that path."""
    if plan is not None and x.dtype == plan.dtype and not x.t().is_contiguous():
        q = plan.run(x, seed, None)
        if not plan.nonfinite:  # else the kernel applied the rule (columns_plan)
            q.global_scale = nonfinite_scale(q, x.t())  # q is ours alone: no copy of the dataclass
        return q
    from triage.kernels.nvfp4.quantize_columns import quantize_columnwise

    emit = torch.bfloat16 if expanded else None
    return nan_if_nonfinite(quantize_columnwise(x, recipe, backend=backend, seed=seed, emit_expanded=emit), x.t())


def _columns_plan(
    recipe: QuantRecipe, backend: str, shape: tuple, dtype: torch.dtype, device: torch.device, expanded: bool
) -> ColumnsPlan | None:
    """The Triton columnwise quantizer's :class:`~triage.kernels.nvfp4.quantize_columns.ColumnsPlan` for
    ``quantize_columnwise(x, recipe, backend=backend)`` of a 2-D x of ``shape``/``dtype`` on ``device`` when
    that call would run the columnwise kernel (a plain transpose, not the row-major path of a contiguous
    ``xᵀ``), after the checks it makes; else None."""
    from triage.kernels.nvfp4.api import check_quantize_options
    from triage.kernels.nvfp4.device import check_runnable, interpreting
    from triage.kernels.nvfp4.quantize_columns import columns_plan

    check_quantize_options("quantize_columnwise", backend, None, None)
    rows, C = shape
    # rows == 1 or C == 1: xᵀ is contiguous, the row-major path runs
    if not _triton_quantizes(backend, device) or recipe.block != "1x16" or rows == 1 or C == 1:
        return None
    check_runnable(torch.empty(0, device=device))
    emit = torch.bfloat16 if expanded else None
    return columns_plan(C, rows, dtype, recipe, False, emit, None, None, None, interpreting(), True)


def transpose_16x16(w: NVFP4Tensor) -> NVFP4Tensor:
    """W_qᵀ from W_q for a weight quantized in 16×16 blocks: codes and tile scales transposed.

    2-D ``[N, K]`` with a per-tensor outer scale, or 3-D ``[E, N, K]`` (MoE experts, transposed per expert)
    with per-expert outer scales; outer scales are kept. Exact: with one scale per 16×16 tile, quantizing
    Wᵀ gives these bytes. Needs N and K multiples of 16.
    """
    allowed = ("tensor", "none") if len(w.shape) == 2 else ("tensor", "none", "expert")
    if w.recipe.block != "16x16" or w.recipe.scale not in allowed or len(w.shape) not in (2, 3):
        raise ValueError(
            f"transpose_16x16 needs block='16x16' and a per-tensor (2-D) or per-expert (3-D) outer scale, got "
            f"block={w.recipe.block!r}, scale={w.recipe.scale!r}, shape {tuple(w.shape)}"
        )
    *lead, N, K = tuple(w.shape)
    if N % 16 or K % 16:
        raise ValueError(
            f"transpose_16x16 needs both dims multiples of 16, got weight shape {tuple(w.shape)}"
        )
    codes_t = unpack_nibbles(w.data).transpose(-1, -2).contiguous()  # [..., K, N]
    tile = w.scale.view(torch.uint8)[..., ::16, :]  # [..., N/16, K/16]: one scale per tile (rows repeat it)
    scale_t = tile.transpose(-1, -2).repeat_interleave(16, dim=-2).contiguous().view(torch.float8_e4m3fn)
    return replace(
        w, data=pack_nibbles(codes_t), scale=scale_t, shape=torch.Size((*lead, K, N)), expanded=None
    )


@dataclass(eq=False)
class _QuantizedWeight:
    """W_q of one weight under one config, and the forms the layer's GEMMs take from it: ``expanded`` (the
    exact bf16 ``q·s``, when the large-M GEMMs run on expansions) and ``transposed`` (W_qᵀ, nvfp4-backward).
    :meth:`host_scale` reads its decode scale to the host once, for a cached W_q's cuBLAS-alpha GEMMs (a
    capturable config's GEMMs never ask)."""

    quantized: NVFP4Tensor
    expanded: torch.Tensor | None
    transposed: NVFP4Tensor | None
    scale_host: float | None = None

    def host_scale(self) -> float:
        """The per-tensor decode scale as a float: read from the device once per weight update (it may be
        NaN: :func:`nan_if_nonfinite`), and only when a cuBLAS (host alpha) path asks for it — small GEMMs
        never sync."""
        if self.scale_host is None:
            self.scale_host = float(self.quantized.global_scale.reshape(-1)[0])
        return self.scale_host


@functools.lru_cache(maxsize=256)
def _weight_plan(
    config: NVFP4LinearConfig, shape: tuple, dtype: torch.dtype, device: torch.device
) -> tuple[bool, RowsPlan | None]:
    """``(uses_expanded, plan)`` of a weight's quantization under ``config``: whether the large-M GEMMs want
    its exact bf16 ``q·s``, and the Triton quantizer's plan (:func:`_rows_plan`, None where Triton does not
    quantize), which applies the non-finite rule itself for a dynamic per-tensor or per-row scale (no torch
    reduction over W: :func:`_quantize`). Derived from the signature alone, once."""
    uses_expanded = _uses_expanded_weight(config, device)
    expanded = torch.bfloat16 if uses_expanded else None
    return uses_expanded, _rows_plan(config.weight, config.quant_backend, shape, dtype, device, expanded)


def _quantize_weight(weight: torch.Tensor, config: NVFP4LinearConfig) -> _QuantizedWeight:
    """W_q of ``weight`` under ``config`` (non-finite rule included) and its derived forms: device work only
    (nothing read to the host), the same bits for the cache and for a per-call quantization."""
    uses_expanded, plan = _weight_plan(config, tuple(weight.shape), weight.dtype, weight.device)
    with torch.no_grad():  # the exact q·s written in the same pass when the large-M GEMMs want it
        q = _quantize(
            weight.detach(),
            config.weight,
            config.quant_backend,
            expanded=torch.bfloat16 if uses_expanded else None,
            plan=plan,
        )
        expanded = None
        if uses_expanded:
            from triage.kernels.nvfp4.matmul import expand

            expanded = expand(q)  # returns q.expanded (no extra pass) when the quantizer wrote it
        transposed = transpose_16x16(q) if config.backward == "nvfp4-backward" else None
    return _QuantizedWeight(q, expanded, transposed)


def _entry_tensors(entry: _QuantizedWeight) -> list:
    """Every tensor slot of ``entry`` in a fixed order (None where a slot is empty): W_q's, W_qᵀ's, the
    expansion."""
    out = []
    for q in (entry.quantized, entry.transposed):
        if q is None:
            out.extend((None,) * 6)
        else:
            out.extend((q.data, q.scale, q.global_scale, q.global_encode_scale, q.amax, q.expanded))
    out.append(entry.expanded)
    return out


def _tensor_addresses(tensors) -> tuple:
    """``(data_ptr, shape, dtype)`` of each tensor (a non-tensor as itself): where a captured kernel reads."""
    return tuple(
        (t.data_ptr(), tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t for t in tensors
    )


def _refresh_into(old: _QuantizedWeight, new: _QuantizedWeight) -> bool:
    """Write ``new``'s tensors into ``old``'s (same addresses) when every slot matches in kind, shape, dtype
    and device; False (nothing written) otherwise."""
    pairs = list(zip(_entry_tensors(old), _entry_tensors(new)))
    for a, b in pairs:
        if (a is None) != (b is None) or (
            isinstance(a, torch.Tensor)
            and not (
                isinstance(b, torch.Tensor)
                and (a.shape, a.dtype, a.device, a.stride()) == (b.shape, b.dtype, b.device, b.stride())
            )
        ):
            return False
        if a is not None and not isinstance(a, torch.Tensor) and a != b:  # a float outer scale
            return False
    written = set()
    for a, b in pairs:
        if isinstance(a, torch.Tensor) and (a.data_ptr(), a.shape) not in written:  # aliases written once
            written.add((a.data_ptr(), a.shape))
            a.copy_(b)
    # a decode scale a large forward read to the host is read anew now (one sync per refresh), so that a kept
    # graph's key (graph_key, checked before a captured prefill replays) compares values, not "not read yet"
    old.scale_host = None if old.scale_host is None else float(old.quantized.global_scale.reshape(-1)[0])
    return True


class _WeightCache:
    """The :class:`_QuantizedWeight` of one weight, valid while the weight's key is unchanged.

    ``in_place`` (:func:`~triage.kernels.capture.keep_weight_addresses`): a new quantization of a weight of
    the same dtype, shape, device and config is written into the cached tensors instead of replacing them,
    so that a captured CUDA graph reading them stays valid; anyone holding the old W_q sees the new values."""

    def __init__(self, in_place: bool = False) -> None:
        self.key: tuple | None = None
        self.source: torch.Tensor | None = None
        self.entry: _QuantizedWeight | None = None
        self.hits = 0
        self.misses = 0
        self.in_place = in_place

    def get(self, weight: torch.Tensor, config: NVFP4LinearConfig) -> _QuantizedWeight:
        # what it holds depends on the config (W_qᵀ, expansions), not only W's recipe
        key = (*weight_key(weight), config)
        if key == self.key:
            self.hits += 1
            return self.entry
        self.misses += 1
        fresh = _quantize_weight(weight, config)
        same_layout = self.key is not None and self.key[3:] == key[3:]  # dtype, shape, device, config
        if not (self.in_place and same_layout and _refresh_into(self.entry, fresh)):
            self.entry = fresh
        self.key = key
        # keeps the keyed storage alive, so its address (in the key) cannot be reused by a new weight while
        # this entry is cached; a reference to the master weight, not a copy (an old weight replaced through
        # ``param.data`` stays allocated until the next forward or invalidate_cache())
        self.source = weight.detach()
        return self.entry

    def clear(self) -> None:
        self.__init__(self.in_place)


def _uses_expanded_weight(config: NVFP4LinearConfig, device: torch.device) -> bool:
    """Whether large-M forwards run on the exact bf16 expansions (cached for the weight)."""
    from triage.kernels.nvfp4.device import triton_runs_on

    if config.gemm_backend in ("cublas", "triton"):
        return True
    return config.gemm_backend == "auto" and triton_runs_on(device)


def _large_m(config: NVFP4LinearConfig, rows: int, device: torch.device) -> bool:
    from triage.kernels.nvfp4.matmul import SMALL_M

    return rows > SMALL_M and _uses_expanded_weight(config, device)


@dataclass(frozen=True)
class _CallPlan:
    """The data-independent part of one ``NVFP4Linear`` call (forward and backward) for an input signature
    (shape, dtype, device; the layer's config, shape and dtypes): built once per signature (:func:`_plan`),
    so that a call runs the quantizers and GEMMs without re-deriving shapes, backends and tiles.

    ``large``: the forward and dgrad GEMMs (M = tokens) run on expansions, so x_q and dy_q are quantized
    with their exact bf16 ``q·s``; ``large_wgrad`` the same for the wgrad GEMM (M = out_features).
    ``act_expanded``: the dtype of the exact ``q·s`` the x and dy quantizers write with the codes: bf16 when
    ``large``, fp16 when those GEMMs run the decode kernel (few rows; it reads the activation as its fp16
    expansion, :func:`~triage.kernels.nvfp4.matmul.decode_route`), else None.
    ``x_plan`` / ``dy_plan``: the Triton row quantizer's plans for x and dy (None where ``quantize``
    would not run Triton: the torch reference then runs through ``quantize``); ``xt_plan`` / ``dyt_plan``
    the columnwise quantizer's for the wgrad's xᵀ and dyᵀ (nvfp4-backward). ``gemms``: the
    :class:`~triage.kernels.nvfp4.matmul.GemmPlan` of each GEMM of the call (``"fwd"``, and ``"dgrad"`` /
    ``"wgrad"`` per dtype of dy), built by :func:`~triage.kernels.nvfp4.matmul.gemm_plan` on its first
    operands: the operands' signatures follow from this plan's (the quantizers' plans, the cached weight
    of this config, the layer's shape)."""

    config: NVFP4LinearConfig
    rows: int
    in_features: int
    out_features: int
    lead: tuple
    large: bool
    large_wgrad: bool
    act_expanded: torch.dtype | None
    x_plan: RowsPlan | None
    dy_plan: RowsPlan | None
    xt_recipe: QuantRecipe  # the wgrad's xᵀ: the wgrad recipe with nearest rounding
    xt_plan: ColumnsPlan | None
    dyt_plan: ColumnsPlan | None
    gemms: dict = field(default_factory=dict, compare=False)

    def gemm(self, name, a, b, *, out_dtype, bias=None, b_expanded=None, b_scale_host=None) -> torch.Tensor:
        """``gemm(a, b, ...)`` through this call's plan for GEMM ``name`` (:meth:`gemm_plan`)."""
        plan = self.gemm_plan(
            name, a, b, out_dtype=out_dtype, bias=bias, b_expanded=b_expanded, b_scale_host=b_scale_host
        )
        return plan.run(a, b, bias=bias, b_expanded=b_expanded, b_scale_host=b_scale_host)

    def gemm_plan(self, name, a, b, *, out_dtype, bias=None, b_expanded=None, b_scale_host=None):
        """This call's :class:`~triage.kernels.nvfp4.matmul.GemmPlan` for GEMM ``name``, built on first use (a
        capturable config's reads no outer scale on the host: ``gemm_plan(host_scales=False)``)."""
        plan = self.gemms.get(name)
        if plan is None:
            from triage.kernels.nvfp4.matmul import gemm_plan

            plan = self.gemms[name] = gemm_plan(
                a, b, out_dtype=out_dtype, bias=bias, backend=self.config.gemm_backend, b_expanded=b_expanded,
                b_scale_host=b_scale_host, host_scales=not self.config.capturable,
            )  # fmt: skip
        return plan


#: Call plans by signature (:func:`_plan`), shared by every layer.
_PLANS: dict[tuple, _CallPlan] = {}


def _plan(
    config: NVFP4LinearConfig, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> _CallPlan:
    """The :class:`_CallPlan` of a call on ``x`` under ``config`` with this weight and bias, from one cache
    for all layers: keyed by the config's key, x's shape, dtype and device, the weight's shape and dtype
    and the bias's dtype (what the plan and its GEMM plans depend on), so layers of equal configs and shapes
    share plans; the most recent :data:`_PLANS_KEPT` signatures are kept. Nothing of a layer's data."""
    key = (config._op_key, x.shape, x.dtype, x.device, weight.shape, weight.dtype, bias is None or bias.dtype)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _PLANS_KEPT:
            _PLANS.pop(next(iter(_PLANS), None), None)  # safe if another thread evicted it first
        plan = _PLANS[key] = _call_plan(config, x, weight.shape[0])
    return plan


def _call_plan(config: NVFP4LinearConfig, x: torch.Tensor, out_features: int) -> _CallPlan:
    K = x.shape[-1]
    rows = x.numel() // K
    large = _large_m(config, rows, x.device)
    backend = config.quant_backend
    act_expanded = torch.bfloat16 if large else None
    if not large:
        from triage.kernels.nvfp4.matmul import decode_route

        # the torch quantizer would write it with several ops: only the Triton one saves the GEMM's expand pass
        decode = _triton_quantizes(backend, x.device) and decode_route(config.gemm_backend, rows, x.device)
        act_expanded = torch.float16 if decode else None
    nvfp4_bwd = config.backward == "nvfp4-backward"
    xt_recipe = replace(config.wgrad, rounding="nearest")
    large_wgrad = _large_m(config, out_features, x.device)
    return _CallPlan(
        config=config,
        rows=rows,
        in_features=K,
        out_features=out_features,
        lead=tuple(x.shape[:-1]),
        large=large,
        large_wgrad=large_wgrad,
        act_expanded=act_expanded,
        x_plan=_rows_plan(config.activation, backend, (rows, K), x.dtype, x.device, act_expanded),
        dy_plan=_rows_plan(config.grad, backend, (rows, out_features), x.dtype, x.device, act_expanded)
        if nvfp4_bwd
        else None,
        xt_recipe=xt_recipe,
        xt_plan=_columns_plan(xt_recipe, backend, (rows, K), x.dtype, x.device, large_wgrad)
        if nvfp4_bwd
        else None,
        dyt_plan=_columns_plan(config.wgrad, backend, (rows, out_features), x.dtype, x.device, large_wgrad)
        if nvfp4_bwd
        else None,
    )


def _linear_forward(
    x: torch.Tensor, bias: torch.Tensor | None, plan: _CallPlan, w: _QuantizedWeight, share: bool = False
) -> torch.Tensor:
    """``y = Q(x)·Q(W)ᵀ + b`` for ``x`` of ``plan``'s signature and W_q ``w`` (module docstring); ``share``:
    Q(x) through :func:`quantize_input` (one quantization for sibling layers reading x)."""
    config = plan.config
    xq = quantize_input(
        x, config.activation, config.quant_backend, expanded=plan.act_expanded, plan=plan.x_plan, share=share
    )
    y = plan.gemm(
        "fwd",
        xq,
        w.quantized,
        out_dtype=x.dtype,
        bias=bias,
        b_expanded=w.expanded if plan.large else None,
        b_scale_host=None if config.capturable else w.host_scale,
    )
    return y if len(plan.lead) == 1 else y.reshape(*plan.lead, plan.out_features)


def _rounding_seeds(config: NVFP4LinearConfig, layer: NVFP4Linear) -> tuple[int, int]:
    """The stochastic-rounding seeds of a cached (not ``capturable``) ``layer``'s next nvfp4-backward call,
    ``(dy's, dyᵀ's)``, drawn at the backward: call n (from 1) draws ``grad.seed + 2n`` and ``grad.seed + 2n +
    1`` (deterministic run to run, new every call), n the host int ``layer._grad_calls``."""
    layer._grad_calls[0] += 1
    seed = (config.grad.seed + 2 * layer._grad_calls[0]) % 2**32
    return seed, (seed + 1) % 2**32


def _draws_seeds(
    config: NVFP4LinearConfig, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> bool:
    """Whether a ``capturable`` nvfp4-backward forward on ``x`` draws its backward's seeds
    (:func:`_device_seeds`): when a backward can follow, i.e. grad mode is on and x, W or b requires grad."""
    if not (config.capturable and config.backward == "nvfp4-backward" and torch.is_grad_enabled()):
        return False
    return x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)


def _device_seeds(config: NVFP4LinearConfig, sr_calls: torch.Tensor) -> torch.Tensor:
    """The stochastic-rounding seeds of a ``capturable`` layer's backward, drawn at its forward (the rule:
    module docstring, "Capturable"): ``sr_calls`` (the layer's ``_sr_calls``, ``[2n, 2n + 1]`` after n draws)
    advanced in place by a device op, and the seeds ``grad.seed + [2n, 2n + 1]`` of the n-th draw as a new
    int64 device tensor ``[dy's, dyᵀ's]``, which the quantizers read on the device
    (:mod:`triage.kernels.nvfp4.rng`). A CUDA graph replays the advance: every replay draws new seeds."""
    return sr_calls.add_(2) + config.grad.seed


def _linear_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    plan: _CallPlan,
    weight_t: NVFP4Tensor | None,
    seeds: tuple[int, int] | torch.Tensor | None,
    bias_dtype: torch.dtype | None,
    needs: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(dx, dW, db)`` of ``y = Q(x)·Q(W)ᵀ + b`` under the straight-through rule of ``plan.config.backward``
    (module docstring), each None unless ``needs`` asks for it (db also None without a bias).
    ``weight_t``: the forward's W_qᵀ and ``seeds`` the stochastic-rounding seeds ``(dy's, dyᵀ's)``, host ints
    (:func:`_rounding_seeds`) or a device tensor (:func:`_device_seeds`), in nvfp4-backward (else None)."""
    config = plan.config
    flat = len(plan.lead) == 1  # x, y already [rows, features]: no reshapes
    dy2 = dy if flat else dy.reshape(plan.rows, plan.out_features)
    x2 = x if flat else x.reshape(plan.rows, plan.in_features)
    dx = dw = db = None
    if config.backward == "bf16-backward":
        if needs[0]:
            dx = (dy2 @ weight.to(dy2.dtype)).to(x.dtype)
        if needs[1]:
            dw = (dy2.T @ x2.to(dy2.dtype)).to(weight.dtype)
    else:
        seed, seed_t = seeds[0], seeds[1]
        backend = config.quant_backend
        if needs[0]:
            dy_plan = plan.dy_plan if dy2.dtype == x.dtype else None
            dyq = _quantize(dy2, config.grad, backend, seed=seed, expanded=plan.act_expanded, plan=dy_plan)
            dx = plan.gemm(("dgrad", dy2.dtype), dyq, weight_t, out_dtype=x.dtype)
        if needs[1]:
            # dy2ᵀ, x2ᵀ quantized straight from the row-major dy2, x2 (no transposed copy; same bytes)
            big = plan.large_wgrad
            dyt = _quantize_t(dy2, config.wgrad, backend, seed=seed_t, expanded=big, plan=plan.dyt_plan)
            xt = _quantize_t(x2, plan.xt_recipe, backend, expanded=big, plan=plan.xt_plan)
            dw = plan.gemm(("wgrad", dy2.dtype), dyt, xt, out_dtype=torch.float32).to(weight.dtype)
    if bias_dtype is not None and needs[2]:
        db = dy2.contiguous().float().sum(0).to(bias_dtype)  # one summation order whatever dy's layout
    if dx is not None and not flat:
        dx = dx.reshape(x.shape)
    return dx, dw, db


def _backward_seeds(config: NVFP4LinearConfig, seeds: torch.Tensor | None, layer: NVFP4Linear | None):
    """The seeds a backward uses: None in bf16-backward, those its forward drew (``seeds``) under a
    ``capturable`` config, else drawn now from ``layer``'s host count (:func:`_rounding_seeds`)."""
    if config.backward != "nvfp4-backward":
        return None
    if config.capturable:
        if seeds is None or seeds.numel() != 2:
            raise RuntimeError(
                "NVFP4Linear (capturable, nvfp4-backward): this backward's forward drew no stochastic-"
                "rounding seeds (it ran with grad mode off, or with no input requiring grad)"
            )
        return seeds
    return _rounding_seeds(config, layer)


class _NVFP4LinearFn(torch.autograd.Function):
    """Autograd of ``y = Q(x)·Q(W)ᵀ + b`` with straight-through gradients (see the module docstring): the
    eager path. ``seeds``: what a capturable forward drew for its backward (:func:`_device_seeds`), else
    None (a cached layer's backward draws from ``layer``'s host count)."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan: _CallPlan, w: _QuantizedWeight, seeds, layer: NVFP4Linear):
        y = _linear_forward(x, bias, plan, w, share=plan.config.share_inputs)
        ctx.save_for_backward(x, weight, seeds)  # saved, as the op's are: a checkpoint's recompute redraws
        ctx.plan = plan
        ctx.weight_t = w.transposed  # the forward's W_qᵀ (nvfp4-backward), whatever the cache holds later
        ctx.layer = layer
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, seeds = ctx.saved_tensors
        needs = tuple(ctx.needs_input_grad[:3])
        seeds = _backward_seeds(ctx.plan.config, seeds, ctx.layer)
        dx, dw, db = _linear_backward(dy, x, weight, ctx.plan, ctx.weight_t, seeds, ctx.bias_dtype, needs)
        return dx, dw, db, None, None, None, None


# ---------------------------------------------------------------------------------------------------
# torch.library custom ops: the same forward and backward as one opaque op each, for torch.compile
# ---------------------------------------------------------------------------------------------------

#: Live layers by their op id, for the cached layer's op ``triage::nvfp4_linear``, which needs the layer
#: itself (its weight cache and host stochastic-rounding count) and finds it here. A layer passes its id as
#: ``NVFP4Linear._op_id``, a 0-d int64 CPU tensor (a plain attribute: no buffer, so ``.to()`` leaves it on
#: the CPU and the state_dict does not hold it). A tensor is an input of the compiled graph, guarded by its
#: dtype, device and shape only, so every NVFP4Linear of one signature shares one graph; an int attribute
#: would be a graph constant, one recompile per layer. The capturable op takes no op id (a CPU input is what
#: a CUDA graph cannot hold): everything it needs is an argument (the seed count a device tensor, the
#: config a ``str`` key, :data:`_CONFIGS`).
#: ``FrozenNVFP4Linear`` registers here too, for ``triage::frozen_nvfp4_linear``.
_LAYERS: weakref.WeakValueDictionary[int, nn.Module] = weakref.WeakValueDictionary()
_layer_ids = itertools.count()


def _register(layer: nn.Module) -> None:
    """Give ``layer`` (``NVFP4Linear``, ``FrozenNVFP4Linear``) an op id in the layers' one registry: a 0-d
    int64 CPU tensor attribute, an input of the compiled graph, so layers of one signature share a graph."""
    op_id = next(_layer_ids)
    layer._op_id = torch.tensor(op_id, dtype=torch.int64, device="cpu")
    _LAYERS[op_id] = layer


def _layer_of(op_id: torch.Tensor, op: str = "triage::nvfp4_linear") -> nn.Module:
    layer = _LAYERS.get(int(op_id))
    if layer is None:
        raise RuntimeError(f"{op}: no live layer has op id {int(op_id)}")
    return layer


def _empty(device: torch.device, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=device)


def _tags(*names: str) -> tuple:
    """The torch.Tag values of ``names`` this torch has, each op's with ``flexible_layout``: inductor hands
    the op its input buffer as it is (the ops take any strides) instead of a copy in the traced strides per
    call, so the members of a sibling group get one x (one group launch) and no copy kernel runs."""
    return tuple(getattr(torch.Tag, n) for n in (*names, "flexible_layout") if hasattr(torch.Tag, n))


def _forward_outputs(
    config: NVFP4LinearConfig,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    w: _QuantizedWeight,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both forward ops' core: ``(y, W_qᵀ codes, W_qᵀ scales, W_qᵀ outer scale)`` for W_q ``w``, the last
    three the forward's transposed weight for nvfp4-backward (empty otherwise). The eager forward's code and
    plans, so the same bits."""
    return _linear_forward(x, bias, _plan(config, x, weight, bias), w), *_transposed_outputs(w, x.device)


def _transposed_outputs(w: _QuantizedWeight, device: torch.device) -> tuple:
    """The forward ops' last three outputs: W_qᵀ's codes, scales and outer scale (empty without W_qᵀ)."""
    wt = w.transposed
    if wt is None:
        return _empty(device), _empty(device, torch.float8_e4m3fn), _empty(device, torch.float32)
    # detached aliases: the cache keeps its own tensors, the graph gets new ones (nothing copied)
    return wt.data.detach(), wt.scale.detach(), wt.global_scale.detach()


def _forward_fake(x: torch.Tensor, weight: torch.Tensor, nvfp4_backward: bool) -> tuple:
    n, k = weight.shape
    y = x.new_empty((*x.shape[:-1], n))
    if not nvfp4_backward:
        return (
            y,
            x.new_empty(0, dtype=torch.uint8),
            x.new_empty(0, dtype=torch.float8_e4m3fn),
            x.new_empty(0, dtype=torch.float32),
        )
    return (
        y,
        x.new_empty((k, n // 2), dtype=torch.uint8),
        x.new_empty((k, n // 16), dtype=torch.float8_e4m3fn),
        x.new_empty((), dtype=torch.float32),
    )


def _op_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    layer: torch.Tensor,
    nvfp4_backward: bool,
    grad_free: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``triage::nvfp4_linear``, the forward of the cached NVFP4Linear ``layer`` (its op id tensor) as one op
    (:func:`_forward_outputs`, W_q from the layer's weight cache). ``nvfp4_backward``: whether the layer's
    config is ``nvfp4-backward`` (the output shapes depend on it; the fake cannot read the id). ``grad_free``:
    the caller runs without autograd (told by the call site: an op's implementation always runs with grad
    off), so sibling layers may share one decode launch as in the eager grad-free forward."""
    mod = _layer_of(layer)
    w = mod._quantized_weight(weight)
    with _op_call():
        if grad_free and mod._siblings is not None:  # grad-free: q/k/v, gate/up one launch
            y = mod._siblings.output(mod, x, separate=True)
            if y is not None:
                return y, *_transposed_outputs(w, x.device)
        return _forward_outputs(mod.config, x, weight, bias, w)


def _op_forward_fake(x, weight, bias, layer, nvfp4_backward, grad_free=False):
    return _forward_fake(x, weight, nvfp4_backward)


def _capturable_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    seeds: torch.Tensor | None,
    config: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``triage::nvfp4_linear_capturable``, the forward of a ``capturable`` NVFP4Linear as one op
    (:func:`_forward_outputs`, W_q quantized now). ``seeds``: the stochastic-rounding seeds the layer drew
    for this call's backward (:func:`_device_seeds`, a device tensor; None where no backward can follow or
    in bf16-backward), passed on to the backward op. ``config``: the config's key (:data:`_CONFIGS`). No
    layer and no host tensor: one op and one graph serve every layer of an equal config."""
    cfg = _config_of(config)
    with _op_call():
        return _forward_outputs(cfg, x, weight, bias, _quantize_weight(weight, cfg))


def _capturable_forward_fake(x, weight, bias, seeds, config):
    return _forward_fake(x, weight, _config_of(config).backward == "nvfp4-backward")


def _backward_outputs(
    config: NVFP4LinearConfig,
    seeds: tuple[int, int] | torch.Tensor | None,
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    wt_data: torch.Tensor,
    wt_scale: torch.Tensor,
    wt_global: torch.Tensor,
    needs: tuple[bool, bool, bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both backward ops' core: ``(dx, dW, db)`` (an empty tensor where not needed) by the eager backward's
    code, W_qᵀ rebuilt from the forward's outputs."""
    weight_t = None
    if config.backward == "nvfp4-backward":
        n, k = weight.shape
        weight_t = NVFP4Tensor(
            data=wt_data, scale=wt_scale, global_scale=wt_global, recipe=config.weight,
            shape=torch.Size((k, n)), dtype=weight.dtype,
        )  # fmt: skip
    bias_dtype = None if bias is None else bias.dtype
    plan = _plan(config, x, weight, bias)
    dx, dw, db = _linear_backward(dy, x, weight, plan, weight_t, seeds, bias_dtype, needs)
    return (
        dx if dx is not None else _empty(x.device, x.dtype),
        dw if dw is not None else _empty(x.device, weight.dtype),
        db if db is not None else _empty(x.device, x.dtype if bias is None else bias.dtype),
    )


def _backward_fake(x, weight, bias, needs_dx, needs_dw, needs_db) -> tuple:
    return (
        x.new_empty(x.shape) if needs_dx else x.new_empty(0),
        weight.new_empty(weight.shape) if needs_dw else weight.new_empty(0),
        bias.new_empty(bias.shape)
        if needs_db and bias is not None
        else x.new_empty(0, dtype=x.dtype if bias is None else bias.dtype),
    )


def _op_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    wt_data: torch.Tensor,
    wt_scale: torch.Tensor,
    wt_global: torch.Tensor,
    layer: torch.Tensor,
    needs_dx: bool,
    needs_dw: bool,
    needs_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``triage::nvfp4_linear_backward``: the backward of the cached op (:func:`_backward_outputs`), its
    seeds drawn now from the layer's host count (:func:`_rounding_seeds`)."""
    mod = _layer_of(layer)
    seeds = _rounding_seeds(mod.config, mod) if mod.config.backward == "nvfp4-backward" else None
    needs = (needs_dx, needs_dw, needs_db)
    return _backward_outputs(mod.config, seeds, dy, x, weight, bias, wt_data, wt_scale, wt_global, needs)


def _op_backward_fake(dy, x, weight, bias, wt_data, wt_scale, wt_global, layer, needs_dx, needs_dw, needs_db):
    return _backward_fake(x, weight, bias, needs_dx, needs_dw, needs_db)


def _capturable_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    wt_data: torch.Tensor,
    wt_scale: torch.Tensor,
    wt_global: torch.Tensor,
    seeds: torch.Tensor | None,
    config: str,
    needs_dx: bool,
    needs_dw: bool,
    needs_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``triage::nvfp4_linear_capturable_backward``: the backward of the capturable op
    (:func:`_backward_outputs`) with the seeds its forward was given (a device tensor, saved by autograd)."""
    cfg = _config_of(config)
    needs = (needs_dx, needs_dw, needs_db)
    return _backward_outputs(
        cfg, _backward_seeds(cfg, seeds, None), dy, x, weight, bias, wt_data, wt_scale, wt_global, needs
    )


def _capturable_backward_fake(dy, x, weight, bias, wt_data, wt_scale, wt_global, seeds, config, *needs):
    return _backward_fake(x, weight, bias, *needs)


def _define_ops(name: str, forward_fn, backward_fn, fakes: tuple, carried, tags: tuple, backward_tags: tuple):
    """The custom op ``triage::<name>`` (``forward_fn``), its backward ``triage::<name>_backward``
    (``backward_fn``), their ``fakes`` and the forward's autograd, shared by both ops: the backward op takes
    ``(dy, x, W, b, W_qᵀ codes, scales, outer scale, *tensors, *constants, needs_dx, needs_dw, needs_db)``,
    where ``carried(inputs, outputs)`` gives ``(tensors, constants)``, what the op passes on from its forward
    beside those (tensors saved for the backward, constants kept on the autograd context)."""
    forward = torch.library.custom_op(f"triage::{name}", forward_fn, mutates_args=(), tags=tags)
    backward = torch.library.custom_op(
        f"triage::{name}_backward", backward_fn, mutates_args=(), tags=backward_tags
    )
    forward.register_fake(fakes[0])
    backward.register_fake(fakes[1])

    def setup_context(ctx, inputs, output) -> None:
        x, weight, bias = inputs[:3]
        _, wt_data, wt_scale, wt_global = output[:4]
        tensors, ctx.constants = carried(inputs, output)
        ctx.save_for_backward(x, weight, bias, wt_data, wt_scale, wt_global, *tensors)
        ctx.n_inputs = len(inputs)
        ctx.mark_non_differentiable(*output[1:])

    def autograd_backward(ctx, dy, *_):
        x, weight, bias, wt_data, wt_scale, wt_global, *tensors = ctx.saved_tensors
        needs_dx, needs_dw, needs_db = ctx.needs_input_grad[:3]
        needs_db = needs_db and bias is not None
        args = (dy, x, weight, bias, wt_data, wt_scale, wt_global, *tensors, *ctx.constants)
        dx, dw, db = backward(*args, needs_dx, needs_dw, needs_db)
        grads = (dx if needs_dx else None, dw if needs_dw else None, db if needs_db else None)
        return (*grads, *(None,) * (ctx.n_inputs - 3))

    forward.register_autograd(autograd_backward, setup_context=setup_context)
    return forward, backward


#: ``triage::nvfp4_linear`` (+ ``_backward``), the op of a cached config: its weight cache, checked in Python,
#: and its host stochastic-rounding counter live outside any graph, so a CUDA graph replay would skip them
#: (a stale W_q after an optimizer step, frozen seeds); ``cudagraph_unsafe`` keeps torch.compile's CUDA graphs
#: ("reduce-overhead") off it. It carries the layer's op id to its backward.
nvfp4_linear_op, nvfp4_linear_backward_op = _define_ops(
    "nvfp4_linear", _op_forward, _op_backward, (_op_forward_fake, _op_backward_fake),
    lambda inputs, output: ((inputs[3],), ()),  # the op id
    _tags("cudagraph_unsafe"), _tags("cudagraph_unsafe", "nondeterministic_seeded"),
)  # fmt: skip
#: ``triage::nvfp4_linear_capturable`` (+ ``_backward``), the op of a ``capturable`` config: its W_q is
#: quantized on the device at every call, its seeds are a device tensor input (drawn by the layer's forward
#: with device ops beside the op, :func:`_device_seeds`) that it saves for its backward, and its config is a
#: ``str`` constant of the graph: no CPU tensor and nothing per layer, so it is left capturable. Both
#: backwards carry ``nondeterministic_seeded``: their seeds change per call, so two calls are never one.
nvfp4_linear_capturable_op, nvfp4_linear_capturable_backward_op = _define_ops(
    "nvfp4_linear_capturable", _capturable_forward, _capturable_backward,
    (_capturable_forward_fake, _capturable_backward_fake),
    lambda inputs, output: ((inputs[3],), (inputs[4],)),  # the seeds; the config's key
    _tags(), _tags("nondeterministic_seeded"),
)  # fmt: skip


class NVFP4Linear(nn.Linear):
    """``nn.Linear`` with an NVFP4 forward GEMM; keeps the high-precision master weight for the optimizer.

    A drop-in replacement: same parameters (``weight`` [out, in], optional ``bias``), same state_dict.
    ``in_features`` must be a multiple of 16 unless the recipes pad (``QuantRecipe(pad=True)``).
    """

    #: The fused group this layer runs its decode GEMMs with (:func:`~triage.kernels.siblings.link_siblings`).
    _siblings = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        config: NVFP4LinearConfig | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.config = config or NVFP4LinearConfig()
        _check_features(self.in_features, self.out_features, self.config, type(self).__name__)
        self._init_state()

    def _init_state(self) -> None:
        """The layer's own state beside its parameters: the weight cache, the stochastic-rounding call counts
        (the host int of :func:`_rounding_seeds`, and the device tensor of a capturable config,
        :func:`_device_seeds`, a non-persistent buffer so that it moves with the layer and stays out of the
        state_dict) and the op id (call plans are shared by all layers: :func:`_plan`)."""
        self._weight_cache = _WeightCache()
        self._grad_calls = [0]
        calls = torch.tensor([0, 1], dtype=torch.int64).to(self.weight.device)
        self.register_buffer("_sr_calls", calls, persistent=False)
        _register(self)

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation, and the device seed count set from the host one: after
        ``to_empty()`` (meta-device init: FSDP2, ``accelerate.init_empty_weights``) the non-persistent
        ``_sr_calls`` holds whatever memory it got, and the initialisation that follows restores it."""
        super().reset_parameters()
        if "_sr_calls" in self._buffers:  # nn.Linear.__init__ calls this before _init_state
            n = self._grad_calls[0]
            with torch.no_grad():
                self._sr_calls.copy_(torch.tensor([2 * n, 2 * n + 1], dtype=torch.int64))

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: NVFP4LinearConfig | None = None) -> NVFP4Linear:
        """Wrap an existing ``nn.Linear``, sharing (not copying) its parameters."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new.config = config or NVFP4LinearConfig()
        _check_features(new.in_features, new.out_features, new.config, type(linear).__name__)
        new._init_state()
        new.train(linear.training)
        return new

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        _register(self)  # a copy (deepcopy, pickle) is a layer of its own for the custom ops

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` sharing this module's parameters."""
        lin = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(lin)
        lin.in_features, lin.out_features = self.in_features, self.out_features
        lin.weight, lin.bias = self.weight, self.bias
        lin.train(self.training)
        return lin

    def invalidate_cache(self) -> None:
        """Drop the cached W_q (needed only after a raw ``.data`` write outside an optimizer step; see
        :func:`invalidate_weight_caches` for every layer at once)."""
        self._weight_cache.clear()

    def quantized_weight(self) -> NVFP4Tensor:
        """The NVFP4 weight the forward uses (cached; quantized now under a ``capturable`` config)."""
        return self._quantized_weight(self.weight).quantized

    def _quantized_weight(self, weight: torch.Tensor) -> _QuantizedWeight:
        """W_q of ``weight`` for a call: from the weight cache, or quantized on the device under a
        ``capturable`` config (no Python check that a CUDA graph replay would skip)."""
        if self.config.capturable:
            return _quantize_weight(weight, self.config)
        return self._weight_cache.get(weight, self.config)

    def _decode_activation(self, x: torch.Tensor) -> tuple | None:
        """When this layer's grad-free forward on ``x`` runs the decode kernel: the activation as the kernel
        reads it (the fp16 expansion of x_q, ``[rows, K]``), its outer scale and x_q (the activation's source);
        else None (:mod:`triage.kernels.siblings`)."""
        config = self.config
        if config.capturable or x.numel() == 0:
            return None
        plan = _plan(config, x, self.weight, self.bias)
        from triage.kernels.nvfp4.matmul import decode_route

        if plan.large or not decode_route(config.gemm_backend, plan.rows, x.device):
            return None
        w = self._quantized_weight(self.weight)
        xq = quantize_input(
            x, config.activation, config.quant_backend, expanded=plan.act_expanded, plan=plan.x_plan,
            share=config.share_inputs,
        )  # fmt: skip
        gemm = plan.gemm_plan("fwd", xq, w.quantized, out_dtype=x.dtype, bias=self.bias, b_scale_host=w.host_scale)
        return gemm.decode_activation(xq)

    def _decode_weight(self) -> tuple:
        """``(W_q, bias, token)`` for the decode kernel (:mod:`triage.kernels.siblings`); ``token``: what
        means the same operands (the config, the cached W_q and the weight key it was quantized under — both
        change when W does, even where the cache refreshes in place —, the bias and its version counter)."""
        w = self._quantized_weight(self.weight)
        bias = self.bias
        version = None if bias is None else bias._version
        return w.quantized, bias, (self.config, w, self._weight_cache.key, bias, version)

    def _decode_token(self) -> tuple:
        """:meth:`_decode_weight`'s token alone (a sibling's check that a kept output is still its own)."""
        return self._decode_weight()[2]

    def _graph_key(self) -> tuple:
        """What a captured CUDA graph of this layer's forward reads beside its parameters and buffers
        (:func:`~triage.kernels.capture.graph_key`): the config, the sibling group, the cached W_q's tensor
        addresses (its values may change: a graph replays whatever they hold) and the decode scale a host
        GEMM read from it (a constant in a graph). Refreshes a stale W_q first, as a forward would."""
        if self.config.capturable:  # quantized inside the captured forward: nothing cached
            return (self.config, self._siblings)
        w = self._quantized_weight(self.weight)
        # scale_host: the decode scale a cuBLAS-alpha GEMM (more than SMALL_M rows) read to the host and a
        # capture baked in as a constant; an in-place refresh resets it and the next large forward reads the
        # new one (a changed key: the graph is captured anew)
        host = None if w.scale_host is None else float(w.scale_host).hex()  # NaN equals NaN
        return (self.config, self._siblings, host, *_tensor_addresses(_entry_tensors(w)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"NVFP4Linear: input has last dim {x.shape[-1]}, expected {self.in_features}")
        if x.device != self.weight.device:
            raise ValueError(f"NVFP4Linear: input is on {x.device} but the weight is on {self.weight.device}")
        if x.numel() == 0:
            # no tokens (the quantizer needs data): nn.Linear's empty output in x's dtype, connected to W and b
            # so that backward gives them zero gradients
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return nn.functional.linear(x, self.weight.to(x.dtype), bias)
        config = self.config
        seeds = None
        if _draws_seeds(config, x, self.weight, self.bias):  # capturable: drawn by the forward (module doc)
            # the seed count is a buffer mutated in the forward, as BatchNorm's running statistics
            seeds = _device_seeds(config, self._sr_calls)
        if torch.compiler.is_compiling():  # one opaque op (fullgraph-safe): the same code, cache and plans
            if config.capturable:  # no CPU tensor, no per-layer constant: the config's key, a str
                return nvfp4_linear_capturable_op(x, self.weight, self.bias, seeds, config._op_key)[0]
            nvfp4_backward = config.backward == "nvfp4-backward"
            grad_free = not torch.is_grad_enabled()
            return nvfp4_linear_op(x, self.weight, self.bias, self._op_id, nvfp4_backward, grad_free)[0]
        if not torch.is_grad_enabled() and self._siblings is not None:  # one launch for q/k/v, gate/up
            y = self._siblings.output(self, x)
            if y is not None:
                return y
        w = self._quantized_weight(self.weight)
        plan = _plan(config, x, self.weight, self.bias)
        if not torch.is_grad_enabled():  # no backward can follow: the forward alone, no autograd node
            return _linear_forward(x, self.bias, plan, w, share=config.share_inputs)
        return _NVFP4LinearFn.apply(x, self.weight, self.bias, plan, w, seeds, self)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, backward={self.config.backward!r}"


def _check_features(k: int, n: int, config: NVFP4LinearConfig, what: str) -> None:
    if k % 16 and not (config.activation.pad and config.weight.pad):
        raise ValueError(
            f"{what}: in_features={k} is not a multiple of 16; use recipes with pad=True or skip this layer"
        )
    if config.backward == "nvfp4-backward" and (k % 16 or n % 16):
        raise ValueError(
            f"{what}: backward='nvfp4-backward' needs in_features and out_features multiples of 16 "
            f"(16×16 weight tiles), got ({k}, {n})"
        )
