"""NVFP4 dense GEMMs: ``y = a·bᵀ`` for NVFP4 operands (W4A4) and for bf16 × NVFP4 (W4A16).

Math. An NVFP4 operand row holds ``x[k] = q[k]·s[k//16]·g`` with q an E2M1 value, s the e4m3 block
scale and g the fp32 outer (global) scale, one per tensor or one per row. Then

    y[m, n] = g_a[m] · g_b[n] · Σ_k (q_a s_a)[m, k] · (q_b s_b)[n, k]   (+ bias[n])

Every ``q·s`` is exact in fp16 and in bf16 (≤ 6 significant bits, |q·s| ∈ [2⁻¹⁰, 2688]), so each product
``(q_a s_a)(q_b s_b)`` is exact in fp32: the only roundings are the fp32 accumulation, the epilogue
multiplies by the outer scales and the final cast to ``out_dtype``. The outer scales never enter the
bf16/fp16 operands (that would round).

Two regimes on Hopper (see docs/kernels.md for the H200 numbers):

* small M (≤ :data:`SMALL_M`, decode; memory-bound): :func:`~.gemm_decode.launch_decode` streams the packed
  weight once (0.5625 B/param), unpacks it in registers to the exact ``q·s`` and runs a swap-AB tensor-core
  dot against the (few) activation rows; split-K with a deterministic reduction. W4A16 takes it up to
  :data:`W4A16_UNPACK_MAX_M` rows (M in tiles), where unpacking the weight costs less than expanding it.
* large M (training, prefill; compute-bound): no unpacking in the inner loop. The operands' exact
  expansions ``q·s`` (bf16) — ``quantize(..., emit_expanded=torch.bfloat16)`` writes the activation's in
  the same pass as its bytes, :class:`~triage.kernels.linear.NVFP4Linear` caches the weight's — go to a
  stock tensor-core GEMM with fp32 accumulation and the outer scales in its epilogue.

Backends (``backend=``), all computing the formula above:

* ``"triton"`` — small M: the decode kernel; large M: a Triton tensor-core GEMM on the expanded operands
  with the outer scales (per tensor or per row, read on the device: no host sync) and bias fused in its
  epilogue.
* ``"cublas"`` — the expanded operands through cuBLAS with fp32 accumulation. Per-tensor outer scales:
  ``addmm(alpha = RN(g_a·g_b))`` writes ``out_dtype`` directly (cuBLAS scales the fp32 accumulator). The
  alpha must be a host float: free when the recipe fixes the scale (static / checkpoint / none, or
  ``b_scale_host`` for a cached weight), otherwise ONE device→host read of the activation's scale (a sync).
  Per-row scales: fp32-output matmul + a torch epilogue. A plan built with ``host_scales=False``
  (:func:`gemm_plan`) takes the alpha route only for two recipe-given scales, else that fp32-output route
  (``"auto"``: the ``"triton"`` GEMM).
* ``"fused"`` — one Triton kernel that unpacks both packed operands in registers (no expansion); exact,
  slow at large M (kept as a baseline and for tests of the unpack path).
* ``"dot_scaled"`` — Blackwell (sm_100+) native block-scaled MMA; untested on hardware.
* ``"reference"`` — the torch twin: dequantize, fp64 matmul (any device; slow).
* ``"auto"`` — reference on CPU (unless the Triton interpreter is on), else ``dot_scaled`` on
  sm_100+, else ``triton`` for M ≤ SMALL_M and :data:`LARGE_M_BACKEND` otherwise (picked by measurement:
  ``experiments/bench/bench_gemm.py``).

Epilogue rounding: ``triton``/``fused``/fp32-``cublas`` compute ``((acc·g_a)·g_b) + bias`` in fp32;
``cublas`` with alpha computes ``RN(g_a·g_b)·acc + bias`` (cuBLAS's fp32 epilogue). Both are one fp32
rounding away from the exact value before the final cast.

Operands are duck-typed against the ``NVFP4Tensor`` contract: ``data`` uint8 [..., K/2] (element 2i in
the low nibble), ``scale`` float8_e4m3fn [..., K/16] linear, ``global_scale`` fp32 (1 element, or one per
row shaped [rows, 1]), ``recipe``, ``shape``, ``dtype``, optional ``expanded``. Leading dims of ``a`` (and
of ``x`` for W4A16) are flattened into M; ``b`` (the weight) is 2-D [N, K].
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .format import e2m1_decode

__all__ = [
    "LARGE_M_BACKEND",
    "SMALL_M",
    "W4A16_UNPACK_MAX_M",
    "GemmPlan",
    "decode_route",
    "expand",
    "gemm",
    "gemm_plan",
    "gemm_reference",
    "gemm_w4a16",
    "gemm_w4a16_reference",
]

#: Default backend for M > SMALL_M on Hopper, from the H200 measurement in docs/kernels.md: cuBLAS with the
#: per-tensor scales as alpha (1.00-1.09x bf16). Per-row scales cannot ride on alpha: ``auto`` sends them to
#: the Triton GEMM on expansions (scales in its epilogue) rather than an fp32-output matmul, and so it does
#: a dynamic per-tensor activation scale on sm_90+ (:data:`SYNC_FREE_MAX_FLOP_TMA`).
LARGE_M_BACKEND = "cublas"
#: Up to this many rows the memory-bound decode tiling is used.
SMALL_M = 64
#: Up to this many rows :func:`gemm_w4a16` (``triton`` / ``auto``) runs the decode kernel, which unpacks the
#: packed weight in registers (above :data:`SMALL_M` in tiles of ``gemm_decode.DECODE_CONFIG_MID``), instead
#: of expanding the weight to bf16 for the dense GEMM: over a Qwen3-4B layer's seven GEMMs 14 % less time at
#: 128 rows and 6 % at 256, 28 % more at 512 (H100, docs/benchmarks.md, "W4A16 and the dense GEMM at prefill
#: rows").
W4A16_UNPACK_MAX_M = 256

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_BACKENDS = ("auto", "triton", "cublas", "fused", "dot_scaled", "reference")


# ---------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------


def operand_k(t, name: str) -> int:
    """Validate an NVFP4 operand; return its logical K (``data``/``scale`` cover K padded to 16)."""
    for attr in ("data", "scale", "global_scale", "shape"):
        if not hasattr(t, attr):
            raise TypeError(f"{name} must be an NVFP4Tensor (no attribute {attr!r}), got {type(t).__name__}")
    shape = tuple(t.shape)
    if len(shape) < 1:
        raise ValueError(f"{name} must have at least 1 dimension, got shape {shape}")
    K = shape[-1]
    if K % 16 and not getattr(getattr(t, "recipe", None), "pad", False):
        raise ValueError(f"{name}: K={K} is not a multiple of 16 (the NVFP4 block size) and is not padded")
    Kp = -(-K // 16) * 16
    if t.data.dtype != torch.uint8 or tuple(t.data.shape) != shape[:-1] + (Kp // 2,):
        raise ValueError(
            f"{name}.data must be uint8 of shape {shape[:-1] + (Kp // 2,)}, got {t.data.dtype} {tuple(t.data.shape)}"
        )
    if t.scale.dtype != torch.float8_e4m3fn or tuple(t.scale.shape) != shape[:-1] + (Kp // 16,):
        raise ValueError(
            f"{name}.scale must be float8_e4m3fn of shape {shape[:-1] + (Kp // 16,)} (linear layout), "
            f"got {t.scale.dtype} {tuple(t.scale.shape)}"
        )
    if t.scale.device != t.data.device:
        raise ValueError(f"{name}.scale is on {t.scale.device} but {name}.data is on {t.data.device}")
    return K


def padded_k(K: int) -> int:
    """K rounded up to the NVFP4 block (16): the width ``data`` / ``scale`` cover."""
    return -(-K // 16) * 16


def _rows(shape) -> int:
    return math.prod(tuple(shape)[:-1])


def _outer_scale(t, name: str) -> torch.Tensor:
    """The decode outer scale as fp32: 1 element (per tensor) or a [rows] vector (per row)."""
    g = t.global_scale
    if getattr(getattr(t, "recipe", None), "scale", None) == "expert":
        raise ValueError(f"{name} has a per-expert outer scale: use the grouped GEMM, not the dense one")
    if not isinstance(g, torch.Tensor):
        g = torch.tensor(float(g), dtype=torch.float32, device=t.data.device)
    rows = _rows(t.shape)
    if g.numel() == 1:
        return g.reshape(1).float()
    if g.numel() == rows and g.shape[-1:] in (torch.Size([1]), torch.Size([rows])):
        return g.reshape(rows).float()
    raise ValueError(
        f"{name}.global_scale has shape {tuple(g.shape)}: the dense GEMM takes a per-tensor (1 element) or "
        f"per-row ([{rows}, 1]) outer scale; per-expert scales belong to the grouped GEMM"
    )


def hadamard_of(t) -> object:
    """The Hadamard transform ``t``'s recipe applied, or None."""
    recipe = getattr(t, "recipe", None)
    h = getattr(recipe, "hadamard", None)
    return h if h not in (False, 0, "none") else None


