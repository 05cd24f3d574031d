"""Per-token log-probabilities (and entropies) of an LM head, computed in vocabulary chunks.

For hidden states ``h`` [..., H], an LM-head weight ``W`` [V, H], targets ``y`` [...] and a temperature T:

    z = h · Wᵀ / T,    log p(y) = z_y − logsumexp(z),    H(p) = −Σ_j p_j log p_j   (optional).

``token_logprobs`` never materialises the [N, V] logits: the vocabulary is walked in chunks of C columns;
each chunk's raw logits come from a stock tensor-core GEMM (fp32 output, or the input dtype with
``logits_dtype``) written into a reused chunk buffer and are folded into a running (max, Σexp, Σexp·z) state
by an online-logsumexp epilogue (Triton on GPU or under ``TRITON_INTERPRET=1``, its pure-torch twin on CPU;
see ``logprob_triton``). The backward recomputes each chunk's logits (except the chunk(s) the forward kept),
overwrites them in place with ∂L/∂logits in the input dtype (one epilogue pass), accumulates
``dh += dlogits_c · W_c`` (fp32) and writes ``dW_c = dlogits_cᵀ · h`` straight into the gradient. Peak extra
memory is one [N, C] chunk buffer plus an [N, H] fp32 accumulator, instead of [N, V] fp32 logits.

Rules: targets must lie in [0, V) (a ``ValueError`` names the first bad position); hidden and weight share
one floating dtype; a non-finite result (NaN/Inf in the inputs, or overflowing logits) raises a
``ValueError`` naming the first affected position (``validate=False`` skips both checks and their host sync).
Outputs are fp32; gradients come back in the input dtypes.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Literal, NamedTuple

import torch

Backend = Literal["auto", "triton", "torch"]
_CHUNK_BYTES = 2**30  # bytes of the logits chunk buffer(s) (automatic chunk size)


def token_logprobs_reference(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    target_ids: torch.Tensor,
    temperature: float = 1.0,
    entropy: bool = False,
    compute_dtype: torch.dtype = torch.float32,
    logits_dtype: torch.dtype | None = None,
):
    """Eager reference: ``log_softmax(h·Wᵀ/T).gather(y)`` in ``compute_dtype`` (materialises [N, V]).

    With ``logits_dtype`` the logits are first computed (and rounded) in that dtype from the inputs as they
    are -- eager's ``(h @ W.T).float()`` for ``logits_dtype=h.dtype`` -- then upcast to ``compute_dtype``.
    """
    if logits_dtype is None:
        logits = hidden.to(compute_dtype) @ lm_head_weight.to(compute_dtype).t()
    else:
        logits = (hidden.to(logits_dtype) @ lm_head_weight.to(logits_dtype).t()).to(compute_dtype)
    logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, target_ids.long().unsqueeze(-1)).squeeze(-1)
    if not entropy:
        return logp
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def token_logprobs(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    target_ids: torch.Tensor,
    temperature: float = 1.0,
    entropy: bool = False,
    *,
    chunk_size: int | None = None,
    backend: Backend = "auto",
    validate: bool = True,
    logits_dtype: torch.dtype | None = None,
    saved_chunks: int | None = None,
    overlap: bool = False,
):
    """Log-prob of ``target_ids`` under ``softmax(hidden · lm_head_weightᵀ / temperature)``, chunked over V.

    Returns fp32 ``logp`` shaped like ``target_ids`` (and ``entropy`` of the same shape when
    ``entropy=True``); differentiable w.r.t. ``hidden`` and ``lm_head_weight``. ``backend="auto"`` runs
    the Triton epilogues on CUDA (and under ``TRITON_INTERPRET=1``), the torch twin otherwise.

    Performance knobs (results agree to fp32 rounding unless noted):

    * ``logits_dtype``: dtype of each chunk's GEMM output. ``None`` (default) = ``hidden.dtype``: the
      fp32-accumulating GEMM rounds the logits to the input dtype -- exactly eager's ``(h @ W.T).float()``,
      what a model's bf16 ``lm_head`` returns to TRL and what samplers compute -- for half the chunk traffic
      (the log-probs carry that bf16 logit rounding, ~|z|·2⁻⁹, as eager's do). ``torch.float32``: fp32 GEMM
      output, more accurate than eager, ~5 % slower forward+backward on the H200 (docs/benchmarks.md).
    * ``saved_chunks``: chunks of logits the forward keeps for the backward when a gradient is needed (the
      backward skips their recompute GEMM and reuses their buffers). ``None`` = 1: the last chunk's buffer,
      which the backward would allocate anyway, so the forward+backward peak does not grow (the chunk is held
      from forward to backward, outside ``saved_tensors_hooks``). ``0`` recomputes every chunk; ``k > 1`` costs
      ``k − 1`` more chunk buffers. A second backward (``retain_graph``) recomputes all chunks.
    * ``overlap`` (CUDA): run the memory-bound epilogues on a side stream, overlapping the next chunk's GEMM;
      uses two chunk buffers (the automatic ``chunk_size`` halves to keep the same memory).
    * ``chunk_size``: vocabulary columns per chunk; default: a 1 GiB chunk buffer (``[N, C]`` logits).
    """
    _check_inputs(hidden, lm_head_weight, target_ids, temperature)
    vocab, width = lm_head_weight.shape
    batch_shape = target_ids.shape
    h2 = hidden.reshape(-1, width)
    y = target_ids.reshape(-1)
    if validate:
        _check_targets(y, vocab, batch_shape)
    if y.dtype != torch.int64 and y.dtype != torch.int32:
        y = y.long()
    y = y.contiguous()
    use_triton = _pick_backend(backend, hidden)
    if logits_dtype is None:
        logits_dtype = hidden.dtype
    if logits_dtype not in (torch.float32, hidden.dtype):
        raise ValueError(
            f"token_logprobs: logits_dtype must be torch.float32 or hidden's dtype ({hidden.dtype}), got "
            f"{logits_dtype}"
        )
    if saved_chunks is None:
        saved_chunks = 1
    if saved_chunks < 0:
        raise ValueError(f"token_logprobs: saved_chunks must be >= 0, got {saved_chunks}")
    nbuf = 2 if overlap else 1  # (off CUDA the pipeline runs inline: same schedule, no streams)
    elem = torch.empty((), dtype=logits_dtype).element_size()
    chunk = _chunk_size(chunk_size, h2.shape[0], vocab, elem * nbuf)
    cfg = _Config(chunk, use_triton, logits_dtype, int(saved_chunks), nbuf)
    logp, ent = _ChunkedLogprob.apply(h2, lm_head_weight, y, float(temperature), entropy, cfg)
    logp = logp.view(batch_shape)
    if validate:
        _check_finite(logp, hidden)
    if not entropy:
        return logp
    return logp, ent.view(batch_shape)


class _Config(NamedTuple):
    chunk: int
    use_triton: bool
    logits_dtype: torch.dtype
    saved_chunks: int
    nbuf: int  # chunk buffers in flight: 1, or 2 with overlap (side stream)


class _ChunkedLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, y, temperature, with_entropy, cfg):
        n, vocab = h.shape[0], w.shape[0]
        dev = h.device
        m = torch.full((n,), -math.inf, dtype=torch.float32, device=dev)
        s = torch.zeros(n, dtype=torch.float32, device=dev)
        t = torch.zeros(n, dtype=torch.float32, device=dev) if with_entropy else None
        zy = torch.zeros(n, dtype=torch.float32, device=dev)
        update = _triton_update if cfg.use_triton else lse_chunk_update_torch_
        spans = _spans(vocab, cfg.chunk)
        keep = (
            min(cfg.saved_chunks, len(spans)) if (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]) else 0
        )
        side = _Side(dev, cfg.nbuf > 1)
        pool = _Pool(n * cfg.chunk, cfg.logits_dtype, dev, cfg.nbuf)
        kept = []
        for i, (c0, c1) in enumerate(spans):
            flat = pool.take(side)
            x = _logits_into(h, w[c0:c1], flat, n)
            done = side.launch(update, x, y, c0, temperature, m, s, t, zy)
            if i >= len(spans) - keep:
                kept.append((c0, c1, flat, x))
            else:
                pool.give(flat, done)
            del x
        side.join()
        log_s = torch.log(s)
        lse = m + log_s
        logp = zy - lse
        ent = log_s - t / s if with_entropy else None
        ctx.save_for_backward(h, w, y, lse, ent)
        ctx.kept = kept  # [N, C] logits chunks, consumed (overwritten in place) by the first backward
        ctx.cfg = (temperature, cfg, spans)
        ctx.mark_non_differentiable(y)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        h, w, y, lse, ent = ctx.saved_tensors
        temperature, cfg, spans = ctx.cfg
        kept, ctx.kept = ctx.kept, []
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n = h.shape[0]
        g = torch.zeros(n, dtype=torch.float32, device=h.device) if grad_logp is None else grad_logp.float()
        g = g.contiguous()
        gh = grad_ent.float().contiguous() if (grad_ent is not None and ent is not None) else None
        dh = torch.zeros(h.shape, dtype=torch.float32, device=h.device) if need_h else None
        dw = torch.empty_like(w) if need_w else None
        dlogits = _triton_dlogits if cfg.use_triton else dlogits_chunk_torch
        side = _Side(h.device, cfg.nbuf > 1)
        pool = _Pool(n * cfg.chunk, cfg.logits_dtype, h.device, cfg.nbuf, allocated=len(kept))
        done_spans = {(c0, c1) for c0, c1, _, _ in kept}
        order = kept + [(c0, c1, None, None) for c0, c1 in spans if (c0, c1) not in done_spans]
        del kept
        pending: deque = deque()

        def finish(c0, c1, flat, d, ev):
            side.wait(ev)
            if need_h:
                _addmm_f32_(dh, d, w[c0:c1])
            if need_w:
                torch.mm(d.t(), h, out=dw[c0:c1])  # bf16 output straight from the fp32-accumulating GEMM
            pool.give(flat, None)  # reused by later main-stream work only: stream order suffices

        while order:
            c0, c1, flat, x = order.pop(0)
            if x is None:
                flat = pool.take(side)
                x = _logits_into(h, w[c0:c1], flat, n)
            # ∂L/∂logits overwrites the logits in place (packed into the first half of each fp32 row).
            d_out = x if x.dtype == h.dtype else packed_half_view(x, h.dtype)
            ev = side.launch(
                dlogits, x, y, c0, temperature, lse, g, gh, ent if gh is not None else None, h.dtype, d_out
            )
            pending.append((c0, c1, flat, d_out, ev))
            del x, d_out, flat
            if len(pending) >= cfg.nbuf:
                finish(*pending.popleft())
        while pending:
            finish(*pending.popleft())
        side.join()
        return (dh.to(h.dtype) if need_h else None), dw, None, None, None, None


def _spans(vocab: int, chunk: int) -> list[tuple[int, int]]:
    """Column ranges of the chunks; a ragged last chunk goes first, so the chunks kept for the backward are full."""
    spans = [(c0, min(c0 + chunk, vocab)) for c0 in range(0, vocab, chunk)]
    if len(spans) > 1 and spans[-1][1] - spans[-1][0] < chunk:
        spans.insert(0, spans.pop())
    return spans


def packed_half_view(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, C] view in 16-bit ``dtype`` over the first half of each row of a contiguous fp32 [N, C] ``x``."""
    n, c = x.shape
    if n == 0 or c == 0:
        return torch.empty((n, c), dtype=dtype, device=x.device)
    return x.view(dtype)[:, :c]


def _logits_into(h: torch.Tensor, wc: torch.Tensor, flat: torch.Tensor, n: int) -> torch.Tensor:
    """Raw logits ``h · wcᵀ`` [n, C] written into the front of the flat buffer (or a fresh tensor on fallback)."""
    out = flat[: n * wc.shape[0]].view(n, wc.shape[0])
    if out.dtype == h.dtype:
        return torch.mm(h, wc.t(), out=out)
    return _mm_f32_into(h, wc.t(), out)


class _Pool:
    """Flat chunk buffers: up to ``nbuf`` in rotation (each reuse waits for its last side-stream user)."""

    def __init__(self, numel, dtype, device, nbuf, allocated=0):
        self.numel, self.dtype, self.device, self.nbuf = numel, dtype, device, nbuf
        self.allocated = allocated
        self.free: list = []

    def take(self, side: _Side) -> torch.Tensor:
        if self.free and self.allocated >= self.nbuf:
            flat, ev = self.free.pop(0)
            side.wait(ev)
            return flat
        self.allocated += 1
        return torch.empty(self.numel, dtype=self.dtype, device=self.device)

    def give(self, flat: torch.Tensor, ev) -> None:
        if flat is not None and flat.numel() == self.numel and len(self.free) < self.nbuf:
            self.free.append((flat, ev))


_SIDE_STREAMS: dict = {}


class _Side:
    """Launches epilogues on a side CUDA stream after the main stream's work so far (``enabled``), or inline."""

    def __init__(self, device: torch.device, enabled: bool):
        self.on = enabled and device.type == "cuda"
        if self.on:
            self.main = torch.cuda.current_stream(device)
            key = (device.index, self.main.cuda_stream)
            if key not in _SIDE_STREAMS:
                _SIDE_STREAMS[key] = torch.cuda.Stream(device=device)
            self.stream = _SIDE_STREAMS[key]

    def launch(self, fn, *args):
        """Run ``fn(*args)``; returns the side stream's completion event (``None`` inline)."""
        if not self.on:
            fn(*args)
            return None
        self.stream.wait_stream(self.main)
        with torch.cuda.stream(self.stream):
            fn(*args)
        for a in args:
            if isinstance(a, torch.Tensor):
                a.record_stream(self.stream)  # freed on main while the side stream may still read it
        return self.stream.record_event()

    def wait(self, ev) -> None:
        if ev is not None:
            self.main.wait_event(ev)

    def join(self) -> None:
        if self.on:
            self.main.wait_stream(self.stream)


# ----- torch twins of the Triton epilogues (the CPU path and the kernels' reference) -----


def lse_chunk_update_torch_(x, targets, col0, temperature, m, s, t, zy):
    """Torch twin of ``logprob_triton.lse_chunk_update_`` (same state, same update rule)."""
    z = x.float() / temperature
    cols = torch.arange(col0, col0 + z.shape[1], device=z.device)
    hit = targets[:, None] == cols[None, :]
    zy += torch.where(hit, z, 0.0).sum(1)
    m_new = torch.maximum(m, z.max(1).values)
    seen = s > 0
    alpha = torch.where(seen, torch.exp(m - m_new), 0.0)
    d = z - m_new[:, None]
    e = torch.exp(d)
    if t is not None:
        shift = torch.where(seen, m - m_new, 0.0)
        t.copy_(alpha * (t + shift * s) + (e * d).sum(1))
    s.copy_(alpha * s + e.sum(1))
    m.copy_(m_new)


def dlogits_chunk_torch(
    x, targets, col0, temperature, lse, grad_logp, grad_entropy, entropy, out_dtype, out=None
):
    """Torch twin of ``logprob_triton.dlogits_chunk`` (``out`` may alias ``x``)."""
    logp = x.float() / temperature - lse[:, None]
    p = torch.exp(logp)
    cols = torch.arange(col0, col0 + x.shape[1], device=x.device)
    d = grad_logp[:, None] * ((targets[:, None] == cols[None, :]).float() - p)
    if grad_entropy is not None:
        d -= grad_entropy[:, None] * p * (logp + entropy[:, None])
    d = (d / temperature).to(out_dtype)
    if out is None:
        return d
    return out.copy_(d)


def _triton_update(*args):
    from .logprob_triton import lse_chunk_update_

    lse_chunk_update_(*args)


def _triton_dlogits(*args):
    from .logprob_triton import dlogits_chunk

    return dlogits_chunk(*args)


# ----- GEMMs with fp32 output -----

_CUDA_MM_INTO = True  # torch.mm(..., out_dtype=fp32, out=buf) on CUDA; turned off if it fails


def _mm_f32_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (half inputs) with fp32 accumulation and output, into ``out`` where possible."""
    global _CUDA_MM_INTO
    if a.is_cuda:
        if _CUDA_MM_INTO:
            try:
                return torch.mm(a, b, out_dtype=torch.float32, out=out)
            except (TypeError, RuntimeError, NotImplementedError):
                _CUDA_MM_INTO = False
        return _mm_f32(a, b)
    return torch.mm(a.float(), b.float(), out=out)


_CUDA_OUT_DTYPE = True  # torch.mm(..., out_dtype=fp32) on CUDA (torch >= 2.9); turned off if it fails


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with fp32 accumulation and fp32 output (never rounded to the input dtype)."""
    global _CUDA_OUT_DTYPE
    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda and _CUDA_OUT_DTYPE:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):
            _CUDA_OUT_DTYPE = False
    return a.float() @ b.float()


