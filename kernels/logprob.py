"""Per-token log-probabilities (and entropies) of an LM head, computed in vocabulary chunks.

For hidden states ``h`` [..., H], an LM-head weight ``W`` [V, H], targets ``y`` [...] and a temperature T:

    z = h · Wᵀ / T,    log p(y) = z_y − logsumexp(z),    H(p) = −Σ_j p_j log p_j   (optional).

``token_logprobs`` never materialises the [N, V] logits: the vocabulary is walked in chunks of C columns;
each chunk's raw logits come from a stock tensor-core GEMM with fp32 output and are folded into a running
(max, Σexp, Σexp·z) state by an online-logsumexp epilogue (Triton on GPU or under ``TRITON_INTERPRET=1``,
its pure-torch twin on CPU; see ``logprob_triton``). The backward recomputes each chunk's logits, forms
∂L/∂logits for the chunk (one epilogue pass) and accumulates ``dh += dlogits_c · W_c`` (fp32) and
``dW_c = dlogits_cᵀ · h``. Peak extra memory is one [N, C] fp32 chunk plus its gradient in the input dtype
and an [N, H] fp32 accumulator, instead of [N, V] fp32 logits.

Rules: targets must lie in [0, V) (a ``ValueError`` names the first bad position); hidden and weight share
one floating dtype; a non-finite result (NaN/Inf in the inputs, or overflowing logits) raises a
``ValueError`` naming the first affected position (``validate=False`` skips both checks and their host sync).
Outputs are fp32; gradients come back in the input dtypes.
"""

from __future__ import annotations

import math
import os
from typing import Literal

import torch

Backend = Literal["auto", "triton", "torch"]
_CHUNK_BYTES = 512 * 2**20  # fp32 bytes of one logits chunk (auto chunk size)


def token_logprobs_reference(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    target_ids: torch.Tensor,
    temperature: float = 1.0,
    entropy: bool = False,
    compute_dtype: torch.dtype = torch.float32,
):
    """Eager reference: ``log_softmax(h·Wᵀ/T).gather(y)`` in ``compute_dtype`` (materialises [N, V])."""
    logits = hidden.to(compute_dtype) @ lm_head_weight.to(compute_dtype).t() / temperature
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
):
    """Log-prob of ``target_ids`` under ``softmax(hidden · lm_head_weightᵀ / temperature)``, chunked over V.

    Returns fp32 ``logp`` shaped like ``target_ids`` (and ``entropy`` of the same shape when
    ``entropy=True``); differentiable w.r.t. ``hidden`` and ``lm_head_weight``. ``backend="auto"`` runs
    the Triton epilogues on CUDA (and under ``TRITON_INTERPRET=1``), the torch twin otherwise.
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
    chunk = _chunk_size(chunk_size, h2.shape[0], vocab)
    logp, ent = _ChunkedLogprob.apply(h2, lm_head_weight, y, float(temperature), entropy, chunk, use_triton)
    logp = logp.view(batch_shape)
    if validate:
        _check_finite(logp, hidden)
    if not entropy:
        return logp
    return logp, ent.view(batch_shape)


class _ChunkedLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, y, temperature, with_entropy, chunk, use_triton):
        n, vocab = h.shape[0], w.shape[0]
        dev = h.device
        m = torch.full((n,), -math.inf, dtype=torch.float32, device=dev)
        s = torch.zeros(n, dtype=torch.float32, device=dev)
        t = torch.zeros(n, dtype=torch.float32, device=dev) if with_entropy else None
        zy = torch.zeros(n, dtype=torch.float32, device=dev)
        update = _triton_update if use_triton else lse_chunk_update_torch_
        for c0 in range(0, vocab, chunk):
            x = _mm_f32(h, w[c0 : c0 + chunk].t())
            update(x, y, c0, temperature, m, s, t, zy)
            del x
        log_s = torch.log(s)
        lse = m + log_s
        logp = zy - lse
        ent = log_s - t / s if with_entropy else None
        ctx.save_for_backward(h, w, y, lse, ent)
        ctx.cfg = (temperature, chunk, use_triton)
        ctx.mark_non_differentiable(y)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        h, w, y, lse, ent = ctx.saved_tensors
        temperature, chunk, use_triton = ctx.cfg
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n, vocab = h.shape[0], w.shape[0]
        g = torch.zeros(n, dtype=torch.float32, device=h.device) if grad_logp is None else grad_logp.float()
        g = g.contiguous()
        gh = grad_ent.float().contiguous() if (grad_ent is not None and ent is not None) else None
        dh = torch.zeros(h.shape, dtype=torch.float32, device=h.device) if need_h else None
        dw = torch.empty_like(w) if need_w else None
        dlogits = _triton_dlogits if use_triton else dlogits_chunk_torch
        for c0 in range(0, vocab, chunk):
            wc = w[c0 : c0 + chunk]
            x = _mm_f32(h, wc.t())
            d = dlogits(x, y, c0, temperature, lse, g, gh, ent if gh is not None else None, h.dtype)
            del x
            if need_h:
                _addmm_f32_(dh, d, wc)
            if need_w:
                dw[c0 : c0 + chunk] = _mm_f32(d.t(), h).to(w.dtype)
        return (dh.to(h.dtype) if need_h else None), dw, None, None, None, None, None


# ----- torch twins of the Triton epilogues (the CPU path and the kernels' reference) -----


def lse_chunk_update_torch_(x, targets, col0, temperature, m, s, t, zy):
    """Torch twin of ``logprob_triton.lse_chunk_update_`` (same state, same update rule)."""
    z = x / temperature
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


def dlogits_chunk_torch(x, targets, col0, temperature, lse, grad_logp, grad_entropy, entropy, out_dtype):
    """Torch twin of ``logprob_triton.dlogits_chunk``."""
    logp = x / temperature - lse[:, None]
    p = torch.exp(logp)
    cols = torch.arange(col0, col0 + x.shape[1], device=x.device)
    d = grad_logp[:, None] * ((targets[:, None] == cols[None, :]).float() - p)
    if grad_entropy is not None:
        d -= grad_entropy[:, None] * p * (logp + entropy[:, None])
    return (d / temperature).to(out_dtype)


def _triton_update(*args):
    from .logprob_triton import lse_chunk_update_

    lse_chunk_update_(*args)


def _triton_dlogits(*args):
    from .logprob_triton import dlogits_chunk

    return dlogits_chunk(*args)


# ----- GEMMs with fp32 output -----

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
    return hidden.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _chunk_size(chunk_size: int | None, n: int, vocab: int) -> int:
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"token_logprobs: chunk_size must be >= 1, got {chunk_size}")
        return min(chunk_size, max(vocab, 1))
    c = _CHUNK_BYTES // (4 * max(n, 1))
    c = max(1024, min(32768, 1 << max(c, 1).bit_length() - 1))
    return min(c, max(vocab, 1))
