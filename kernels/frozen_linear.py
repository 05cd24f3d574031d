"""``FrozenNVFP4Linear``: a frozen Linear that stores ONLY its NVFP4 weight — the base layer for LoRA.

The QeRL setting (NVFP4 weights + LoRA adapters): the base weight never changes, so no high-precision
master copy is kept. The module holds, per ``[N, K]`` weight (Kp = K rounded up to 16):

==================  ======================  ==========================  ===============
buffer              dtype                   shape                       bytes / param
==================  ======================  ==========================  ===============
``qweight``         uint8                   [N, Kp/2] (2 E2M1 codes)    0.5
``weight_scale``    float8_e4m3fn           [N, Kp/16] (linear layout)  0.0625
``weight_scale_2``  float32 (DECODE scale)  [] or [N, 1] (per row)      ~0
``bias``            the model dtype         [N] or None                 ~0
==================  ======================  ==========================  ===============

so ~0.5625 byte per base parameter (the names follow the ModelOpt checkpoint layout; the packed codes are
``qweight`` so that nothing mistakes them for a dense ``weight``). ``weight_encode_scale`` (fp32, the
outer ENCODE scale the quantizer used, needed by encode-scale checkpoint layouts) is kept when known.
Optionally (``NVFP4FrozenConfig.cache_expanded``) the exact expansion ``E = q·s`` (bf16 [N, Kp], 2 bytes per
parameter, not a buffer) is cached for speed: the cuBLAS large-M path and the input gradient reuse it.

Forward, ``y = x·Ŵᵀ + b`` with ``Ŵ = q·s·g`` (``g`` = ``weight_scale_2``)::

    compute="w4a4":   y = gemm(quantize(x, activation), W_q)      # both operands NVFP4, fp32 accumulation
    compute="w4a16":  y = gemm_w4a16(x, W_q)                     # weight-only; x stays bf16/fp16
                                                              # (fp32 x: fp32 matmul with Ŵ, exact)

Backward: only the input gradient (the weight and bias are frozen), straight-through for the activation
quantizer of W4A4 (∂Q(x)/∂x ≈ I, as :class:`~triage.kernels.NVFP4Linear` does)::

    dx = dy · Ŵ = (dy · E) · g        # E exact in bf16/fp16, fp32 accumulation, g in the epilogue

computed from the cached expansion, or from a temporary one (freed right after) when nothing is cached.

Immutability. The quantized bytes never change in place: :meth:`FrozenNVFP4Linear.load_state_dict` and
PEFT's merge replace the tensors, ``.to(dtype)`` / ``.half()`` move them between devices but never cast
them, and ``copy.deepcopy`` SHARES them. So a sampler copy of a LoRA model (``HFSampler(sampler_model=
"copy")``) holds no second base: only the adapters are copied.

Conversion: :func:`triage.kernels.convert` with ``NVFP4Config(frozen=...)`` turns every
:class:`~triage.kernels.NVFP4Linear` of a model into a ``FrozenNVFP4Linear`` holding the very bytes the
NVFP4Linear computed with (so outputs are unchanged with ``compute="w4a4"`` and the same activation recipe)
and drops the master weight; :func:`triage.kernels.unconvert` (:meth:`FrozenNVFP4Linear.to_linear`) gives an
``nn.Linear`` holding Ŵ. Checkpoints: the kernels' one NVFP4 writer,
:func:`~triage.kernels.nvfp4.export.write_nvfp4_checkpoint`, stores the bytes of
:meth:`FrozenNVFP4Linear.quantized_weight` as they are, and :func:`load_nvfp4_base` loads an NVFP4
checkpoint (ModelOpt, compressed-tensors) back into frozen layers, bit for bit. The PEFT integration (the
LoRA layer over this base, AQN, adapter save/load) is in ``triage.trainers.lora``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from triage.kernels.linear import (
    NVFP4Linear,
    _layer_of,
    _op_call,
    _register,
    _rows_plan,
    _tags,
    _triton_quantizes,
    quantize_input,
)
from triage.kernels.nvfp4.recipe import QuantRecipe
from triage.kernels.nvfp4.tensor import NVFP4Tensor
from triage.kernels.siblings import _same

if TYPE_CHECKING:
    from triage.kernels.linear import NVFP4LinearConfig

__all__ = [
    "COMPUTE_MODES",
    "FrozenNVFP4Linear",
    "NVFP4FrozenConfig",
    "base_nbytes",
    "load_nvfp4_base",
]

COMPUTE_MODES = ("w4a4", "w4a16")
#: W4A4 activation plans by (config id, rows, K, dtype, device): ``(config, expansion dtype, quantizer plan)``
#: (:meth:`FrozenNVFP4Linear._x_plan`); the last :data:`X_PLANS_KEPT` signatures are kept.
_X_PLANS: dict[tuple, tuple] = {}
X_PLANS_KEPT = 256
#: Buffers holding the quantized weight: shared by deepcopy, never cast by ``.to(dtype)``.
QUANT_BUFFERS = ("qweight", "weight_scale", "weight_scale_2", "weight_encode_scale")


@dataclass(frozen=True)
class NVFP4FrozenConfig:
    """How a :class:`FrozenNVFP4Linear` computes (the fields of :class:`~triage.kernels.NVFP4LinearConfig`
    that apply to a frozen weight, plus ``compute`` and ``cache_expanded``).

    Attributes:
        compute: ``"w4a4"`` (activations quantized with ``activation`` per call, NVFP4 × NVFP4 GEMM) or
            ``"w4a16"`` (weight-only: activations stay in their dtype).
        activation: activation quantizer for ``w4a4`` (1×16 blocks along K; no Hadamard).
        cache_expanded: keep the exact bf16 expansion ``q·s`` of the weight (+2 bytes/param) for the
            cuBLAS large-M path and the input gradient; off by default (memory first).
        gemm_backend / quant_backend: passed to :func:`~triage.kernels.nvfp4.gemm` /
            :func:`~triage.kernels.nvfp4.gemm_w4a16` and :func:`~triage.kernels.nvfp4.quantize`.
        share_inputs: ``w4a4`` siblings reading one input (q/k/v, gate/up) quantize it once
            (:func:`~triage.kernels.linear.quantize_input`; :class:`~triage.kernels.NVFP4LinearConfig`'s
            field of that name); the same bytes either way.
    """

    compute: str = "w4a4"
    activation: QuantRecipe = field(default_factory=QuantRecipe)
    cache_expanded: bool = False
    gemm_backend: str = "auto"
    quant_backend: str = "auto"
    share_inputs: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.share_inputs, bool):
            raise TypeError(f"NVFP4FrozenConfig.share_inputs must be a bool, got {self.share_inputs!r}")
        if self.compute not in COMPUTE_MODES:
            raise ValueError(
                f"NVFP4FrozenConfig.compute must be one of {COMPUTE_MODES}, got {self.compute!r}"
            )
        if not isinstance(self.activation, QuantRecipe):
            raise TypeError(
                f"NVFP4FrozenConfig.activation must be a QuantRecipe, got {type(self.activation).__name__}"
            )
        if self.activation.hadamard:
            raise ValueError(
                "NVFP4FrozenConfig.activation cannot use the Hadamard transform (forward operand)"
            )
        if self.activation.scale == "expert":
            raise ValueError("NVFP4FrozenConfig.activation: per-expert scales belong to the MoE layer")

    @classmethod
    def like(cls, config: NVFP4LinearConfig) -> NVFP4FrozenConfig:
        """The frozen config that computes as an :class:`~triage.kernels.NVFP4Linear` with ``config`` (an
        ``NVFP4LinearConfig``) does: ``"w4a4"`` with its activation recipe and backends."""
        return cls(
            activation=config.activation,
            gemm_backend=config.gemm_backend,
            quant_backend=config.quant_backend,
            share_inputs=config.share_inputs,
        )


class _FrozenNVFP4Fn(torch.autograd.Function):
    """``y = f(x)`` with ``dx = dy·Ŵ`` (the frozen weight gets no gradient)."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        return layer._compute(x)

    @staticmethod
    def backward(ctx, dy):
        return ctx.layer._input_grad(dy, ctx.x_shape, ctx.x_dtype), None


