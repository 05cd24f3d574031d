"""Grouped NVFP4 GEMM for MoE experts: ``y[rows of e] = a[rows of e] · w[e]ᵀ`` for all experts at once.

Layout. Tokens (rows of ``a``, [T, K]) are sorted by expert; ``offsets`` (int [E+1], ``offsets[0] = 0``,
non-decreasing, ``offsets[E] = T``) delimits expert e's rows ``offsets[e] .. offsets[e+1]`` (possibly
empty). Expert weights ``w`` are NVFP4 [E, N, K] with a per-expert outer scale ([E, 1, 1]) or a per-row one
([E, N, 1]); the activation ``a`` is NVFP4 [T, K] with one outer scale for all rows (the amax of the whole
sorted input: every expert reads the same quantized tokens, so the amax is computed once, not per expert)
or one per row.

Math (as in the dense GEMM, :mod:`triage.kernels.nvfp4.matmul`): with ``q·s`` exact in fp16/bf16,

    y[t, n] = g_a[t] · g_w[e(t), n] · Σ_k (q_a s_a)[t, k] · (q_w s_w)[e(t), n, k]

products exact, fp32 accumulation, outer scales in an fp32 epilogue, one final rounding.

Backends:
* ``"triton"`` — one grouped Triton kernel (:mod:`.grouped_triton`) that unpacks both operands in registers.
* ``"triton_expanded"`` — the same kernel on the operands' exact bf16 ``q·s`` expansions: the activation's
  from ``a.expanded`` when the quantizer wrote it (``quantize(..., emit_expanded=torch.bfloat16)``), the
  weights' from ``w_expanded=`` (cached once per optimizer step). Tensor cores, fp32 accumulation, outer
  scales in the epilogue: exact like the others, and no unpacking in the inner loop.
* ``"grouped_mm"`` — exact bf16 expansion + ``torch._grouped_mm``. That op returns bf16, so the sum is
  rounded to bf16 *before* the fp32 outer-scale epilogue: one extra rounding (≤ 1 bf16 ulp); a baseline.

Routing gather: ``a_rows`` (int [R]) makes row r of the product read row ``a_rows[r]`` of ``a`` (``a`` then
holds the T un-routed tokens, quantized once); the Triton backends gather inside the kernel, so the
top-k copy of the activations (packed or expanded) is never written.
* ``"reference"`` — a loop of per-expert fp64 matmuls on dequantized values.
* ``"auto"`` — reference on CPU (unless the Triton interpreter is on), :data:`LARGE_BACKEND` on CUDA.

Metadata stays on the device: the kernel maps tiles to experts with device ops (no host sync per expert).
``validate=True`` (default) checks ``offsets`` and costs one host sync; ``validate=False`` skips it.

Weight gradient (ragged K), :func:`grouped_wgrad`: ``dW[e] = A[:, s_e:t_e] · B[:, s_e:t_e]ᵀ`` for NVFP4 A
[M, L] (``dyᵀ``) and B [N, L] (``xᵀ``) quantized along the token dim L, in which every expert segment starts
at a multiple of 16 (:func:`padded_segments` / :func:`pad_segments` build that layout from the sorted rows
on the device: segment e at ``padded_offsets[e]`` = exclusive cumsum of ``ceil16(n_e)``, zeros between
segments and after the last, ``L = ceil16(T + 15·E)`` a static bound). So no 16-block straddles two
experts, both operands are quantized ONCE for all experts (one outer scale per operand, or one per row) and
one launch (:func:`~.grouped_triton.launch_grouped_wgrad`) computes every expert; same backends as above
(``"grouped_mm"``: bf16 ``torch._grouped_mm`` of the expansions, then the fp32 scales), empty experts 0.
"""

from __future__ import annotations

import torch

from triage.kernels.nvfp4.format import e2m1_decode
from triage.kernels.nvfp4.matmul import check_same_transform, expand, operand_k, padded_k

