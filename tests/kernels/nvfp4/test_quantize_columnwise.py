"""``quantize_columnwise`` (Triton, no transposed copy) vs the reference path ``quantize(Y)`` on the explicit
transposed / padded / gathered matrix Y: identical data bytes, scale bytes, outer scales, amax, expansion.

On CPU the kernels run under TRITON_INTERPRET=1 (conftest.py); bench_quantize.py --columnwise repeats the
check on the GPU at full size.
"""

import warnings
from dataclasses import replace

import pytest
import torch
from _same_bytes import assert_same_bytes

from triage.kernels.nvfp4 import PROFILES, QuantRecipe, quantize
from triage.kernels.nvfp4 import quantize_columns as qt
from triage.kernels.nvfp4.fuzz import adversarial
from triage.kernels.nvfp4.quantize_columns import columnwise_matrix, quantize_columnwise

DEV = "cuda" if torch.cuda.is_available() else "cpu"
warnings.filterwarnings("ignore", category=RuntimeWarning)  # numpy overflow/NaN casts in the interpreter
WGRAD = QuantRecipe(rounding="stochastic", hadamard=True, pad=True)  # the nvfp4-backward wgrad recipe


def bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def assert_identical(a, b, expanded_bits=True):
    assert a.shape == b.shape and a.dtype == b.dtype and a.recipe == b.recipe
    assert_same_bytes(a, b, a.recipe)
    assert (a.expanded is None) == (b.expanded is None)
    if a.expanded is not None:
        assert a.expanded.dtype == b.expanded.dtype and a.expanded.shape == b.expanded.shape
        nan = torch.isnan(a.expanded)
        assert torch.equal(nan, torch.isnan(b.expanded))
        if expanded_bits:  # vs the Triton row-major kernel: every bit, NaN payloads included
            assert torch.equal(bits(a.expanded), bits(b.expanded))
        else:  # vs torch's block_values().to(dtype): a NaN only has to be a NaN
            assert torch.equal(bits(a.expanded)[~nan], bits(b.expanded)[~nan])


def check(x, recipe, *, seed=None, gather=None, dest=None, length=None, emit=None, triton_ref=False, **kw):
    """quantize_columnwise(x) vs quantize(Y) on the torch reference (and, ``triton_ref``, on the row-major
    Triton kernel too)."""
    got = quantize_columnwise(
        x,
        recipe,
        seed=seed,
        gather=gather,
        dest=dest,
        length=length,
        emit_expanded=emit,
        backend="triton",
        **kw,
    )
    y = columnwise_matrix(x, gather=gather, dest=dest, length=length)
    assert_identical(got, quantize(y, recipe, backend="torch", seed=seed, emit_expanded=emit), False)
    if triton_ref:
        assert_identical(got, quantize(y, recipe, backend="triton", seed=seed, emit_expanded=emit))
    return got


def adversarial_x(tokens, channels, dtype=torch.bfloat16, seed=0):
    """x [tokens, channels] whose 16-token blocks along each channel (the blocks of Y = xᵀ) are the
    adversarial kinds of fuzz.py: zero, -0.0, one huge value, subnormal, constant, midpoints, NaN/±Inf."""
    return adversarial(channels, tokens, dtype=dtype, seed=seed, device=DEV).t().contiguous()


@pytest.mark.parametrize("profile", PROFILES)
def test_profiles_adversarial_tensor_and_row(profile):
    x = adversarial_x(64, 48, seed=PROFILES.index(profile))
    check(x, QuantRecipe(profile=profile, hadamard=True))
    check(x, QuantRecipe(profile=profile, scale="row", rounding="stochastic"), seed=11)


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"rounding": "stochastic", "seed": 2**32 - 1},
        {"hadamard": True},
        {"hadamard": True, "rounding": "stochastic"},
        {"hadamard": True, "scale": "row"},
        {"hadamard": True, "scale": "row", "rounding": "stochastic"},
        {"scale": "expert"},
        {"scale": "none"},
        {"scale_source": "static", "static_amax": 3.5},
        {"scale_source": "checkpoint", "checkpoint_scale": 0.02, "hadamard": True},
    ],
    ids=lambda v: "-".join(f"{k}={v[k]}" for k in v) or "default",
)
def test_te_variants_adversarial(variant):
    check(adversarial_x(48, 40, seed=len(variant)), QuantRecipe(**variant))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dtypes_and_emit_expanded(dtype):
    x = adversarial_x(32, 24, dtype=dtype, seed=5)
    for emit in (torch.bfloat16, torch.float16):
        check(x, WGRAD, seed=7, emit=emit, triton_ref=True)
    check(x, replace(WGRAD, scale="row", rounding="nearest", profile="compressed-tensors"))


