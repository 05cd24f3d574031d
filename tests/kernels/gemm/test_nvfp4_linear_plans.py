"""NVFP4Linear's per-signature call plans: a plan never serves another shape or dtype, and a call never reads
device data on the host (no sync)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _dense_operands import device

from triage.kernels import NVFP4Linear, NVFP4LinearConfig
from triage.kernels.nvfp4 import QuantRecipe
from triage.kernels.nvfp4.device import interpreting

# the Triton quantizers (interpreted on CPU): the path that runs the cached plans
CFG = NVFP4LinearConfig(quant_backend="triton", gemm_backend="triton")


def _layer(config, seed=0) -> NVFP4Linear:
    torch.manual_seed(seed)
    return NVFP4Linear(48, 80, config=config, device=device())


def _call(layer, x, dy):
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(dy)
    grads = (x.grad, layer.weight.grad, layer.bias.grad)
    layer.zero_grad(set_to_none=True)
    return y.detach(), grads


@pytest.mark.parametrize("backward", ["bf16-backward", "nvfp4-backward"])
def test_outputs_and_grads_do_not_depend_on_the_calls_before(backward):
    """One layer called with changing shapes (decode-sized and large M, 2-D and 3-D), dtypes and
    activation scales gives, call by call, the bits a fresh layer gives on that call alone."""
    cfg = dataclasses.replace(CFG, backward=backward)
    # a dtype change alone, then the same rows in another lead shape, then large M (the expansions' path)
    signatures = [((2, 9, 48), torch.float32), ((2, 9, 48), torch.float16), ((9, 2, 48), torch.float32),
                  ((70, 48), torch.float32)]  # fmt: skip
    layer = _layer(cfg)
    for i, (shape, dtype) in enumerate(signatures):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(shape, generator=g).to(dtype).to(device())
        dy = torch.randn((*shape[:-1], 80), generator=g).to(dtype).to(device())
        fresh = _layer(cfg)
        fresh._grad_calls[0] = layer._grad_calls[0]  # the same stochastic-rounding seeds
        y, grads = _call(layer, x, dy)
        y_ref, grads_ref = _call(fresh, x, dy)
        assert y.shape == (*shape[:-1], 80) and y.dtype == dtype
        assert torch.equal(y, y_ref), (shape, dtype)
        for got, ref in zip(grads, grads_ref):
            assert got.dtype == ref.dtype and torch.equal(got, ref), (shape, dtype)
    # a new config (same signatures) is a new plan
    layer.config = dataclasses.replace(cfg, activation=QuantRecipe(scale="row"))
    x = torch.randn(2, 9, 48, generator=torch.Generator().manual_seed(9)).to(device())
    fresh = _layer(layer.config)
    with torch.no_grad():
        assert torch.equal(layer(x), fresh(x))


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _stub_kernels(monkeypatch) -> None:
    import importlib

    for name in ("quantize_rows", "quantize_columns", "dequantize_rows", "gemm_dense", "gemm_decode"):
        module = importlib.import_module(f"triage.kernels.nvfp4.{name}")
        for attr in dir(module):
            if type(getattr(module, attr)).__name__ in ("JITFunction", "InterpretedFunction", "FastLaunch"):
                monkeypatch.setattr(module, attr, _NoLaunch())


@pytest.mark.skipif(not interpreting(), reason="meta tensors take the Triton path under the interpreter only")
@pytest.mark.parametrize("backward", ["bf16-backward", "nvfp4-backward"])
@pytest.mark.parametrize("scale", ["tensor", "row"])
@pytest.mark.parametrize("rows", [16, 128])
def test_a_call_never_reads_device_data_on_the_host(monkeypatch, backward, scale, rows):
    """Forward and backward on meta tensors (no data: any ``.item()``/``float(t)``/``bool(t)`` raises, as
    it would sync on CUDA) with every Triton launch stubbed: the host path alone, twice per signature
    (the first call builds the plan, the second runs it)."""
    _stub_kernels(monkeypatch)
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: syncs.append(1))
    cfg = dataclasses.replace(CFG, backward=backward, activation=QuantRecipe(scale=scale))
    layer = NVFP4Linear(64, 96, device="meta", dtype=torch.bfloat16, config=cfg)
    for _ in range(2):
        x = torch.empty(rows, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
        y = layer(x)
        y.backward(torch.empty_like(y))
        assert x.grad.shape == x.shape and layer.weight.grad.shape == layer.weight.shape
    assert not syncs


@pytest.mark.skipif(not interpreting(), reason="meta tensors take the Triton path under the interpreter only")
def test_the_no_sync_check_sees_a_host_read(monkeypatch):
    """The check above can fail: cuBLAS takes the weight's scale as a host alpha (one device read)."""
    _stub_kernels(monkeypatch)
    layer = NVFP4Linear(64, 96, device="meta", config=dataclasses.replace(CFG, gemm_backend="cublas"))
    with pytest.raises((RuntimeError, NotImplementedError)):
        layer(torch.empty(128, 64, device="meta"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: the quantizer's paired fast path
@pytest.mark.parametrize("backward", ["bf16-backward", "nvfp4-backward"])
@pytest.mark.parametrize("scale", ["tensor", "row"])
def test_decode_sized_calls_take_the_activation_expansion_from_the_quantizer(monkeypatch, backward, scale, dtype):
    """At decode size the GEMMs run the decode kernel, which reads the activation (x, and dy in the dgrad) as
    its exact fp16 q·s: the quantizer writes it with the codes, so no separate expansion pass runs, and the
    output and gradients are the bits of quantizing, expanding and multiplying step by step."""
    from triage.kernels.linear import nan_if_nonfinite, transpose_16x16
    from triage.kernels.nvfp4 import dequantize_rows, quantize
    from triage.kernels.nvfp4.matmul import decode_route, gemm

    assert decode_route("triton", 9, device())
    cfg = dataclasses.replace(CFG, backward=backward, activation=QuantRecipe(scale=scale))
    layer = _layer(cfg).to(dtype)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(9, 48, generator=g).to(dtype).to(device())
    dy = torch.randn(9, 80, generator=g).to(dtype).to(device())
    with torch.no_grad():  # step by step: each operand quantized alone, the GEMM expands it itself
        xq = nan_if_nonfinite(quantize(x, cfg.activation, backend="triton"), x)
        wq = nan_if_nonfinite(quantize(layer.weight, cfg.weight, backend="triton"), layer.weight)
        y_ref = gemm(xq, wq, out_dtype=x.dtype, bias=layer.bias, backend="triton")
        if backward == "nvfp4-backward":  # the layer's first backward draws dy's seed grad.seed + 2
            dyq = nan_if_nonfinite(quantize(dy, cfg.grad, backend="triton", seed=cfg.grad.seed + 2), dy)
            dx_ref = gemm(dyq, transpose_16x16(wq), out_dtype=x.dtype, backend="triton")
        else:
            dx_ref = (dy @ layer.weight.to(dy.dtype)).to(x.dtype)
    expansions = []
    real = dequantize_rows.expand_triton
    monkeypatch.setattr(
        dequantize_rows, "expand_triton", lambda *a, **k: expansions.append(a[0].shape) or real(*a, **k)
    )
    y, grads = _call(layer, x, dy)
    assert torch.equal(y, y_ref)
    assert torch.equal(grads[0], dx_ref)
    assert all(torch.isfinite(t).all() for t in grads)
    assert expansions == [], expansions