def check_same_transform(a, b, name_a: str, name_b: str) -> None:
    """Both operands went through the Hadamard transform, or neither (``a·bᵀ = (aH)·(bH)ᵀ`` needs both)."""
    ha, hb = hadamard_of(a), hadamard_of(b)
    if (ha is None) != (hb is None):
        raise ValueError(
            "recipes do not fit: exactly one operand went through the Hadamard transform "
            f"({name_a}: {ha!r}, {name_b}: {hb!r}); {name_a}·{name_b}ᵀ is only preserved when both did (H·Hᵀ = I)"
        )


def _check_pair(a, b, bias, out_dtype, reference: bool = False) -> tuple[int, int, int]:
    Ka = operand_k(a, "a")
    Kb = operand_k(b, "b")
    if len(tuple(b.shape)) != 2:
        raise ValueError(f"b (the weight) must be 2-D [N, K], got shape {tuple(b.shape)}")
    if Ka != Kb:
        raise ValueError(f"reduction dims differ: a has K={Ka}, b has K={Kb}")
    if a.data.device != b.data.device:
        raise ValueError(f"a is on {a.data.device} but b is on {b.data.device}")
    check_same_transform(a, b, "a", "b")
    N = b.shape[0]
    _check_out(out_dtype, bias, N, b.data.device, reference)
    return _rows(a.shape), N, Ka