class FrozenNVFP4Linear(nn.Module):
    """A frozen Linear layer storing only its NVFP4 weight (module docstring). No trainable parameters.

    Build it with :meth:`from_linear` (an ``nn.Linear`` or an ``NVFP4Linear``) or :meth:`from_quantized`
    (an ``NVFP4Tensor``, e.g. from :func:`~triage.kernels.nvfp4.load_nvfp4_checkpoint`).
    """

    #: The fused group this layer runs its decode GEMMs with (:func:`~triage.kernels.siblings.link_siblings`).
    _siblings = None
    #: The W4A16 decode launch kept for the last input signature and weight token (:meth:`_w4a16_decode`);
    #: not copied or pickled, dropped (with the sibling group's) by ``replace_weight``, ``load_state_dict``
    #: and moves; a buffer assigned directly is caught by the token and released at the next call.
    _w4a16_plan = None

    def __init__(
        self,
        weight: NVFP4Tensor,
        bias: torch.Tensor | None = None,
        config: NVFP4FrozenConfig | None = None,
    ) -> None:
        super().__init__()
        self.config = config or NVFP4FrozenConfig()
        _check_weight(weight)
        out_features, in_features = tuple(weight.shape)
        self.in_features, self.out_features = in_features, out_features
        self.weight_recipe: QuantRecipe = weight.recipe
        self.weight_dtype: torch.dtype = weight.dtype
        _check_compute_fits(self.config, weight.recipe, in_features)
        gs = weight.global_scale
        if not isinstance(gs, torch.Tensor):
            gs = torch.tensor(float(gs), dtype=torch.float32)
        _check_finite_scales(weight.scale, gs)
        # row-major codes and scales: the decode kernel streams them as words (a strided view would be
        # copied at every call); the NVFP4Tensor's own tensors when they already are
        self.register_buffer("qweight", weight.data.detach().contiguous())
        self.register_buffer("weight_scale", weight.scale.detach().contiguous())
        self.register_buffer("weight_scale_2", gs.detach().float().to(weight.data.device))
        enc = weight.global_encode_scale
        self.register_buffer(
            "weight_encode_scale", None if enc is None else enc.detach().float().to(weight.data.device)
        )
        if bias is not None:
            if tuple(bias.shape) != (out_features,):
                raise ValueError(
                    f"FrozenNVFP4Linear: bias has shape {tuple(bias.shape)}, expected ({out_features},)"
                )
            bias = bias.detach().to(weight.data.device)
        self.register_buffer("bias", bias)
        self._expanded: torch.Tensor | None = None
        _register(self)

    # -- construction -----------------------------------------------------------------------------------------

    @classmethod
    def from_quantized(
        cls, weight: NVFP4Tensor, bias: torch.Tensor | None = None, config: NVFP4FrozenConfig | None = None
    ) -> FrozenNVFP4Linear:
        """Wrap an already-quantized weight (its bytes are used as they are, not copied)."""
        return cls(weight, bias, config)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        config: NVFP4FrozenConfig | None = None,
        *,
        recipe: QuantRecipe | None = None,
        quant_backend: str = "auto",
    ) -> FrozenNVFP4Linear:
        """Freeze ``linear``. An ``NVFP4Linear`` gives its cached ``W_q`` (the bytes its forward used) and,
        when ``config`` is None, computes as it did (:meth:`NVFP4FrozenConfig.like`); a plain ``nn.Linear`` is
        quantized with ``recipe`` (default ``QuantRecipe()``: 1×16 blocks, TE formulas)."""
        bias = None if linear.bias is None else linear.bias.detach()
        if isinstance(linear, NVFP4Linear):
            if recipe is not None:
                raise ValueError(
                    "FrozenNVFP4Linear.from_linear: an NVFP4Linear keeps its own weight recipe "
                    f"({linear.config.weight}); recipe= applies to plain nn.Linear only"
                )
            config = config or NVFP4FrozenConfig.like(linear.config)
            return cls(_detached(linear.quantized_weight()), bias, config)
        if not isinstance(linear, nn.Linear):
            raise TypeError(
                f"FrozenNVFP4Linear.from_linear expects an nn.Linear, got {type(linear).__name__}"
            )
        from triage.kernels.nvfp4 import quantize

        bad = ~torch.isfinite(linear.weight.detach())
        if bad.any():
            row, col = bad.nonzero()[0].tolist()
            raise ValueError(
                f"FrozenNVFP4Linear.from_linear: the weight has {int(bad.sum())} NaN/Inf value(s), first at "
                f"[{row}, {col}]; refusing to quantize it"
            )
        with torch.no_grad():
            w = quantize(linear.weight.detach(), recipe or QuantRecipe(), backend=quant_backend)
        return cls(w, bias, config)

    # -- views ------------------------------------------------------------------------------------------------

    def quantized_weight(self) -> NVFP4Tensor:
        """The stored weight as an ``NVFP4Tensor`` (a view: no copy)."""
        b = self._buffers  # directly: no Module.__getattr__ per buffer (called per decode launch)
        return NVFP4Tensor(
            data=b["qweight"],
            scale=b["weight_scale"],
            global_scale=b["weight_scale_2"],
            recipe=self.weight_recipe,
            shape=torch.Size((self.out_features, self.in_features)),
            dtype=self.weight_dtype,
            global_encode_scale=b["weight_encode_scale"],
        )

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``Ŵ = q·s·g`` as a dense [N, K] tensor (exact in fp32; cast to ``dtype``, default the original)."""
        return self.quantized_weight().dequantize(dtype)

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` holding ``Ŵ`` in the original dtype and the bias, both frozen
        (``requires_grad=False``): the high-precision form of this layer (the master weight is gone)."""
        lin = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(lin)
        lin.in_features, lin.out_features = self.in_features, self.out_features
        lin.weight = nn.Parameter(self.dequantized_weight(), requires_grad=False)
        lin.bias = None if self.bias is None else nn.Parameter(self.bias, requires_grad=False)
        lin.train(self.training)
        return lin

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the weight that was quantized (the model's dtype); LoRA adapters follow it."""
        return self.weight_dtype

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def nbytes(self) -> int:
        """Bytes of every tensor this module holds (buffers and the expansion cache, if filled)."""
        tensors = [t for t in self._buffers.values() if t is not None]
        if self._expanded is not None:
            tensors.append(self._expanded)
        return sum(t.numel() * t.element_size() for t in tensors)

    def expansion(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The exact ``q·s`` [N, Kp] (outer scale NOT applied) in ``dtype`` (bf16, fp16 and fp32 all hold it
        exactly). With ``config.cache_expanded`` a bf16 copy is kept and reused; otherwise it is temporary."""
        from triage.kernels.nvfp4.matmul import expand

        def expanded(dt: torch.dtype) -> torch.Tensor:
            if self.config.gemm_backend == "reference":  # the torch twin of ``expand``
                return self.quantized_weight().block_values().to(dt)
            return expand(self.quantized_weight(), dt)

        cached = self._expanded
        if cached is not None and cached.device != self.qweight.device:
            cached = self._expanded = None
        if cached is None and self.config.cache_expanded:
            cached = self._expanded = expanded(torch.bfloat16)
        if cached is not None:
            return cached if cached.dtype == dtype else cached.to(dtype)
        return expanded(dtype)

    # -- compute ----------------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"FrozenNVFP4Linear: input has last dim {x.shape[-1]}, expected in_features={self.in_features}"
            )
        if x.device != self.qweight.device:
            raise ValueError(
                f"FrozenNVFP4Linear: input is on {x.device} but the weight is on {self.qweight.device}"
            )
        if not x.is_floating_point():
            raise TypeError(f"FrozenNVFP4Linear: input must be floating point, got {x.dtype}")
        if torch.is_grad_enabled() and x.requires_grad:
            return _FrozenNVFP4Fn.apply(x, self)
        if torch.compiler.is_compiling():  # one opaque op: no graph break at the Triton launches
            return frozen_nvfp4_linear_op(x, self._op_id, self.out_features)
        return self._grad_free(x)

    def _grad_free(self, x: torch.Tensor, separate: bool = False) -> torch.Tensor:
        """The forward without autograd: the sibling group's launch (q/k/v, gate/up; ``separate`` outputs
        inside a compiled graph, :meth:`~triage.kernels.siblings.SiblingGroup.output`) or the layer alone."""
        if self._siblings is not None:  # one decode launch for q/k/v, gate/up (triage.kernels.siblings)
            y = self._siblings.output(self, x, separate)
            if y is not None:
                return y
        return self._compute(x)

    def _outer(self) -> torch.Tensor:
        """``g`` as fp32: 1 element or [N]."""
        return self.weight_scale_2.float().reshape(-1)

    def _compute(self, x: torch.Tensor) -> torch.Tensor:
        from triage.kernels.nvfp4.matmul import gemm, gemm_w4a16

        cfg = self.config
        K, N = self.in_features, self.out_features
        x2 = x.reshape(-1, K)
        w4a16 = cfg.compute == "w4a16" and x.dtype in (torch.bfloat16, torch.float16)
        if w4a16 and not (cfg.cache_expanded and self._uses_cublas(x2.shape[0])):
            y = self._w4a16_decode(x2)  # the decode kernel, its plan kept
            if y is not None:
                return y.reshape(*x.shape[:-1], N)
        w = self.quantized_weight()
        if cfg.compute == "w4a4":
            expanded, plan = self._x_plan(x)
            xq = quantize_input(
                x, cfg.activation, cfg.quant_backend, expanded=expanded, plan=plan, share=cfg.share_inputs
            )
            cached = self._expanded if cfg.cache_expanded else None
            if cached is None and cfg.cache_expanded and self._uses_cublas(x2.shape[0]):
                cached = self.expansion()
            y = gemm(xq, w, out_dtype=x.dtype, bias=self.bias, backend=cfg.gemm_backend, b_expanded=cached)
        elif x.dtype in (torch.bfloat16, torch.float16) and not (
            cfg.cache_expanded and self._uses_cublas(x2.shape[0])
        ):
            y = gemm_w4a16(x2, w, bias=self.bias, backend=cfg.gemm_backend)
        else:  # weight-only with fp32 activations, or the cached-expansion cuBLAS path
            y = self._dense_matmul(x2)
        return y.reshape(*x.shape[:-1], N)

    def _w4a16_decode(self, x2: torch.Tensor) -> torch.Tensor | None:
        """``gemm_w4a16(x2, W, bias)`` where it runs the decode kernel, else None: the launch, the checks of
        W and the outer scale as the kernel reads it are kept for the last input signature and weight token
        (:meth:`_decode_token`: the config, the tensors and their version counters), so a call checks the
        weight once per change, not once per call. The same kernel and arguments: the same bits."""
        token = self._decode_token()
        signature = (x2.shape, x2.dtype, x2.device)
        kept = self._w4a16_plan
        if kept is None or kept[0] != signature or not _same(kept[1], token):
            from triage.kernels.nvfp4 import gemm_decode as gd
            from triage.kernels.nvfp4 import matmul as mm

            plan = None
            if mm.decode_route(self.config.gemm_backend, x2.shape[0], x2.device, weight_only=True):
                w = self.quantized_weight()
                M, N, K = mm._check_w4a16(x2, w, self.bias, None)
                launch = gd.default_launch(M, N, K, w.scale.shape[-1], x2.dtype, x2.dtype, x2.device)
                plan = (launch, mm._outer_scale(w, "w"))
            kept = self._w4a16_plan = (signature, token, plan)
        if kept[2] is None:
            return None
        launch, g_w = kept[2]
        b = self._buffers
        out = torch.empty((x2.shape[0], self.out_features), dtype=x2.dtype, device=x2.device)
        return launch.run(x2, b["qweight"], b["weight_scale"], out, None, g_w, b["bias"])

    def _decode_activation(self, x: torch.Tensor) -> tuple | None:
        """When this layer's forward on ``x`` runs the decode kernel: the activation as the kernel reads it
        (``w4a16``: x as ``[rows, K]``; ``w4a4``: the fp16 expansion of x_q), its outer scale (None for
        ``w4a16``) and the activation's source (x, or x_q); else None (:mod:`triage.kernels.siblings`)."""
        from triage.kernels.nvfp4 import matmul as mm

        cfg, K = self.config, self.in_features
        rows = x.numel() // K
        w4a16 = cfg.compute == "w4a16"
        if rows == 0 or (w4a16 and x.dtype not in (torch.bfloat16, torch.float16)):
            return None
        if not mm.decode_route(cfg.gemm_backend, rows, x.device, weight_only=w4a16):
            return None
        if w4a16:
            return x.reshape(rows, K), None, x
        expanded, plan = self._x_plan(x)
        xq = quantize_input(x, cfg.activation, cfg.quant_backend, expanded=expanded, plan=plan, share=cfg.share_inputs)
        gemm = mm.gemm_plan(xq, self.quantized_weight(), out_dtype=x.dtype, bias=self.bias, backend=cfg.gemm_backend)
        return gemm.decode_activation(xq)

    def _x_plan(self, x: torch.Tensor) -> tuple:
        """``w4a4``: ``(expansion dtype, quantizer plan)`` of x's activation quantization, kept per signature
        (:data:`_X_PLANS`). The expansion: fp16 when the GEMM runs the decode kernel and the Triton quantizer
        runs, which then writes x_q's exact fp16 ``q·s`` with the codes for the decode kernel (no expansion
        pass; the same bits), as :class:`~triage.kernels.NVFP4Linear` does; else None. The plan: the Triton
        quantizer's (``linear._rows_plan``, with the non-finite rule in the kernel where it applies), or None
        (the torch quantizer through ``quantize``)."""
        cfg, K = self.config, x.shape[-1]
        rows = x.numel() // K
        key = (id(cfg), rows, K, x.dtype, x.device)
        hit = _X_PLANS.get(key)
        if hit is not None and hit[0] is cfg:  # the entry holds cfg: its id cannot be reused while kept
            return hit[1], hit[2]
        from triage.kernels.nvfp4.matmul import decode_route

        expanded = None
        if _triton_quantizes(cfg.quant_backend, x.device) and decode_route(cfg.gemm_backend, rows, x.device):
            expanded = torch.float16
        plan = _rows_plan(cfg.activation, cfg.quant_backend, (rows, K), x.dtype, x.device, expanded)
        if len(_X_PLANS) >= X_PLANS_KEPT:
            _X_PLANS.pop(next(iter(_X_PLANS), None), None)
        _X_PLANS[key] = (cfg, expanded, plan)
        return expanded, plan

    def _decode_weight(self) -> tuple:
        """``(weight, bias, token)`` for the decode kernel (:mod:`triage.kernels.siblings`), ``token`` as
        :meth:`_decode_token` gives it."""
        return self.quantized_weight(), self._buffers["bias"], self._decode_token()

    def _decode_token(self) -> tuple:
        """What means the same decode operands (:mod:`triage.kernels.siblings`): the config, the weight's
        tensors and the bias, each with its version counter (written in place) and data pointer (its ``.data``
        reassigned). An inference tensor has no version counter: its token never matches another (a fresh
        object), so nothing kept is reused for it."""
        b = self._buffers  # directly: no Module.__getattr__ per buffer (a sibling check per layer call)
        tensors = (b["qweight"], b["weight_scale"], b["weight_scale_2"], b["bias"])
        marks = tuple(
            None if t is None else (object() if t.is_inference() else t._version, t.data_ptr()) for t in tensors
        )
        return (self.config, *tensors, *(m for pair in marks for m in (pair or (None, None))))

    def _graph_key(self) -> tuple:
        """What a captured CUDA graph of this layer's forward reads beside its buffers
        (:func:`~triage.kernels.capture.graph_key`): the config, the sibling group, the cached expansion."""
        e = self._expanded
        return (self.config, self._siblings, None if e is None else (e.data_ptr(), tuple(e.shape), e.dtype))

    def _uses_cublas(self, m: int) -> bool:
        from triage.kernels.nvfp4 import matmul as g

        b = self.config.gemm_backend
        on_gpu = self.qweight.device.type == "cuda"
        return b == "cublas" or (b == "auto" and on_gpu and m > g.SMALL_M and g.LARGE_M_BACKEND == "cublas")

    def _dense_matmul(self, x2: torch.Tensor) -> torch.Tensor:
        """``x·Ŵᵀ + b`` on the exact expansion: fp32 accumulation, outer scale and bias in fp32, one cast."""
        K = self.in_features
        x2 = x2.contiguous()  # the bits of a row-major x whatever x's layout (a compiled graph's may differ)
        if x2.is_cuda and x2.dtype in (torch.bfloat16, torch.float16):
            acc = torch.mm(x2, self.expansion(x2.dtype)[:, :K].T, out_dtype=torch.float32)
        else:
            acc = x2.float() @ self.expansion(torch.float32)[:, :K].T
        g = self._outer()
        y = acc * (g if g.numel() == 1 else g[None, :])
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x2.dtype)

    def _input_grad(self, dy: torch.Tensor, x_shape, x_dtype) -> torch.Tensor:
        """``dx = dy·Ŵ = (dy·E)·g``: exact products, fp32 accumulation (per-row g scales dy's columns)."""
        K, N = self.in_features, self.out_features
        dy2 = dy.reshape(-1, N)
        g = self._outer()
        if g.numel() == 1 and dy2.is_cuda and dy2.dtype in (torch.bfloat16, torch.float16):
            dx = torch.mm(dy2, self.expansion(dy2.dtype), out_dtype=torch.float32) * g
        else:
            dyf = dy2.float() if g.numel() == 1 else dy2.float() * g[None, :]
            dx = dyf @ self.expansion(torch.float32)
            if g.numel() == 1:
                dx = dx * g
        return dx[:, :K].to(x_dtype).reshape(x_shape)

    # -- immutability -----------------------------------------------------------------------------------------

    def replace_weight(self, weight: NVFP4Tensor) -> None:
        """Swap in another quantized weight of the same shape (new tensors; the old ones are not touched)."""
        _check_weight(weight)
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"FrozenNVFP4Linear.replace_weight: shape {tuple(weight.shape)} != "
                f"{(self.out_features, self.in_features)}"
            )
        gs = weight.global_scale
        gs = gs if isinstance(gs, torch.Tensor) else torch.tensor(float(gs))
        _check_finite_scales(weight.scale, gs)
        dev = self.qweight.device
        self.qweight = weight.data.detach().to(dev).contiguous()
        self.weight_scale = weight.scale.detach().to(dev).contiguous()
        gs = weight.global_scale
        self.weight_scale_2 = (
            (gs if isinstance(gs, torch.Tensor) else torch.tensor(float(gs))).float().to(dev)
        )
        enc = weight.global_encode_scale
        self.weight_encode_scale = None if enc is None else enc.detach().float().to(dev)
        self.weight_recipe = weight.recipe
        self._expanded = None
        self._drop_plans()

    def _apply(self, fn, recurse=True):
        before = {n: self._buffers.get(n) for n in QUANT_BUFFERS}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers.get(name)
            if old is not None and new is not None and new.dtype != old.dtype:
                self._buffers[name] = old.to(new.device)  # move, never cast the quantized bytes
        if self._expanded is not None and self._expanded.device != self.qweight.device:
            self._expanded = None
        self._drop_plans()
        return self

    def _drop_plans(self) -> None:
        """Forget the kept launch plans (this layer's and its sibling group's), which hold the tensors they
        were made for: the weight tensors were replaced or moved."""
        self._w4a16_plan = None
        if self._siblings is not None:
            self._siblings._plan = None

    def __deepcopy__(self, memo):
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            if key == "_buffers":
                new.__dict__[key] = {
                    n: (t if n in QUANT_BUFFERS else copy.deepcopy(t, memo)) for n, t in value.items()
                }
            elif key == "_expanded":
                new.__dict__[key] = value  # immutable: shared like the bytes it expands
            elif key not in ("_op_id", "_w4a16_plan"):
                new.__dict__[key] = copy.deepcopy(value, memo)
        _register(new)  # a layer of its own for the custom op
        return new

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.pop("_w4a16_plan", None)  # a launch plan: made again on the first call
        return state

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        _register(self)  # an unpickled layer is a layer of its own for the custom op

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        # Replace (never write into) the quantized tensors: they may be shared with a sampler copy.
        for name, current in list(self._buffers.items()):
            key = prefix + name
            if key not in state_dict:
                if current is not None:
                    missing_keys.append(key)
                continue
            t = state_dict[key]
            if current is None:
                error_msgs.append(f"{key}: this FrozenNVFP4Linear has no {name} (got a tensor)")
                continue
            quant = name in QUANT_BUFFERS  # exact bytes: never cast; the bias follows this module's dtype
            if (quant and t.dtype != current.dtype) or tuple(t.shape) != tuple(current.shape):
                error_msgs.append(
                    f"{key}: expected {current.dtype} {tuple(current.shape)}, got {t.dtype} {tuple(t.shape)}"
                )
                continue
            if t is not current:
                self._buffers[name] = t.detach().to(device=current.device, dtype=current.dtype)
                self._expanded = None
                self._drop_plans()
        if strict:
            known = {prefix + n for n in self._buffers}
            for key in state_dict:
                if key.startswith(prefix) and "." not in key[len(prefix) :] and key not in known:
                    unexpected_keys.append(key)

    def extra_repr(self) -> str:
        r = self.weight_recipe
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"compute={self.config.compute!r}, weight_block={r.block!r}, profile={r.profile!r}"
        )


