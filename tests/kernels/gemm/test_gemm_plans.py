"""``gemm``'s per-signature plans (:class:`~triage.kernels.nvfp4.matmul.GemmPlan`): a plan never serves
another signature, and a call never reads device data on the host (no sync)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _dense_operands import device, random_nvfp4

from triage.kernels.nvfp4 import QuantRecipe, expand, gemm
from triage.kernels.nvfp4 import matmul as mm
from triage.kernels.nvfp4.device import interpreting
from triage.kernels.nvfp4.tensor import NVFP4Tensor


def _fresh(a, b, **kw) -> torch.Tensor:
    """``gemm`` with an empty plan cache: the plan built for this call alone."""
    saved = dict(mm._GEMM_PLANS)
    mm._GEMM_PLANS.clear()
    try:
        return gemm(a, b, **kw)
    finally:
        mm._GEMM_PLANS.clear()
        mm._GEMM_PLANS.update(saved)


def test_a_plan_never_serves_another_signature():
    """Calls whose signatures differ in one thing each (M across the decode / large-M split, lead shape,
    per-row vs per-tensor outer scale, out dtype, bias, a cached expansion of either operand, backend) give,
    call by call, the bits of a plan built for that call alone."""
    g = torch.Generator().manual_seed(0)
    b = random_nvfp4((16, 32), gen=g)
    b_exp = expand(b)
    bias = torch.randn(16, generator=g).to(device())
    a16 = random_nvfp4((16, 32), gen=g)
    a70 = random_nvfp4((70, 32), gen=g)  # > SMALL_M rows
    a70_row = random_nvfp4((70, 32), gen=g, scale="row")
    a70_exp = replace(a70, expanded=expand(a70))
    a3d = replace(a70, data=a70.data.reshape(7, 10, 16), scale=a70.scale.reshape(7, 10, 2), shape=torch.Size((7, 10, 32)))
    calls = [
        (a16, {}),
        (a70, {}),  # large M: the GEMM on expansions
        (a3d, {}),  # same rows, another lead shape
        (a70_row, {}),  # per-row outer scale
        (replace(a70, global_scale=a70_row.global_scale), {}),  # the same recipe with per-row values
        (a70, {"out_dtype": torch.float32}),
        (a70, {"bias": bias}),
        (a70_exp, {}),  # a's expansion written by the quantizer
        (a70, {"b_expanded": b_exp}),
        (a16, {"b_scale_host": float(b.global_scale)}),
        (a70, {"backend": "reference"}),
        (a70, {"backend": "cublas"}),  # per-tensor scales as alpha
        (a70_row, {"backend": "cublas"}),  # per-row: fp32 output, torch epilogue
        (a70, {"backend": "cublas", "b_scale_host": float(b.global_scale)}),
        (a16, {"out_dtype": torch.float16, "bias": bias}),
    ]
    for a, kw in calls:
        kw = {"backend": "triton", **kw}
        y = gemm(a, b, **kw)
        ref = _fresh(a, b, **kw)
        assert y.shape == ref.shape == (*a.shape[:-1], 16) and y.dtype == ref.dtype, kw
        assert torch.equal(y, ref), kw


def test_bad_operands_are_never_cached():
    """A signature that fails a check raises on every call (it is not kept), naming the operand."""
    g = torch.Generator().manual_seed(1)
    a, b = random_nvfp4((16, 64), gen=g), random_nvfp4((48, 32), gen=g)
    for _ in range(2):
        with pytest.raises(ValueError, match="reduction dims differ"):
            gemm(a, b, backend="triton")
    with pytest.raises(TypeError, match="b must be an NVFP4Tensor"):
        gemm(a, torch.zeros(48, 64), backend="triton")
    # a signature that passed keeps no check from running on the next one
    b = random_nvfp4((48, 64), gen=g)
    gemm(a, b, backend="triton", bias=torch.zeros(48, device=device()))
    with pytest.raises(ValueError, match="bias must have shape"):
        gemm(a, b, backend="triton", bias=torch.zeros(47, device=device()))
    with pytest.raises(ValueError, match="out_dtype must be one of"):
        gemm(a, b, backend="triton", out_dtype=torch.int32)


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _stub_kernels(monkeypatch) -> None:
    import importlib

    for name in ("quantize_columns", "dequantize_rows", "gemm_dense", "gemm_decode"):
        module = importlib.import_module(f"triage.kernels.nvfp4.{name}")
        for attr in dir(module):
            if type(getattr(module, attr)).__name__ in ("JITFunction", "InterpretedFunction", "FastLaunch"):
                monkeypatch.setattr(module, attr, _NoLaunch())


def _meta_operand(rows: int, k: int, recipe: QuantRecipe) -> NVFP4Tensor:
    g_shape = (rows, 1) if recipe.scale == "row" else ()
    return NVFP4Tensor(
        data=torch.empty(rows, k // 2, dtype=torch.uint8, device="meta"),
        scale=torch.empty(rows, k // 16, dtype=torch.float8_e4m3fn, device="meta"),
        global_scale=torch.empty(g_shape, device="meta"),
        recipe=recipe,
        shape=torch.Size((rows, k)),
        dtype=torch.bfloat16,
    )


@pytest.mark.skipif(not interpreting(), reason="meta tensors take the Triton path under the interpreter only")
@pytest.mark.parametrize("rows", [16, 128])
@pytest.mark.parametrize(
    "scale, backend", [("tensor", "triton"), ("row", "triton"), ("static", "cublas")], ids=["tensor", "row", "alpha"]
)
def test_a_call_never_reads_device_data_on_the_host(monkeypatch, rows, scale, backend):
    """``gemm`` on meta operands (any host read of their data raises) with every Triton launch stubbed,
    twice per signature (the first call builds the plan, the second runs it): the decode and dense Triton
    routes, and cuBLAS's alpha route where both outer scales are host-known (a static activation scale,
    the weight's given as ``b_scale_host``)."""
    _stub_kernels(monkeypatch)
    recipe = QuantRecipe(scale_source="static", static_amax=2.0) if scale == "static" else QuantRecipe(scale=scale)
    a, b = _meta_operand(rows, 64, recipe), _meta_operand(96, 64, QuantRecipe(block="16x16"))
    for _ in range(2):
        y = gemm(a, b, backend=backend, b_scale_host=1.5)
        assert y.shape == (rows, 96) and y.device.type == "meta"