#: the public functions, re-exported by ``triage.kernels.moe`` (:data:`LARGE_BACKEND` is read here at each
#: call: set it on this module)
__all__ = [
    "check_offsets",
    "dequantize64",
    "expand_experts",
    "grouped_gemm",
    "grouped_gemm_reference",
    "grouped_mm",
    "grouped_wgrad",
    "grouped_wgrad_reference",
    "offsets_from_expert_ids",
    "pad_segments",
    "padded_segments",
]

#: Default CUDA backend; set from the H200 measurement (experiments/bench/bench_grouped_gemm.py).
LARGE_BACKEND = "triton_expanded"
_BACKENDS = ("auto", "triton", "triton_expanded", "grouped_mm", "reference")
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----- metadata -----


def offsets_from_expert_ids(
    expert_ids: torch.Tensor, num_experts: int, *, validate: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort routed rows by expert: returns ``(order, offsets)`` with ``expert_ids.flatten()[order]``
    non-decreasing and ``offsets`` int64 [E+1]. Device ops only; ``validate`` checks ids are in [0, E)
    (one host sync) and names the first bad position."""
    if expert_ids.dtype.is_floating_point or expert_ids.dtype.is_complex or expert_ids.dtype == torch.bool:
        raise TypeError(f"expert_ids must be an integer tensor, got {expert_ids.dtype}")
    flat = expert_ids.reshape(-1)
    if validate:
        bad = (flat < 0) | (flat >= num_experts)
        if flat.numel() and bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            pos = tuple(int(k) for k in torch.unravel_index(torch.tensor(i), tuple(expert_ids.shape)))
            raise ValueError(
                f"expert_ids{list(pos)} = {int(flat[i])} is outside [0, {num_experts}) (num_experts)"
            )
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)[:num_experts]
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    offsets[1:] = torch.cumsum(counts, 0)
    return order, offsets


def check_offsets(offsets: torch.Tensor, num_rows: int, num_experts: int) -> None:
    """``offsets`` must be integer [E+1], start at 0, never decrease and end at ``num_rows`` (one sync)."""
    if offsets.dtype.is_floating_point or offsets.dtype == torch.bool or offsets.dim() != 1:
        raise TypeError(f"offsets must be a 1-D integer tensor, got {offsets.dtype} {tuple(offsets.shape)}")
    if offsets.numel() != num_experts + 1:
        raise ValueError(
            f"offsets has {offsets.numel()} entries, expected num_experts + 1 = {num_experts + 1}"
        )
    o = offsets.long().cpu()
    if int(o[0]) != 0:
        raise ValueError(f"offsets[0] = {int(o[0])}, expected 0")
    steps = o[1:] - o[:-1]
    if bool((steps < 0).any()):
        e = int((steps < 0).nonzero()[0, 0])
        raise ValueError(
            f"offsets decrease at expert {e}: offsets[{e}] = {int(o[e])} > offsets[{e + 1}] = {int(o[e + 1])}"
        )
    if int(o[-1]) != num_rows:
        raise ValueError(f"offsets[-1] = {int(o[-1])} does not match the token count {num_rows}")


# ----- operands -----


def _check_operands(a, w, offsets, out_dtype, validate, rows=None):
    Ka, Kw = operand_k(a, "a"), operand_k(w, "w")
    if len(tuple(a.shape)) != 2 or len(tuple(w.shape)) != 3:
        raise ValueError(f"a must be [T, K] and w [E, N, K], got {tuple(a.shape)} and {tuple(w.shape)}")
    if Ka != Kw:
        raise ValueError(f"reduction dims differ: a has K={Ka}, w has K={Kw}")
    check_same_transform(a, w, "a", "w")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {_OUT_DTYPES}, got {out_dtype}")
    if a.data.device != w.data.device or offsets.device != a.data.device:
        raise ValueError("a, w and offsets must be on one device")
    T, (E, N, _) = a.shape[0], tuple(w.shape)
    if validate:
        check_offsets(offsets, T if rows is None else rows, E)
    return T, E, N, padded_k(Ka)


def _outer_a(a, T: int) -> torch.Tensor:
    g = a.global_scale.float()
    if g.numel() == 1:
        return g.reshape(1)
    if g.numel() == T:
        return g.reshape(T)
    raise ValueError(f"a.global_scale has shape {tuple(g.shape)}: expected 1 element or one per row [{T}, 1]")


def _outer_w(w, E: int, N: int) -> torch.Tensor:
    """[E] (per expert or per tensor) or [E, N] (per expert row) fp32."""
    g = w.global_scale.float()
    if g.numel() == 1:
        return g.reshape(1).expand(E).contiguous()
    if g.numel() == E:
        return g.reshape(E)
    if g.numel() == E * N:
        return g.reshape(E, N)
    raise ValueError(
        f"w.global_scale has shape {tuple(g.shape)}: expected per tensor, per expert [E, 1, 1] or per row [E, N, 1]"
    )


def expand_experts(w, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Exact ``q·s`` of NVFP4 expert weights [E, N, K] as dense [E, N, Kp] (outer scale not applied)."""
    return expand(w, dtype)


# ----- references -----


def dequantize64(t, crop: bool = True) -> torch.Tensor:
    """fp64 ``q·s·g`` of an NVFP4 operand of any rank (g broadcast: per tensor, row or expert), K cropped.

    ``crop=False`` keeps the padded columns [..., Kp]: after a Hadamard transform they are not zero, and a
    product of two padded operands contracts over all Kp columns (as the dense ``gemm_reference``).
    """
    Kp = padded_k(t.shape[-1])
    codes = torch.stack([t.data & 0xF, t.data >> 4], dim=-1).reshape(*t.data.shape[:-1], Kp).long()
    q = e2m1_decode(codes).double()
    s = t.scale.double().repeat_interleave(16, dim=-1)
    v = q * s * t.global_scale.double()
    return v[..., : t.shape[-1]] if crop else v


def grouped_gemm_reference(a, w, offsets, *, out_dtype=torch.bfloat16, validate: bool = True) -> torch.Tensor:
    """Loop of per-expert fp64 matmuls on dequantized operands (reads the offsets on the host)."""
    T, E, N, _ = _check_operands(a, w, offsets, out_dtype, validate)
    xa, wv = dequantize64(a, crop=False), dequantize64(w, crop=False)  # K padded alike on both operands
    out = torch.zeros((T, N), dtype=torch.float64, device=a.data.device)
    o = offsets.long().tolist()
    for e in range(E):
        out[o[e] : o[e + 1]] = xa[o[e] : o[e + 1]] @ wv[e].T
    return out.to(out_dtype)


def grouped_mm(
    a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, *, trans_b: bool = False
) -> torch.Tensor:
    """Dense grouped matmul in a's dtype (fp32 accumulation): ``torch._grouped_mm`` where it runs, a
    per-expert loop otherwise (that loop syncs once to read the offsets).

    * a [T, K], b [E, N, K] → [T, N]: ``out[rows e] = a[rows e] · b[e]ᵀ`` (``trans_b=True``: b [E, K, N]).
    * a [N, T] (a token-major tensor transposed), b [T, K] → [E, N, K]: ``out[e] = a[:, rows e] · b[rows e]``
      (the weight gradient); empty experts give zeros.
    """
    ends = offsets[1:].to(torch.int32)
    if b.dim() == 3:
        bt = b if trans_b else b.transpose(1, 2)
        out = _try_grouped_mm(a, bt, ends)
        if out is None:
            out = a.new_empty((a.shape[0], bt.shape[2]))
            o = offsets.long().tolist()
            for e in range(b.shape[0]):
                out[o[e] : o[e + 1]] = a[o[e] : o[e + 1]] @ bt[e]
        return out
    out = _try_grouped_mm(a, b, ends)
    E = offsets.numel() - 1
    if out is None:
        out = a.new_zeros((E, a.shape[0], b.shape[1]))
        o = offsets.long().tolist()
        for e in range(E):
            if o[e + 1] > o[e]:
                out[e] = a[:, o[e] : o[e + 1]] @ b[o[e] : o[e + 1]]
        return out
    empty = (offsets[1:] == offsets[:-1]).view(E, 1, 1)
    return torch.where(empty, torch.zeros((), dtype=out.dtype, device=out.device), out)


def _try_grouped_mm(a, b, ends):
    fn = getattr(torch, "_grouped_mm", None)
    if fn is None or (a.is_cuda and a.dtype != torch.bfloat16):
        return None
    try:
        return fn(a, b, ends)
    except (RuntimeError, NotImplementedError, TypeError):
        return None


# ----- the grouped NVFP4 GEMM -----


def _pick(backend: str, device: torch.device) -> str:
    from triage.kernels.nvfp4.device import triton_runs_on

    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    gpu = triton_runs_on(device)
    if backend == "auto":
        return LARGE_BACKEND if gpu else "reference"
    if backend in ("triton", "triton_expanded") and not gpu:
        raise ValueError(f"backend {backend!r} needs a CUDA tensor (or TRITON_INTERPRET=1)")
    return backend


def grouped_gemm(
    a,
    w,
    offsets: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    backend: str = "auto",
    w_expanded: torch.Tensor | None = None,
    a_rows: torch.Tensor | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """W4A4 grouped ``y = a·w[e]ᵀ`` per expert segment: a NVFP4 [T, K], w NVFP4 [E, N, K] → [R, N].

    ``a_rows``: optional int [R] gather (row r uses ``a[a_rows[r]]``; R = T without it). ``w_expanded``: an
    optional cached :func:`expand_experts` of ``w`` (bf16, or fp16 for ``triton_expanded``).
    """
    if a_rows is not None:
        if a_rows.dim() != 1 or a_rows.dtype.is_floating_point or a_rows.device != a.data.device:
            raise ValueError("a_rows must be a 1-D integer tensor on a's device")
        if validate and a_rows.numel() and (int(a_rows.min()) < 0 or int(a_rows.max()) >= a.shape[0]):
            raise ValueError(f"a_rows has entries outside [0, {a.shape[0]}) (rows of a)")
    which = _pick(backend, a.data.device)
    if which in ("reference", "grouped_mm") and a_rows is not None:
        a = _gather(a, a_rows)
        a_rows = None
    R = a.shape[0] if a_rows is None else a_rows.numel()
    T, E, N, K = _check_operands(a, w, offsets, out_dtype, validate, rows=R)
    if which == "reference":
        return grouped_gemm_reference(a, w, offsets, out_dtype=out_dtype, validate=False)
    g_a, g_w = _outer_a(a, T), _outer_w(w, E, N)
    if which == "grouped_mm":
        xa = expand(a, torch.bfloat16)
        wb = w_expanded if w_expanded is not None and w_expanded.dtype == torch.bfloat16 else None
        wb = wb if wb is not None else expand(w, torch.bfloat16)
        acc = grouped_mm(xa, wb, offsets).float()
        e_of_row = torch.repeat_interleave(
            torch.arange(E, device=xa.device), (offsets[1:] - offsets[:-1]).long(), output_size=R
        )
        acc = acc * (g_a if g_a.numel() == 1 else g_a[:, None])
        acc = acc * (g_w[e_of_row][:, None] if g_w.dim() == 1 else g_w[e_of_row])
        return acc.to(out_dtype)
    from .grouped_triton import launch_grouped_gemm

    out = torch.empty((R, N), dtype=out_dtype, device=a.data.device)
    offs = offsets.contiguous()
    if which == "triton":
        a_data, a_scale = a.data.reshape(T, K // 2), a.scale.reshape(T, K // 16)
        return launch_grouped_gemm(a_data, a_scale, w.data, w.scale, K, offs, out, g_a, g_w, rows=a_rows)
    dtype = w_expanded.dtype if w_expanded is not None else torch.bfloat16
    wb = w_expanded if w_expanded is not None else expand(w, dtype)
    xa = expand(a, dtype).reshape(T, K)
    return launch_grouped_gemm(xa, None, wb, None, K, offs, out, g_a, g_w, rows=a_rows)


def _gather(t, idx: torch.Tensor):
    """Rows ``idx`` of a 2-D NVFP4 operand (codes, scales, per-row outer scales, expansion)."""
    from dataclasses import replace

    g = t.global_scale
    exp = getattr(t, "expanded", None)
    return replace(
        t,
        data=t.data[idx],
        scale=t.scale[idx],
        global_scale=g.reshape(-1, 1)[idx] if g.numel() > 1 else g,
        shape=torch.Size((idx.numel(), t.shape[-1])),
        expanded=None if exp is None else exp[idx],
    )


# ----- the grouped weight gradient (ragged K) -----


def padded_segments(offsets: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """16-aligned token layout of the expert segments of ``num_rows`` sorted rows. Device ops only.

    Returns ``(padded_offsets, dest, length)``: ``padded_offsets`` int64 [E+1] (exclusive cumsum of
    ``ceil16(offsets[e+1] - offsets[e])``), ``dest`` int64 [num_rows] (row r of expert e goes to column
    ``padded_offsets[e] + r - offsets[e]``) and ``length = ceil16(num_rows + 15·E)``, a static bound of
    ``padded_offsets[E]`` (so nothing is read on the host).
    """
    E = offsets.numel() - 1
    dev = offsets.device
    counts = (offsets[1:] - offsets[:-1]).long()
    padded = torch.zeros(E + 1, dtype=torch.int64, device=dev)
    padded[1:] = torch.cumsum((counts + 15) // 16 * 16, 0)
    expert = torch.repeat_interleave(torch.arange(E, device=dev), counts, output_size=num_rows)
    dest = torch.arange(num_rows, device=dev) + (padded[:-1] - offsets[:-1].long())[expert]
    return padded, dest, padded_k(num_rows + 15 * E)


def pad_segments(
    rows: torch.Tensor, dest: torch.Tensor, length: int, gather: torch.Tensor | None = None
) -> torch.Tensor:
    """[length, C]: row r of ``rows`` (or of ``rows[gather]``) at position ``dest[r]``, zeros elsewhere."""
    src = rows if gather is None else rows.index_select(0, gather)
    return rows.new_zeros((length, rows.shape[1])).index_copy_(0, dest, src)


def _check_wgrad(a, b, offsets, out_dtype, validate):
    La, Lb = operand_k(a, "a"), operand_k(b, "b")
    if len(tuple(a.shape)) != 2 or len(tuple(b.shape)) != 2:
        raise ValueError(f"a must be [M, L] and b [N, L], got {tuple(a.shape)} and {tuple(b.shape)}")
    if La != Lb:
        raise ValueError(f"token dims differ: a has L={La}, b has L={Lb}")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {_OUT_DTYPES}, got {out_dtype}")
    if a.data.device != b.data.device or offsets.device != a.data.device:
        raise ValueError("a, b and offsets must be on one device")
    ha, hb = (getattr(getattr(t, "recipe", None), "hadamard", False) for t in (a, b))
    if bool(ha) != bool(hb):
        raise ValueError(
            "recipes do not fit: exactly one operand went through the Hadamard transform "
            f"(a: {ha!r}, b: {hb!r}); a·bᵀ is only preserved when both did (H·Hᵀ = I)"
        )
    if offsets.dtype.is_floating_point or offsets.dtype == torch.bool or offsets.dim() != 1:
        raise TypeError(f"offsets must be a 1-D integer tensor, got {offsets.dtype} {tuple(offsets.shape)}")
    if validate:
        o = offsets.long().cpu()
        if o.numel() < 1 or int(o[0]) != 0:
            raise ValueError("offsets must start at 0")
        if bool((o[1:] < o[:-1]).any()):
            raise ValueError("offsets must not decrease")
        if bool((o % 16 != 0).any()):
            raise ValueError(
                "offsets must be multiples of 16 (each expert segment starts a new 16-block; "
                "see padded_segments)"
            )
        if int(o[-1]) > La:
            raise ValueError(f"offsets[-1] = {int(o[-1])} is past the token dim L = {La}")
    M, N = a.shape[0], b.shape[0]
    return M, N, offsets.numel() - 1


def _outer_rows(t, rows: int, name: str) -> torch.Tensor:
    g = t.global_scale.float()
    if g.numel() == 1:
        return g.reshape(1)
    if g.numel() == rows:
        return g.reshape(rows)
    raise ValueError(
        f"{name}.global_scale has shape {tuple(g.shape)}: expected 1 element or one per row [{rows}, 1]"
    )


def grouped_wgrad_reference(a, b, offsets, *, out_dtype=torch.float32, validate: bool = True) -> torch.Tensor:
    """Loop over experts of fp64 ``A[:, s:t] · B[:, s:t]ᵀ`` on dequantized operands (host reads offsets);
    an empty expert gets zeros."""
    M, N, E = _check_wgrad(a, b, offsets, out_dtype, validate)
    for t, rows, name in ((a, M, "a"), (b, N, "b")):
        _outer_rows(t, rows, name)  # same outer-scale layouts as the kernel accepts
    av, bv = dequantize64(a), dequantize64(b)
    out = torch.zeros((E, M, N), dtype=torch.float64, device=a.data.device)
    o = offsets.long().tolist()
    for e in range(E):
        if o[e + 1] > o[e]:
            out[e] = av[:, o[e] : o[e + 1]] @ bv[:, o[e] : o[e + 1]].T
    return out.to(out_dtype)


def grouped_wgrad(
    a,
    b,
    offsets: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.float32,
    backend: str = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """All experts' ``out[e] = A[:, s_e:t_e] · B[:, s_e:t_e]ᵀ`` in one launch: a NVFP4 [M, L], b NVFP4 [N, L]
    (per-tensor or per-row outer scales), ``offsets`` int [E+1] on the device, multiples of 16 (checked
    with ``validate``, one host sync) → [E, M, N] of ``out_dtype``. See the module docstring."""
    which = _pick(backend, a.data.device)
    M, N, E = _check_wgrad(a, b, offsets, out_dtype, validate)
    if which == "reference":
        return grouped_wgrad_reference(a, b, offsets, out_dtype=out_dtype, validate=False)
    g_a, g_b = _outer_rows(a, M, "a"), _outer_rows(b, N, "b")
    L = padded_k(a.shape[-1])
    offs = offsets.contiguous()
    if which == "grouped_mm":
        acc = grouped_mm(expand(a, torch.bfloat16), expand(b, torch.bfloat16).t(), offs).float()
        acc = acc * (g_a if g_a.numel() == 1 else g_a[:, None])
        return (acc * (g_b if g_b.numel() == 1 else g_b[None, :])).to(out_dtype)
    from .grouped_triton import launch_grouped_wgrad

    out = torch.empty((E, M, N), dtype=out_dtype, device=a.data.device)
    if which == "triton":
        a_args = (a.data.reshape(M, L // 2), a.scale.reshape(M, L // 16))
        b_args = (b.data.reshape(N, L // 2), b.scale.reshape(N, L // 16))
    else:
        dtype = a.expanded.dtype if getattr(a, "expanded", None) is not None else torch.bfloat16
        a_args = (expand(a, dtype).reshape(M, L), None)
        b_args = (expand(b, dtype).reshape(N, L), None)
    return launch_grouped_wgrad(*a_args, *b_args, offs, out, g_a, g_b)