def _check_out(out_dtype, bias, N, device, reference: bool = False) -> None:
    if out_dtype not in _OUT_DTYPES + ((torch.float64,) if reference else ()):
        raise ValueError(f"out_dtype must be one of {_OUT_DTYPES}, got {out_dtype}")
    if bias is not None:
        if tuple(bias.shape) != (N,):
            raise ValueError(f"bias must have shape ({N},), got {tuple(bias.shape)}")
        if bias.device != device:
            raise ValueError(f"bias is on {bias.device} but the operands are on {device}")


# ---------------------------------------------------------------------------------------------------
# Torch references
# ---------------------------------------------------------------------------------------------------


def _dequantize64(t, crop: bool = True) -> torch.Tensor:
    """fp64 ``q·s·g`` of an operand as [rows, K] (exact up to the fp64 product with g).

    ``crop=False`` keeps the padded columns [rows, Kp]: after a Hadamard transform they are not zero, and
    a W4A4 product of two padded operands contracts over all Kp columns (that is what preserves a·bᵀ).
    """
    K = t.shape[-1]
    Kp = padded_k(K)
    data = t.data.reshape(-1, Kp // 2)
    codes = torch.stack([data & 0xF, data >> 4], dim=-1).reshape(-1, Kp).long()
    q = e2m1_decode(codes).double()
    s = t.scale.reshape(-1, Kp // 16).double().repeat_interleave(16, dim=1)
    g = _outer_scale(t, "operand").double()
    v = q * s * (g if g.numel() == 1 else g[:, None])
    return v[:, :K] if crop else v


def gemm_reference(a, b, *, out_dtype=torch.bfloat16, bias=None) -> torch.Tensor:
    """Torch twin of :func:`gemm`: dequantize both operands, fp64 matmul, add bias, cast (fp64 allowed)."""
    M, N, K = _check_pair(a, b, bias, out_dtype, reference=True)
    y = _dequantize64(a, crop=False) @ _dequantize64(b, crop=False).T
    if bias is not None:
        y = y + bias.double()
    return y.to(out_dtype).reshape(*tuple(a.shape)[:-1], N)


def gemm_w4a16_reference(x: torch.Tensor, w, *, out_dtype=None, bias=None) -> torch.Tensor:
    """Torch twin of :func:`gemm_w4a16`: ``x·dequantize(w)ᵀ`` in fp64, add bias, cast."""
    M, N, K = _check_w4a16(x, w, bias, out_dtype, reference=True)
    y = x.reshape(M, K).double() @ _dequantize64(w).T
    if bias is not None:
        y = y + bias.double()
    return y.to(out_dtype or x.dtype).reshape(*x.shape[:-1], N)


# ---------------------------------------------------------------------------------------------------
# Public GEMMs
# ---------------------------------------------------------------------------------------------------


def _gpu_ready(device: torch.device) -> bool:
    from triage.kernels.nvfp4.device import triton_runs_on

    return triton_runs_on(device)


def _pick(backend: str, M: int, device: torch.device) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "reference":
        return backend
    if not _gpu_ready(device):
        if backend == "auto":
            return "reference"
        raise ValueError(
            f"backend {backend!r} needs a CUDA tensor (or TRITON_INTERPRET=1); operands are on {device}"
        )
    if backend != "auto":
        return backend
    if device.type == "cuda" and _major(device) >= 10:
        return "dot_scaled"
    return "triton" if M <= SMALL_M else LARGE_M_BACKEND


#: Compute capability major version by CUDA device index (read once per device: every GEMM call picks its
#: backend by it).
_MAJOR: dict[int, int] = {}


def _major(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    major = _MAJOR.get(index)
    if major is None:
        major = _MAJOR[index] = torch.cuda.get_device_capability(index)[0]
    return major


def decode_route(backend: str, M: int, device: torch.device, weight_only: bool = False) -> bool:
    """Whether :func:`gemm` (``weight_only``: :func:`gemm_w4a16`) with ``backend`` and M rows of ``a`` on
    ``device`` runs the decode kernel, which reads ``a`` as its exact fp16 ``q·s`` (W4A4): a quantizer that
    writes that expansion with the codes (``emit_expanded=torch.float16``) saves the GEMM its own expansion
    pass."""
    if not _gpu_ready(device):
        return False
    which = _pick_w4a16(backend, M, device) if weight_only else _pick(backend, M, device)
    return _decode(which, M, weight_only)


def _pick_w4a16(backend: str, M: int, device: torch.device) -> str:
    """:func:`_pick` for :func:`gemm_w4a16`: no bf16-operand form of ``dot_scaled`` (Triton instead), and
    ``auto`` runs the decode kernel up to :data:`W4A16_UNPACK_MAX_M` rows."""
    which = _pick(backend, M, device)
    if which == "dot_scaled" or (backend == "auto" and which != "reference" and M <= W4A16_UNPACK_MAX_M):
        return "triton"
    return which


def _decode(which: str, M: int, weight_only: bool = False) -> bool:
    """Whether the backend ``which`` (:func:`_pick`'s) runs a GEMM of M rows on the decode kernel."""
    return which == "triton" and M <= (W4A16_UNPACK_MAX_M if weight_only else SMALL_M)


def expand(t, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Exact dense ``q·s`` of an NVFP4 operand (outer scale NOT applied) as [..., Kp] of ``dtype``.

    Kp is K rounded up to 16 (padding columns are zero). ``dtype`` bf16 or fp16 (both hold every ``q·s``
    exactly) or fp32. Returns ``t.expanded`` when the quantizer already wrote it in ``dtype``; otherwise a
    bandwidth-bound Triton kernel on CUDA or under the interpreter, torch elsewhere.
    """
    K = padded_k(operand_k(t, "t"))
    if dtype not in _OUT_DTYPES:
        raise ValueError(f"dtype must be one of {_OUT_DTYPES}, got {dtype}")
    cached = getattr(t, "expanded", None)
    if cached is not None and cached.dtype == dtype and tuple(cached.shape) == tuple(t.shape)[:-1] + (K,):
        return cached
    out = _expand(t.data.reshape(-1, K // 2), t.scale.reshape(-1, K // 16), K, dtype)
    return out.reshape(*tuple(t.shape)[:-1], K)


def _expand(data: torch.Tensor, scale: torch.Tensor, K: int, dtype: torch.dtype) -> torch.Tensor:
    """:func:`expand` of checked 2-D codes ``data`` [rows, K/2] and block scales ``scale`` [rows, K/16] (K
    padded to 16) → [rows, K] of ``dtype``."""
    if _gpu_ready(data.device):
        from triage.kernels.nvfp4.dequantize_rows import expand_triton

        return expand_triton(data, scale, K, dtype)
    codes = torch.stack([data & 0xF, data >> 4], dim=-1).reshape(-1, K).long()
    q = e2m1_decode(codes)
    return (q * scale.float().repeat_interleave(16, dim=1)).to(dtype)


#: Largest GEMM (2·M·N·K) for which ``backend="auto"`` prefers the sync-free Triton GEMM over cuBLAS when
#: the activation's per-tensor scale is dynamic (only on the device), on GPUs that cannot run the Triton
#: GEMM's TMA kernel (``gemm_dense.tma_supported``: before sm_90, or without its shared memory): above it
#: the GEMM hides the sync. Where that kernel runs the limit is :data:`SYNC_FREE_MAX_FLOP_TMA`: it runs at
#: cuBLAS's speed (docs/benchmarks.md, "W4A4 GEMM forward"), so a dynamic scale never costs a sync (and the
#: GEMM can be captured in a CUDA graph).
SYNC_FREE_MAX_FLOP = 2.5e11
SYNC_FREE_MAX_FLOP_TMA = float("inf")


def _host_known(t) -> bool:
    """Whether ``t``'s outer scale is known on the host without a device read (see host_decode_scale)."""
    recipe = getattr(t, "recipe", None)
    return recipe is not None and (recipe.scale == "none" or recipe.scale_source != "dynamic")


def _host_scale(t, given) -> float:
    """``given`` (a float, or a callable returning it: e.g. a weight cache that reads the device once per
    weight update, only when a cuBLAS path needs it), else :func:`host_decode_scale`."""
    if given is None:
        return host_decode_scale(t)
    return float(given()) if callable(given) else float(given)


def host_decode_scale(t) -> float:
    """The per-tensor outer decode scale of ``t`` as a Python float. Free (no device sync) when the recipe
    fixes it (``scale="none"``, static or checkpoint source: the quantizer's own host computation);
    otherwise one device→host read."""
    if _host_known(t):
        from triage.kernels.nvfp4.device import given_outer

        return given_outer(t.recipe)[1]
    return float(t.global_scale.reshape(-1)[0])


@contextlib.contextmanager
def _fp32_reduction():
    """cuBLAS must accumulate in fp32 end to end (no reduced-precision split-K reduction)."""
    m = torch.backends.cuda.matmul
    old = (m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction)
    m.allow_bf16_reduced_precision_reduction = m.allow_fp16_reduced_precision_reduction = False
    try:
        yield
    finally:
        m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction = old


def _alpha_mm(x: torch.Tensor, w: torch.Tensor, alpha: float, bias, out: torch.Tensor) -> None:
    """``out = RN(alpha·(x·wᵀ) + bias)`` with fp32 accumulation: cuBLAS's epilogue on CUDA."""
    if x.device.type != "cuda":
        y = torch.mm(x.float(), w.float().T) * alpha
        out.copy_(y + bias.float() if bias is not None else y)
        return
    with _fp32_reduction():
        if out.dtype == x.dtype:
            if bias is None:  # beta = 0: ``out``'s old contents are never read
                torch.addmm(out, x, w.T, beta=0, alpha=alpha, out=out)
            elif bias.dtype == out.dtype:
                torch.addmm(bias, x, w.T, alpha=alpha, out=out)
            else:
                out.copy_(torch.mm(x, w.T, out_dtype=torch.float32).mul_(alpha).add_(bias.float()))
        else:  # fp32 (or another) output: fp32 matmul output, then the epilogue
            y = torch.mm(x, w.T, out_dtype=torch.float32).mul_(alpha)
            out.copy_(y.add_(bias.float()) if bias is not None else y)


def _with_device_nan(bias, scales: list, n: int, dtype: torch.dtype):
    """``bias + 0·g`` for each device outer scale ``g`` whose alpha came from the recipe (host-known): a NaN
    put there by a layer's non-finite rule (:func:`~triage.kernels.linear.nan_if_nonfinite`) still reaches
    every output; the bias is unchanged otherwise (a zero bias when there is none)."""
    if not scales:
        return bias
    nan = sum(g.reshape(()) * 0 for g in scales)
    if bias is None:
        return nan.to(dtype).expand(n)
    return (bias.float() + nan).to(bias.dtype)


def _scaled_epilogue(acc32: torch.Tensor, g_a, g_b, bias, out_dtype) -> torch.Tensor:
    y = acc32 * (g_a if g_a.numel() == 1 else g_a[:, None])
    y = y * (g_b if g_b.numel() == 1 else g_b[None, :])
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def _mm_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x[M,K]·w[N,K]ᵀ with fp32 accumulation AND fp32 output (no rounding of the sum to bf16)."""
    if x.device.type == "cuda":
        return torch.mm(x, w.T, out_dtype=torch.float32)
    return torch.mm(x.float(), w.float().T)


def gemm(
    a,
    b,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
    backend: str = "auto",
    b_expanded: torch.Tensor | None = None,
    b_scale_host: float | Callable[[], float] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """W4A4 ``y = a·bᵀ (+ bias)`` for NVFP4 operands a [..., K] and b [N, K]; returns [..., N].

    fp32 accumulation, outer scales in the epilogue (see the module docstring for the exactness
    argument). ``b_expanded``: an optional cached :func:`expand` of ``b`` (bf16 [N, Kp]) for the large-M
    backends (``a.expanded``, if the quantizer wrote it, is used the same way). ``b_scale_host``: b's
    per-tensor decode scale as a Python float (saves the ``cublas`` path a device read). ``out``:
    optional [M, N] buffer (M = rows of a) of ``out_dtype`` to write into.

    Checks, backend choice and tiles are a :class:`GemmPlan`, built once per operand signature
    (:func:`gemm_plan`); a call looks it up and runs it.
    """
    plan = gemm_plan(
        a, b, out_dtype=out_dtype, bias=bias, backend=backend, b_expanded=b_expanded, b_scale_host=b_scale_host
    )
    return plan.run(a, b, bias=bias, b_expanded=b_expanded, b_scale_host=b_scale_host, out=out)


#: Operand signatures (:func:`_gemm_key`) whose :class:`GemmPlan` is kept (oldest dropped first).
GEMM_PLANS_KEPT = 256
_GEMM_PLANS: dict[tuple, GemmPlan] = {}


def _operand_key(t) -> tuple:
    """Everything :func:`operand_k` / :func:`_outer_scale` / :func:`expand` look at in an operand."""
    g, e = t.global_scale, getattr(t, "expanded", None)
    return (
        type(t), tuple(t.shape), getattr(t, "recipe", None),
        t.data.shape, t.data.dtype, t.data.device, t.scale.shape, t.scale.dtype, t.scale.device,
        (g.shape, g.dtype, g.device) if isinstance(g, torch.Tensor) else type(g),
        None if e is None else (e.shape, e.dtype),
    )  # fmt: skip


def _gemm_key(a, b, out_dtype, bias, backend, b_expanded, b_scale_host, host_scales) -> tuple:
    """The signature a :class:`GemmPlan` serves: both operands' :func:`_operand_key`, the bias's shape,
    dtype and device, ``out_dtype``, ``backend``, ``b_expanded``'s shape and dtype, whether ``b_scale_host``
    is given, ``host_scales`` and :func:`~.device.interpreting` (it picks the tiles)."""
    from triage.kernels.nvfp4.device import interpreting

    return (
        _operand_key(a), _operand_key(b), out_dtype, backend,
        None if bias is None else (bias.shape, bias.dtype, bias.device),
        None if b_expanded is None else (b_expanded.shape, b_expanded.dtype),
        b_scale_host is None, host_scales, interpreting(),
    )  # fmt: skip


def gemm_plan(
    a,
    b,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
    backend: str = "auto",
    b_expanded: torch.Tensor | None = None,
    b_scale_host: float | Callable[[], float] | None = None,
    host_scales: bool = True,
) -> GemmPlan:
    """The :class:`GemmPlan` of ``gemm(a, b, ...)`` for these operands' signature (:func:`_gemm_key`):
    looked up, or built (after every check :func:`gemm` makes, so bad input raises here, naming the
    operand) and kept for the last :data:`GEMM_PLANS_KEPT` signatures.

    ``host_scales=False``: the plan never reads an outer scale to the host (no sync, nothing derived from
    device data: a CUDA graph can capture its run). The cuBLAS ``alpha`` route is then taken only when both
    outer scales are recipe-given; otherwise ``"auto"`` runs the Triton GEMM (scales in its epilogue) and
    ``"cublas"`` the fp32-output cuBLAS GEMM with the scales applied on the device (route ``"scaled"``).
    ``b_scale_host`` must then be None."""
    if not host_scales and b_scale_host is not None:
        raise ValueError("gemm_plan: host_scales=False reads no scale on the host; b_scale_host must be None")
    try:
        key = _gemm_key(a, b, out_dtype, bias, backend, b_expanded, b_scale_host, host_scales)
        plan = _GEMM_PLANS.get(key)
    except (AttributeError, TypeError):  # not NVFP4 operands (the checks below say which) or unhashable
        key = plan = None
    if plan is None:
        plan = _build_gemm_plan(a, b, out_dtype, bias, backend, b_expanded, b_scale_host, host_scales)
        if key is not None:
            if len(_GEMM_PLANS) >= GEMM_PLANS_KEPT:
                _GEMM_PLANS.pop(next(iter(_GEMM_PLANS)))
            _GEMM_PLANS[key] = plan
    return plan


def _fp32_product(x: float, y: float) -> float:
    """``RN_fp32(RN_fp32(x)·RN_fp32(y))`` as a Python float (cuBLAS's alpha ``RN(g_a·g_b)``)."""
    return float(np.float32(x) * np.float32(y))


@dataclass(frozen=True)
class GemmPlan:
    """What :func:`gemm` derives from its operands' signature alone: the checks, M/N/K, the backend route
    and the kernel tiles, the recipe-given (host-known) outer scales. Built by :func:`gemm_plan`; a call
    (:meth:`run`) then only reshapes, allocates and launches.

    ``route``: ``"reference"``, ``"dot_scaled"``, ``"fused"``, ``"decode"`` (the decode kernel on the
    packed weight), ``"dense"`` (Triton GEMM on the expansions), ``"alpha"`` (cuBLAS, per-tensor scales
    as ``alpha``) or ``"scaled"`` (cuBLAS fp32 output, outer scales in a torch epilogue)."""

    M: int
    N: int
    K: int  # padded to 16: both operands carry the same zero padding
    lead: tuple
    out_dtype: torch.dtype
    device: torch.device
    route: str
    launch: object  # the Triton kernel's launch plan (decode: DecodeLaunch; dense, fused: DenseLaunch) or None
    ga_len: int  # 1 (per tensor) or M (per row)
    gb_len: int  # 1 or N
    a_cached: torch.dtype | None  # the dtype of a.expanded where it has the expansion's shape, else None
    a_host: float | None  # a's outer scale from its recipe (alpha route), else read per call
    b_host: float | None  # b's, when b_scale_host is not given
    nan_a: bool  # alpha from the recipe: a device NaN (non-finite rule) rides on the bias
    nan_b: bool

    def run(self, a, b, *, bias=None, b_expanded=None, b_scale_host=None, out=None) -> torch.Tensor:
        """``gemm(a, b, ...)`` for operands of the planned signature (unchecked: use :func:`gemm` for
        anything else)."""
        M, N, K = self.M, self.N, self.K
        out = _out_buffer(out, M, N, self.out_dtype, self.device)
        route = self.route
        if route == "reference":
            out.copy_(gemm_reference(a, b, out_dtype=self.out_dtype, bias=bias).reshape(M, N))
            return out.reshape(*self.lead, N)
        if route in ("alpha", "scaled"):  # torch ops broadcast them: [1] or [M] / [N]
            g_a, g_b = _scale_vector(a, self.ga_len), _scale_vector(b, self.gb_len)
        else:  # a Triton kernel reads the scales as flat fp32 storage (1 or M / N elements)
            g_a, g_b = _kernel_scale(a, self.ga_len), _kernel_scale(b, self.gb_len)
        if route == "decode":  # stream the packed weight
            xa = self._a_expanded(a, torch.float16)
            self.launch.run(xa, b.data, b.scale, out, g_a, g_b, bias)
        elif route in ("dot_scaled", "fused"):
            a_data, a_scale = a.data.reshape(M, K // 2), a.scale.reshape(M, K // 16)
            if route == "dot_scaled":
                from triage.kernels.nvfp4 import gemm_dense

                gemm_dense.launch_dot_scaled(a_data, a_scale, b.data, b.scale, K, out, g_a, g_b, bias)
            else:
                self.launch.run(a_data, a_scale, b.data, b.scale, out, g_a, g_b, bias)
        else:
            xa = self._a_expanded(a, torch.bfloat16)
            wb = b_expanded if b_expanded is not None else expand(b)
            if route == "dense":
                self.launch.run(xa, None, wb, None, out, g_a, g_b, bias)
            elif route == "alpha":  # cuBLAS, scales folded into alpha
                ha = self.a_host if self.a_host is not None else float(a.global_scale.reshape(-1)[0])
                hb = self.b_host if self.b_host is not None else _host_scale(b, b_scale_host)
                fixed = ([g_a] if self.nan_a else []) + ([g_b] if self.nan_b else [])
                _alpha_mm(xa, wb, _fp32_product(ha, hb), _with_device_nan(bias, fixed, N, self.out_dtype), out)
            else:
                with _fp32_reduction():
                    out.copy_(_scaled_epilogue(_mm_fp32(xa, wb), g_a, g_b, bias, self.out_dtype))
        return out if len(self.lead) == 1 else out.reshape(*self.lead, N)

    def decode_activation(self, a) -> tuple | None:
        """What :meth:`run` hands the decode kernel for the activation ``a``: ``(a as the kernel reads it (its
        fp16 expansion [M, K]), a's outer scale as the kernel reads it, a)`` (sibling layers,
        :mod:`triage.kernels.siblings`); None unless the route is ``"decode"``."""
        if self.route != "decode":
            return None
        return self._a_expanded(a, torch.float16), _kernel_scale(a, self.ga_len), a

    def _a_expanded(self, a, dtype: torch.dtype) -> torch.Tensor:
        """:func:`expand` of ``a`` as [M, K]: ``a.expanded`` when it is in ``dtype``."""
        M, K = self.M, self.K
        if self.a_cached == dtype:
            e = a.expanded
            return e if e.dim() == 2 else e.reshape(M, K)
        return _expand(a.data.reshape(M, K // 2), a.scale.reshape(M, K // 16), K, dtype)


def _kernel_scale(t, n: int) -> torch.Tensor:
    """The outer scale of a checked operand as a Triton kernel reads it (fp32, contiguous, 1 or ``n``
    elements in row order, any shape): ``t.global_scale`` itself when it is one, else :func:`_scale_vector`."""
    g = t.global_scale
    if isinstance(g, torch.Tensor) and g.dtype == torch.float32 and g.is_contiguous():
        return g
    return _scale_vector(t, n)


def _scale_vector(t, n: int) -> torch.Tensor:
    """:func:`_outer_scale` of an operand whose signature was checked: fp32 [1] or [n]."""
    g = t.global_scale
    if not isinstance(g, torch.Tensor):
        return torch.tensor(float(g), dtype=torch.float32, device=t.data.device).reshape(1)
    return g.reshape(n).float()


def _build_gemm_plan(a, b, out_dtype, bias, backend, b_expanded, b_scale_host, host_scales) -> GemmPlan:
    M, N, K = _check_pair(a, b, bias, out_dtype)
    K = padded_k(K)
    device = a.data.device
    ga, gb = _outer_scale(a, "a"), _outer_scale(b, "b")  # checks their shapes
    which = _pick(backend, M, device)
    per_tensor = ga.numel() == 1 and gb.numel() == 1
    route, launch = which, None
    if _decode(which, M):
        from triage.kernels.nvfp4.gemm_decode import decode_launch

        route, launch = "decode", decode_launch(M, N, K, K // 16, torch.float16, out_dtype)
    elif which in ("triton", "cublas"):
        if which == "cublas" and backend == "auto" and device.type == "cuda":
            # cuBLAS takes the outer scales as a host alpha: a dynamic per-tensor activation scale costs a
            # device->host read (a sync that stalls the launch queue). Below SYNC_FREE_MAX_FLOP (any size on
            # sm_90+) the Triton GEMM (scales read on the device) wins; per-row/per-expert scales always go there.
            needs_sync = per_tensor and not _host_known(a)
            from triage.kernels.nvfp4.gemm_dense import tma_supported

            limit = SYNC_FREE_MAX_FLOP_TMA if tma_supported(device.index) else SYNC_FREE_MAX_FLOP
            if not per_tensor or (needs_sync and 2.0 * M * N * K < limit):
                which = "triton"
        route = "dense" if which == "triton" else ("alpha" if per_tensor else "scaled")
        if route == "alpha" and not host_scales and not (_host_known(a) and _host_known(b)):
            route = "dense" if backend == "auto" else "scaled"
    if route in ("dense", "fused"):
        from triage.kernels.nvfp4.gemm_dense import dense_launch

        if route == "fused":
            launch = dense_launch(M, N, K, torch.uint8, True, torch.uint8, True, out_dtype)
        else:
            b_dtype = torch.bfloat16 if b_expanded is None else b_expanded.dtype
            launch = dense_launch(M, N, K, torch.bfloat16, False, b_dtype, False, out_dtype)
    a_exp = getattr(a, "expanded", None)
    a_cached = a_exp.dtype if a_exp is not None and tuple(a_exp.shape) == (*tuple(a.shape)[:-1], K) else None
    a_host = b_host = None
    if route == "alpha":
        a_host = host_decode_scale(a) if _host_known(a) else None
        b_host = host_decode_scale(b) if b_scale_host is None and _host_known(b) else None
    return GemmPlan(
        M=M, N=N, K=K, lead=tuple(a.shape)[:-1], out_dtype=out_dtype, device=device, route=route,
        launch=launch, ga_len=ga.numel(), gb_len=gb.numel(),
        a_cached=a_cached,
        a_host=a_host, b_host=b_host, nan_a=_host_known(a),
        nan_b=_host_known(b) and b_scale_host is None,
    )  # fmt: skip


def _out_buffer(out, M: int, N: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty((M, N), device=device, dtype=dtype)
    if tuple(out.shape) != (M, N) or out.dtype != dtype or out.device != device:
        raise ValueError(
            f"out must be a {dtype} [{M}, {N}] tensor on {device}, got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    return out


def _check_w4a16(x: torch.Tensor, w, bias, out_dtype, reference: bool = False) -> tuple[int, int, int]:
    K = operand_k(w, "w")
    if len(tuple(w.shape)) != 2:
        raise ValueError(f"w (the weight) must be 2-D [N, K], got shape {tuple(w.shape)}")
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"x must be a tensor [..., {K}], got {getattr(x, 'shape', type(x))}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"x must be bf16 or fp16 (W4A16), got {x.dtype}")
    if x.device != w.data.device:
        raise ValueError(f"x is on {x.device} but w is on {w.data.device}")
    if hadamard_of(w) is not None:
        raise ValueError("recipes do not fit: w went through the Hadamard transform, x did not")
    _check_out(out_dtype or x.dtype, bias, w.shape[0], x.device, reference)
    return _rows(x.shape), w.shape[0], K


def gemm_w4a16(
    x: torch.Tensor,
    w,
    *,
    out_dtype: torch.dtype | None = None,
    bias: torch.Tensor | None = None,
    backend: str = "auto",
    w_expanded: torch.Tensor | None = None,
    w_scale_host: float | Callable[[], float] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weight-only ``y = x·wᵀ (+ bias)``: x bf16/fp16 [..., K], w NVFP4 [N, K]; returns [..., N].

    The weight's exact ``q·s`` (in x's dtype) meets x on the tensor cores, the products are exact in fp32,
    the accumulation is fp32 and w's outer scale is applied in the epilogue. ``out_dtype`` defaults to
    x's dtype. Backends: ``triton`` (the decode kernel up to :data:`W4A16_UNPACK_MAX_M` rows, which reads the
    packed weight and not ``w_expanded``; the Triton GEMM on the expanded weight above), ``cublas`` (expanded
    weight; ``w_expanded`` [N, Kp] in x's dtype may be cached), ``fused`` or ``reference``; ``auto``: as
    ``triton`` up to :data:`W4A16_UNPACK_MAX_M` rows, above as in :func:`gemm` (cuBLAS with ``alpha`` for a
    per-tensor outer scale, the Triton GEMM for per-row ones).
    """
    M, N, K = _check_w4a16(x, w, bias, out_dtype)
    out_dtype = out_dtype or x.dtype
    which = _pick_w4a16(backend, M, x.device)
    out = _out_buffer(out, M, N, out_dtype, x.device)
    if which == "reference":
        out.copy_(gemm_w4a16_reference(x, w, out_dtype=out_dtype, bias=bias).reshape(M, N))
        return out.reshape(*x.shape[:-1], N)
    g_w = _outer_scale(w, "w")
    x2 = x.reshape(M, K)
    from triage.kernels.nvfp4 import gemm_decode, gemm_dense

    if which == "fused":
        gemm_dense.launch_gemm(x2, None, w.data, w.scale, K, out, None, g_w, bias)
    elif _decode(which, M, weight_only=True):
        gemm_decode.launch_decode(x2, w.data, w.scale, K, out, None, g_w, bias)
    else:
        wx = (w_expanded if w_expanded is not None else expand(w, x.dtype))[:, :K]
        if which == "cublas" and backend == "auto" and g_w.numel() != 1 and x.device.type == "cuda":
            which = "triton"
        if which == "triton":
            gemm_dense.launch_gemm(x2, None, wx, None, K, out, None, g_w, bias)
        elif g_w.numel() == 1:
            _alpha_mm(x2, wx, _host_scale(w, w_scale_host), bias, out)
        else:
            with _fp32_reduction():
                out.copy_(_scaled_epilogue(_mm_fp32(x2, wx), g_w.new_ones(1), g_w, bias, out_dtype))
    return out.reshape(*x.shape[:-1], N)