def _detached(t: NVFP4Tensor) -> NVFP4Tensor:
    def d(v):
        return v.detach() if isinstance(v, torch.Tensor) else v

    return NVFP4Tensor(
        data=d(t.data),
        scale=d(t.scale),
        global_scale=d(t.global_scale),
        recipe=t.recipe,
        shape=torch.Size(tuple(t.shape)),
        dtype=t.dtype,
        global_encode_scale=d(t.global_encode_scale),
        amax=d(t.amax),
    )


def _check_weight(w: NVFP4Tensor) -> None:
    if not isinstance(w, NVFP4Tensor):
        raise TypeError(f"FrozenNVFP4Linear needs an NVFP4Tensor weight, got {type(w).__name__}")
    if len(tuple(w.shape)) != 2:
        raise ValueError(f"FrozenNVFP4Linear: the weight must be 2-D [N, K], got shape {tuple(w.shape)}")
    if w.recipe.hadamard:
        raise ValueError("FrozenNVFP4Linear: a Hadamard-rotated weight cannot be used in a plain forward")
    if w.recipe.scale == "expert":
        raise ValueError("FrozenNVFP4Linear: per-expert outer scales belong to the MoE layer")
    n, k = tuple(w.shape)
    kp = -(-k // 16) * 16
    if w.data.dtype != torch.uint8 or tuple(w.data.shape) != (n, kp // 2):
        raise ValueError(
            f"FrozenNVFP4Linear: weight.data must be uint8 [{n}, {kp // 2}], got {w.data.dtype} {tuple(w.data.shape)}"
        )
    if w.scale.dtype != torch.float8_e4m3fn or tuple(w.scale.shape) != (n, kp // 16):
        raise ValueError(
            f"FrozenNVFP4Linear: weight.scale must be float8_e4m3fn [{n}, {kp // 16}], got "
            f"{w.scale.dtype} {tuple(w.scale.shape)}"
        )


def _check_finite_scales(scale: torch.Tensor, global_scale: torch.Tensor) -> None:
    bad = torch.isnan(scale.float())
    if bad.any():
        row, col = bad.nonzero()[0].tolist()
        raise ValueError(
            f"FrozenNVFP4Linear: weight.scale has {int(bad.sum())} NaN block scale(s) (e4m3 0x7F), first at "
            f"[{row}, {col}]: the weight held NaN when it was quantized"
        )
    g = global_scale.float()
    if not (torch.isfinite(g).all() and (g > 0).all()):
        raise ValueError(
            f"FrozenNVFP4Linear: the outer (decode) scale must be finite and > 0, got {g.flatten()[:4]}"
        )


def _check_compute_fits(config: NVFP4FrozenConfig, weight_recipe: QuantRecipe, k: int) -> None:
    if k % 16 and config.compute == "w4a4" and not (config.activation.pad and weight_recipe.pad):
        raise ValueError(
            f"FrozenNVFP4Linear: in_features={k} is not a multiple of 16; w4a4 needs pad=True in both recipes"
        )


def base_nbytes(model: nn.Module) -> tuple[int, int]:
    """``(bytes, parameters)`` of the frozen NVFP4 base layers of ``model`` (every tensor they hold)."""
    layers = [m for m in model.modules() if isinstance(m, FrozenNVFP4Linear)]
    return sum(m.nbytes() for m in layers), sum(m.in_features * m.out_features for m in layers)


# ------------------------------------------------------------------------------------------- checkpoints


def load_nvfp4_base(
    model: nn.Module, path, config: NVFP4FrozenConfig | None = None, *, device=None
) -> nn.Module:
    """Load an NVFP4 checkpoint (ModelOpt or compressed-tensors) into ``model`` (in place): every quantized
    ``<module>.weight`` becomes a :class:`FrozenNVFP4Linear` holding the stored bytes; every other tensor is
    loaded into the model as stored. ``model`` is a skeleton of the same architecture (e.g.
    ``AutoModelForCausalLM.from_config(...)``). Raises naming the module or tensor that does not fit."""
    from triage.kernels.nvfp4.export import read_nvfp4_checkpoint

    path = Path(path)
    device = torch.device(device) if device is not None else _model_device(model)
    weights, rest = read_nvfp4_checkpoint(path, device=device)
    modules = {name[: -len(".weight")] for name in weights}
    for m in sorted(modules):
        try:
            old = model.get_submodule(m)
        except AttributeError:
            raise ValueError(
                f"load_nvfp4_base: the checkpoint quantizes {m!r}, which the model does not have"
            ) from None
        w = weights[f"{m}.weight"]
        n, k = tuple(w.shape)
        if (getattr(old, "out_features", None), getattr(old, "in_features", None)) != (n, k):
            raise ValueError(
                f"load_nvfp4_base: {m!r} is {type(old).__name__} "
                f"({getattr(old, 'out_features', '?')}×{getattr(old, 'in_features', '?')}), checkpoint has {n}×{k}"
            )
        bias = rest.pop(f"{m}.bias", None)
        if (bias is None) != (getattr(old, "bias", None) is None):
            raise ValueError(
                f"load_nvfp4_base: {m!r}: the model and the checkpoint disagree on having a bias"
            )
        cfg = config if config is not None else getattr(old, "config", None)
        cfg = cfg if isinstance(cfg, NVFP4FrozenConfig) else None
        if bias is not None:
            bias = bias.to(device, old.bias.dtype)
        frozen = FrozenNVFP4Linear(w, bias, cfg)
        model.set_submodule(m, frozen)
    missing, unexpected = model.load_state_dict({k: v.to(device) for k, v in rest.items()}, strict=False)
    if unexpected:
        raise ValueError(f"load_nvfp4_base: checkpoint tensors the model does not have: {unexpected[:5]}")
    frozen_keys = {f"{m}.{b}" for m in modules for b in (*QUANT_BUFFERS, "bias")}
    tied = _tied_keys(model)
    really_missing = [k for k in missing if k not in frozen_keys and k not in tied]
    if really_missing:
        raise ValueError(f"load_nvfp4_base: model tensors missing from the checkpoint: {really_missing[:5]}")
    return model


def _tied_keys(model: nn.Module) -> set[str]:
    """State-dict names that alias another entry (tied weights: saved once)."""
    seen: dict[int, str] = {}
    tied = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if t is None:
            continue
        key = id(t)
        if key in seen:
            tied.add(name)
        else:
            seen[key] = name
    return tied


def _model_device(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


# ---------------------------------------------------------------------------------------------------
# torch.library custom op: the grad-free forward as one opaque op, for torch.compile
# ---------------------------------------------------------------------------------------------------

@torch.library.custom_op("triage::frozen_nvfp4_linear", mutates_args=(), tags=_tags())
def frozen_nvfp4_linear_op(x: torch.Tensor, layer: torch.Tensor, out_features: int) -> torch.Tensor:
    """``triage::frozen_nvfp4_linear``: the grad-free forward of the ``FrozenNVFP4Linear`` whose op id is
    ``layer`` (its sibling group run at run time, each output its own allocation), what a compiled graph calls
    (a layer's forward under ``torch.compile`` without autograd; with autograd it runs eagerly)."""
    with _op_call():
        return _layer_of(layer, "triage::frozen_nvfp4_linear")._grad_free(x, separate=True)


@frozen_nvfp4_linear_op.register_fake
def _(x, layer, out_features):
    return x.new_empty((*x.shape[:-1], out_features))
