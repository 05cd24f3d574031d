"""Triton epilogues of the chunked log-prob: an online-logsumexp update and the chunk's logit gradient.

Both work on one vocabulary chunk of raw logits ``x = h · W_cᵀ`` ([N, C], columns ``c0 .. c0+C``), produced by
a stock tensor-core GEMM with fp32 output (default) or output in the input dtype (``logits_dtype``: half the
traffic, bit-for-bit eager's ``(h @ W.T).float()``); all epilogue math is fp32; ``z = x / T``.

Forward state per row (fp32, updated in place chunk after chunk — flash-attention style):
  ``m``  running max of z;  ``s = Σ exp(z − m)``;  ``t = Σ exp(z − m)·(z − m)`` (entropy only);
  ``zy`` the target's z (written by the one chunk that holds the target).
A new chunk with max ``m'`` rescales by ``α = exp(m − m')``: ``s ← α·s + Σ_c``, ``t ← α·(t + (m − m')·s) + Σ_c``.
Finally ``lse = m + log s``, ``log p_y = zy − lse``, ``H = log s − t/s``.

Backward per chunk, with ``p = exp(z − lse)``, ``g = ∂L/∂log p_y`` and ``g_H = ∂L/∂H``:
  ``∂L/∂x_j = (g·(1[j = y] − p_j) − g_H·p_j·(z_j − lse + H)) / T``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triage.kernels._launch import cdiv, fast_launch, next_power_of_2


@fast_launch
@triton.jit
def _lse_chunk_update_kernel(
    x_ptr,
    stride_xn,
    target_ptr,
    m_ptr,
    s_ptr,
    t_ptr,
    zy_ptr,
    n_rows,
    n_cols,
    col0,
    temperature,
    WITH_ENTROPY: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    m = tl.load(m_ptr + rows, mask=row_ok, other=0.0)
    s = tl.load(s_ptr + rows, mask=row_ok, other=0.0)
    zy = tl.load(zy_ptr + rows, mask=row_ok, other=0.0)
    if WITH_ENTROPY:
        t = tl.load(t_ptr + rows, mask=row_ok, other=0.0)
    y = tl.load(target_ptr + rows, mask=row_ok, other=-1).to(tl.int64) - col0
    for start in range(0, n_cols, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        ok = row_ok[:, None] & (cols < n_cols)[None, :]
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xn + cols[None, :], mask=ok, other=0.0)
        z = tl.math.div_rn(x.to(tl.float32), temperature)
        zy += tl.sum(tl.where(ok & (cols[None, :] == y[:, None]), z, 0.0), axis=1)
        m_new = tl.maximum(m, tl.max(tl.where(ok, z, -float("inf")), axis=1))
        m_new = tl.where(row_ok, m_new, 0.0)
        # s == 0 marks "nothing seen yet" (m = -inf): no rescaling term then (avoids 0·inf).
        seen = s > 0.0
        alpha = tl.where(seen, tl.exp(m - m_new), 0.0)
        d = z - m_new[:, None]
        e = tl.where(ok, tl.exp(d), 0.0)
        if WITH_ENTROPY:
            shift = tl.where(seen, m - m_new, 0.0)
            t = alpha * (t + shift * s) + tl.sum(tl.where(ok, e * d, 0.0), axis=1)
        s = alpha * s + tl.sum(e, axis=1)
        m = m_new
    tl.store(m_ptr + rows, m, mask=row_ok)
    tl.store(s_ptr + rows, s, mask=row_ok)
    tl.store(zy_ptr + rows, zy, mask=row_ok)
    if WITH_ENTROPY:
        tl.store(t_ptr + rows, t, mask=row_ok)


@fast_launch
@triton.jit
def _dlogits_chunk_kernel(
    x_ptr,
    stride_xn,
    out_ptr,
    stride_on,
    target_ptr,
    lse_ptr,
    g_ptr,
    gh_ptr,
    ent_ptr,
    n_rows,
    n_cols,
    col0,
    temperature,
    WITH_ENTROPY: tl.constexpr,
    SYNC: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # One program owns BLOCK_N whole rows and walks them left to right, so ``out`` may alias ``x``: in place
    # (same dtype: each element is read then written by the same thread), or -- SYNC -- bf16/fp16 ``out``
    # packed into the first half of each fp32 row of ``x``. There the store of column block a lands on the
    # fp32 bytes of block a // 2, which this program has already loaded; the barrier makes every thread's
    # loads of the current block precede any thread's store (block 0 overlaps itself).
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    g = tl.load(g_ptr + rows, mask=row_ok, other=0.0)
    y = tl.load(target_ptr + rows, mask=row_ok, other=-1).to(tl.int64) - col0
    if WITH_ENTROPY:
        gh = tl.load(gh_ptr + rows, mask=row_ok, other=0.0)
        ent = tl.load(ent_ptr + rows, mask=row_ok, other=0.0)
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xn
    o_rows = out_ptr + rows[:, None].to(tl.int64) * stride_on
    for start in range(0, n_cols, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        ok = row_ok[:, None] & (cols < n_cols)[None, :]
        x = tl.load(x_rows + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        z = tl.math.div_rn(x, temperature)
        logp = z - lse[:, None]
        p = tl.exp(logp)
        d = g[:, None] * (tl.where(cols[None, :] == y[:, None], 1.0, 0.0) - p)
        if WITH_ENTROPY:
            d -= gh[:, None] * p * (logp + ent[:, None])
        d = tl.math.div_rn(d, temperature)
        if SYNC:
            tl.debug_barrier()
        tl.store(o_rows + cols[None, :], d.to(out_ptr.dtype.element_ty), mask=ok)


def lse_chunk_update_(
    x: torch.Tensor,
    targets: torch.Tensor,
    col0: int,
    temperature: float,
    m: torch.Tensor,
    s: torch.Tensor,
    t: torch.Tensor | None,
    zy: torch.Tensor,
) -> None:
    """Fold one chunk of raw logits ``x`` [N, C] (fp32 or half, unit column stride) into the state in place."""
    n, c = x.shape
    block_c = min(1024, next_power_of_2(max(c, 16)))
    block_n = max(1, min(16, 4096 // block_c))
    grid = (cdiv(n, block_n),)
    _lse_chunk_update_kernel[grid](
        x,
        x.stride(0),
        targets,
        m,
        s,
        t if t is not None else s,
        zy,
        n,
        c,
        col0,
        float(temperature),
        WITH_ENTROPY=t is not None,
        BLOCK_N=block_n,
        BLOCK_C=block_c,
    )


def dlogits_chunk(
    x: torch.Tensor,
    targets: torch.Tensor,
    col0: int,
    temperature: float,
    lse: torch.Tensor,
    grad_logp: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    entropy: torch.Tensor | None,
    out_dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """∂L/∂x for one chunk of raw logits ``x`` [N, C] (fp32 or half, unit column stride), in ``out_dtype``.

    ``out`` (optional, [N, C], unit column stride, dtype ``out_dtype``) receives the result; it may be ``x``
    itself (in place) or, for fp32 ``x`` and 16-bit ``out_dtype``, ``logprob.packed_half_view(x)`` (the first half of
    each fp32 row), so the chunk's gradient needs no memory of its own.
    """
    n, c = x.shape
    if out is None:
        out = torch.empty((n, c), dtype=out_dtype, device=x.device)
    assert out.shape == x.shape and out.dtype == out_dtype and (c <= 1 or out.stride(1) == 1)
    sync = (
        out.element_size() != x.element_size()
        and out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    )
    block_c = min(1024, next_power_of_2(max(c, 16)))
    block_n = max(1, min(8, 4096 // block_c))
    grid = (cdiv(n, block_n),)
    with_entropy = grad_entropy is not None
    _dlogits_chunk_kernel[grid](
        x,
        x.stride(0),
        out,
        out.stride(0),
        targets,
        lse,
        grad_logp,
        grad_entropy if with_entropy else grad_logp,
        entropy if with_entropy else lse,
        n,
        c,
        col0,
        float(temperature),
        WITH_ENTROPY=with_entropy,
        SYNC=sync,
        BLOCK_N=block_n,
        BLOCK_C=block_c,
    )
    return out