def test_odd_channels_tiles_and_token_padding():
    """C not a multiple of the channel tile, several token tiles, T % 16 != 0 (pad=True: zero columns)."""
    x = torch.randn(37, 45, device=DEV).to(torch.bfloat16) * 3
    x[5, 7] = 4e4  # one huge value in a partial block
    x[36, :] = -0.0
    check(x, WGRAD, seed=1, block_c=32, block_t=16)  # 2 channel tiles (one partial), 3 token tiles
    check(x, replace(WGRAD, scale="row"), seed=1, emit=torch.bfloat16)
    check(x, QuantRecipe(pad=True), block_c=64)
    check(torch.randn(3, 5, device=DEV), replace(WGRAD, rounding="nearest"))  # one padded block
    with pytest.raises(ValueError, match="pad=True"):
        quantize_columnwise(torch.randn(20, 16, device=DEV), QuantRecipe(), backend="triton")


def test_amax_pass_multi_tile_programs(monkeypatch):
    """Programs of the amax pass that loop over several token tiles (and one past the end)."""
    monkeypatch.setattr(qt, "_amax_tiles", lambda n_t, n_c: 2)
    x = adversarial_x(48, 24, seed=3)  # 3 token tiles of 16 → 2 amax programs along tokens
    check(x, QuantRecipe(hadamard=True), block_t=16, block_c=16)
    check(x, QuantRecipe(hadamard=True, scale="row", profile="compressed-tensors"), block_t=16, block_c=16)