@pytest.mark.skipif(not interpreting(), reason="meta tensors take the Triton path under the interpreter only")
def test_the_no_sync_check_sees_a_host_read(monkeypatch):
    """The check above can fail: a dynamic activation scale on cuBLAS's alpha route is read on the host."""
    _stub_kernels(monkeypatch)
    a, b = _meta_operand(128, 64, QuantRecipe()), _meta_operand(96, 64, QuantRecipe(block="16x16"))
    with pytest.raises((RuntimeError, NotImplementedError)):
        gemm(a, b, backend="cublas", b_scale_host=1.5)


def test_host_scales_false_routes(monkeypatch):
    """``gemm_plan(host_scales=False)`` (a capturable NVFP4Linear's GEMMs) never takes cuBLAS's host alpha
    for a scale the recipes do not fix: ``"auto"`` runs the Triton GEMM (the bits of ``backend="triton"``),
    ``"cublas"`` cuBLAS with an fp32 output and the scales applied on the device (the reference's value
    within fp32 rounding); with both scales recipe-given the alpha route stays (nothing to read)."""
    # On CUDA, "auto" itself sends a GEMM below SYNC_FREE_MAX_FLOP with a dynamic per-tensor activation scale
    # to the sync-free Triton GEMM (the host read of the alpha would stall the launch queue); the interpreter
    # has no such rule. A zero threshold gives this small GEMM the large-GEMM route on both (cuBLAS's alpha,
    # read on the host), which host_scales=False must then leave; fresh plan caches (the threshold is read
    # when a plan is built).
    monkeypatch.setattr(mm, "SYNC_FREE_MAX_FLOP", 0)
    monkeypatch.setattr(mm, "SYNC_FREE_MAX_FLOP_TMA", 0)
    monkeypatch.setattr(mm, "_GEMM_PLANS", {})
    g = torch.Generator().manual_seed(4)
    a, b = random_nvfp4((70, 32), gen=g), random_nvfp4((16, 32), gen=g)  # > SMALL_M rows
    auto = mm.gemm_plan(a, b, backend="auto", host_scales=False)
    assert mm.gemm_plan(a, b, backend="auto").route == "alpha" and auto.route == "dense"
    assert torch.equal(auto.run(a, b), _fresh(a, b, backend="triton"))
    cublas = mm.gemm_plan(a, b, backend="cublas", out_dtype=torch.float32, host_scales=False)
    assert cublas.route == "scaled"
    ref = mm.gemm_reference(a, b, out_dtype=torch.float64)
    assert torch.allclose(cublas.run(a, b).double(), ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())
    static = QuantRecipe(scale_source="static", static_amax=2.0)
    a_s, b_s = replace(a, recipe=static), replace(b, recipe=replace(static, block="16x16"))
    assert mm.gemm_plan(a_s, b_s, backend="cublas", host_scales=False).route == "alpha"
    with pytest.raises(ValueError, match="b_scale_host must be None"):
        mm.gemm_plan(a, b, backend="auto", b_scale_host=1.5, host_scales=False)


@pytest.mark.skipif(not interpreting(), reason="meta tensors take the Triton path under the interpreter only")
@pytest.mark.parametrize("backend", ["auto", "cublas"])
def test_host_scales_false_reads_nothing_on_the_host(monkeypatch, backend):
    """``test_the_no_sync_check_sees_a_host_read``'s operands (a dynamic activation scale at 128 rows)
    planned with ``host_scales=False``: no host read (meta operands, launches stubbed), twice per signature."""
    _stub_kernels(monkeypatch)
    a, b = _meta_operand(128, 64, QuantRecipe()), _meta_operand(96, 64, QuantRecipe(block="16x16"))
    for _ in range(2):
        y = mm.gemm_plan(a, b, backend=backend, host_scales=False).run(a, b)
        assert y.shape == (128, 96) and y.device.type == "meta"