_CUDA_ADDMM_OUT_DTYPE = True  # torch.addmm(..., out_dtype=fp32, out=acc) on CUDA; off if it fails


def _addmm_f32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with fp32 ``acc`` (in place; one fused cuBLAS call with beta = 1 where possible)."""
    global _CUDA_ADDMM_OUT_DTYPE
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    if a.is_cuda and a.dtype != torch.float32 and _CUDA_ADDMM_OUT_DTYPE:
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            return
        except (TypeError, RuntimeError, NotImplementedError):
            _CUDA_ADDMM_OUT_DTYPE = False
    acc += _mm_f32(a, b)


# ----- input checks -----


def _check_inputs(hidden, weight, targets, temperature):
    if weight.dim() != 2:
        raise ValueError(f"token_logprobs: lm_head_weight must be [V, H], got shape {tuple(weight.shape)}")
    if hidden.shape[-1:] != weight.shape[1:]:
        raise ValueError(
            f"token_logprobs: hidden [..., H] has H={hidden.shape[-1] if hidden.dim() else None}, "
            f"lm_head_weight [V, H] has H={weight.shape[1]}"
        )
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"token_logprobs: target_ids shape {tuple(targets.shape)} != hidden.shape[:-1] "
            f"{tuple(hidden.shape[:-1])}"
        )
    if hidden.dtype not in (torch.float32, torch.float16, torch.bfloat16) or hidden.dtype != weight.dtype:
        raise TypeError(
            f"token_logprobs: hidden ({hidden.dtype}) and lm_head_weight ({weight.dtype}) must share one of "
            "float32, float16, bfloat16"
        )
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise TypeError(f"token_logprobs: target_ids must be integer, got {targets.dtype}")
    if hidden.device != weight.device or hidden.device != targets.device:
        raise ValueError("token_logprobs: hidden, lm_head_weight and target_ids must be on one device")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"token_logprobs: temperature must be finite and > 0, got {temperature}")


def _check_targets(y: torch.Tensor, vocab: int, batch_shape) -> None:
    bad = (y < 0) | (y >= vocab)
    if y.numel() and bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        pos = tuple(int(k) for k in torch.unravel_index(torch.tensor(i), batch_shape))
        raise ValueError(
            f"token_logprobs: target_ids{list(pos)} = {int(y[i])} is outside the vocabulary [0, {vocab})"
        )


def _check_finite(logp: torch.Tensor, hidden: torch.Tensor) -> None:
    bad = ~torch.isfinite(logp)
    if logp.numel() and bool(bad.any()):
        pos = tuple(int(k) for k in bad.nonzero()[0])
        if not bool(torch.isfinite(hidden[pos]).all()):
            why = f"hidden{list(pos)} has non-finite values"
        else:
            why = "hidden is finite there, so lm_head_weight has non-finite values or the logits overflow"
        raise ValueError(f"token_logprobs: non-finite log-prob at position {list(pos)}: {why}")


def _pick_backend(backend: Backend, hidden: torch.Tensor) -> bool:
    if backend == "triton":
        return True
    if backend == "torch":
        return False
    if backend != "auto":
        raise ValueError(f"token_logprobs: backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    from triage.kernels.nvfp4.device import triton_runs_on

    return triton_runs_on(hidden.device)


def _chunk_size(chunk_size: int | None, n: int, vocab: int, bytes_per_column_row: int) -> int:
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"token_logprobs: chunk_size must be >= 1, got {chunk_size}")
        return min(chunk_size, max(vocab, 1))
    c = _CHUNK_BYTES // (bytes_per_column_row * max(n, 1))
    c = max(1024, min(32768, 1 << max(c, 1).bit_length() - 1))
    return min(c, max(vocab, 1))