def _moe_layout(counts):
    from triage.kernels.moe.grouped_gemm import padded_segments

    offsets = torch.zeros(len(counts) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(counts).cumsum(0)
    return padded_segments(offsets.to(DEV), sum(counts))


@pytest.mark.parametrize(
    "counts", [[0, 5, 0, 17, 3, 0], [16, 0, 1, 16]], ids=["empty-first-mid-last", "full"]
)
def test_moe_layout_with_gather(counts):
    """The MoE wgrad layout: sorted rows scattered to 16-aligned segments (empty segments first, in the
    middle and last, an unused tail), x gathered from tokens with repeated rows."""
    _, dest, length = _moe_layout(counts)
    rows = sum(counts)
    gen = torch.Generator().manual_seed(4)
    dy = (torch.randn(rows, 40, generator=gen) * 2).to(torch.bfloat16).to(DEV)
    tokens = torch.randn(9, 24, generator=gen).to(torch.bfloat16).to(DEV)
    gather = torch.randint(0, 9, (rows,), generator=gen).to(DEV)  # repeats (rows > 9 tokens)
    check(dy, WGRAD, seed=5, dest=dest, length=length, emit=torch.bfloat16, triton_ref=True)
    check(tokens, replace(WGRAD, rounding="nearest"), gather=gather, dest=dest, length=length)
    check(tokens, replace(WGRAD, scale="row"), seed=9, gather=gather, dest=dest, length=length)
    check(tokens, QuantRecipe(hadamard=True, pad=True), gather=gather)  # gather without dest: x[gather]ᵀ


def test_all_padding_and_no_rows():
    """Every column zero (no rows scattered): the bytes of an all-zero Y, outer scale 1."""
    x = torch.randn(0, 24, device=DEV)
    dest = torch.zeros(0, dtype=torch.int64, device=DEV)
    t = check(x, WGRAD, seed=1, dest=dest, length=48)
    assert not t.data.any() and float(t.global_scale) == 1.0


def test_non_contiguous_inputs():
    base = torch.randn(48, 80, device=DEV).to(torch.bfloat16)
    check(base[:, ::2], WGRAD, seed=2)  # strided channels (handled in the kernel, no copy)
    check(base[::3], QuantRecipe(hadamard=True, scale="row"))  # strided rows
    check(base.t()[:, 16:48], WGRAD, seed=3)  # column-major: the row-major kernel's shortcut
    check(torch.randn(40, 32, device=DEV).t(), WGRAD, seed=4)  # x.t() contiguous: the shortcut


def test_block16x16_falls_back_to_the_reference_layout():
    x = torch.randn(32, 48, device=DEV)
    check(x, QuantRecipe(block="16x16"))


def test_argument_errors():
    x = torch.randn(32, 16, device=DEV)
    dest = torch.arange(32, device=DEV)
    with pytest.raises(ValueError, match="needs length"):
        quantize_columnwise(x, dest=dest)
    with pytest.raises(ValueError, match="entries"):
        quantize_columnwise(x, dest=dest[:5], length=32)
    with pytest.raises(ValueError, match="length"):
        quantize_columnwise(x, length=48)
    with pytest.raises(ValueError, match="2-D"):
        quantize_columnwise(x[0])
    with pytest.raises(ValueError, match="seed"):
        quantize_columnwise(x, seed=2**32)
    with pytest.raises(TypeError, match="dtype"):
        quantize_columnwise(x.double())


def test_moe_wgrad_new_path_equals_old_path_bitwise():
    """nvfp4_wgrad (columnwise quantizer on CUDA / under the interpreter) gives exactly the weight gradient
    of the old path (padded layout materialized, transposed, quantized), operands byte for byte."""
    from triage.kernels.moe.experts import NVFP4MoEConfig, nvfp4_wgrad
    from triage.kernels.moe.grouped_gemm import grouped_wgrad, pad_segments

    counts = [0, 7, 0, 20, 16, 0]
    offsets = torch.zeros(len(counts) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(counts).cumsum(0)
    offsets = offsets.to(DEV)
    padded, dest, length = _moe_layout(counts)
    rows = sum(counts)
    gen = torch.Generator().manual_seed(6)
    dy = torch.randn(rows, 16, generator=gen).to(torch.bfloat16).to(DEV)
    x = torch.randn(11, 32, generator=gen).to(torch.bfloat16).to(DEV)
    gather = torch.randint(0, 11, (rows,), generator=gen).to(DEV)
    w16 = QuantRecipe(scale="expert", block="16x16")
    for backend in ("triton_expanded", "triton"):
        cfg = NVFP4MoEConfig(backward="nvfp4-backward", weight=w16, gemm_backend=backend)
        new = nvfp4_wgrad(dy, x, offsets, cfg, 17, gather=gather)
        emit = torch.bfloat16 if backend == "triton_expanded" else None
        dyq = quantize(
            pad_segments(dy, dest, length).t().contiguous(), cfg.wgrad, seed=17, emit_expanded=emit
        )
        xq = quantize(
            pad_segments(x, dest, length, gather).t().contiguous(),
            replace(cfg.wgrad, rounding="nearest"),
            emit_expanded=emit,
        )
        old = grouped_wgrad(dyq, xq, padded, backend=backend, validate=False)
        assert torch.equal(new, old), backend
        assert_identical(
            quantize_columnwise(
                dy, cfg.wgrad, seed=17, dest=dest, length=length, emit_expanded=emit, backend="triton"
            ),
            dyq,
            expanded_bits=False,
        )


def test_dense_nvfp4_backward_wgrad_operands_columnwise():
    """NVFP4Linear nvfp4-backward: the wgrad operands quantized columnwise by Triton (no transposed copy)
    give exactly the gradients of the torch-reference quantizer on the explicit transposes; the token count
    (21) is not a multiple of 16 (pad=True)."""
    from triage.kernels.linear import NVFP4Linear, NVFP4LinearConfig

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 7, 32, generator=gen).to(DEV)
    dy = torch.randn(3, 7, 16, generator=gen).to(DEV)
    grads = []
    for qb in ("torch", "triton"):
        cfg = NVFP4LinearConfig(backward="nvfp4-backward", quant_backend=qb, gemm_backend="reference")
        torch.manual_seed(0)
        layer = NVFP4Linear(32, 16, bias=False, config=cfg).to(DEV)
        xi = x.clone().requires_grad_(True)
        layer(xi).backward(dy)
        grads.append((xi.grad, layer.weight.grad))
    assert torch.equal(grads[0][1], grads[1][1]) and grads[0][1].abs().sum() > 0
    assert torch.equal(grads[0][0], grads[1][0])


def test_a_columns_plan_never_serves_another_signature():
    """Consecutive calls whose signatures differ in one thing each (dtype, outer scale, static scale,
    expansion, a gather map, length) each give the reference bytes: no plan
    (:func:`~triage.kernels.nvfp4.quantize_columns.columns_plan`) serves another signature."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, 24, generator=g).to(DEV)
    pad = QuantRecipe(pad=True)
    gather = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2], device=DEV)
    for xi, recipe, kw in [
        (x, pad, {}),
        (x.bfloat16(), pad, {}),
        (x, replace(pad, scale="row"), {}),
        (x, replace(pad, scale_source="static", static_amax=3.0), {}),
        (x, pad, {"emit": torch.bfloat16}),
        (x, pad, {"gather": gather}),
        (x[:, :16], pad, {}),
    ]:
        check(xi, recipe, **kw)


@pytest.mark.skipif(DEV != "cpu" or not qt.interpreting(), reason="meta tensors take Triton under the interpreter")
@pytest.mark.parametrize("scale", ["tensor", "row", "static"])
def test_a_columnwise_call_never_reads_device_data_on_the_host(monkeypatch, scale):
    """On a meta x (any host read raises) with the launches stubbed, twice (plan built, then run)."""

    class NoLaunch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    monkeypatch.setattr(qt, "_amax_colwise_kernel", NoLaunch())
    monkeypatch.setattr(qt, "_quantize_colwise_kernel", NoLaunch())
    recipe = QuantRecipe(scale_source="static", static_amax=2.0) if scale == "static" else QuantRecipe(scale=scale)
    x = torch.empty(48, 32, device="meta", dtype=torch.bfloat16)
    for _ in range(2):
        q = quantize_columnwise(x, recipe, backend="triton", emit_expanded=torch.bfloat16)
        assert q.data.shape == (32, 24) and q.expanded.shape == (32, 48)
