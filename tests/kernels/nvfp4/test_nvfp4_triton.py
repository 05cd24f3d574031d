"""Triton kernels vs the torch reference: identical data bytes, scale bytes and outer scales, every profile.

On CPU the kernels run under TRITON_INTERPRET=1 (set in conftest.py); the GPU script
experiments/bench/bench_quantize.py repeats the check on >= 1e6 blocks per profile.
"""

import warnings

import pytest
import torch
from _same_bytes import assert_same_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from triage.kernels.nvfp4 import PROFILES, QuantRecipe, dequantize, quantize
from triage.kernels.nvfp4.fuzz import adversarial, midpoint_tensor
from triage.kernels.nvfp4.hadamard import hadamard16

DEV = "cuda" if torch.cuda.is_available() else "cpu"
warnings.filterwarnings("ignore", category=RuntimeWarning)  # numpy overflow/NaN casts in the interpreter


def assert_same(x, recipe, seed=None):
    a = quantize(x, recipe, backend="torch", seed=seed)
    b = quantize(x, recipe, backend="triton", seed=seed)
    assert_same_bytes(a, b, recipe)
    return a, b


def assert_same_values(u, v):
    nan = torch.isnan(u)
    assert torch.equal(nan, torch.isnan(v))
    assert torch.equal(u[~nan], v[~nan])


VARIANTS = [
    {},
    {"scale": "row"},
    {"scale": "expert"},
    {"scale": "none"},
    {"scale_source": "static", "static_amax": 3.5},
    {"scale_source": "checkpoint", "checkpoint_scale": 0.02},
    {"block": "16x16"},
    {"block": "16x16", "scale": "expert"},
    {"rounding": "stochastic", "seed": 5},
    {"rounding": "stochastic", "scale": "row", "seed": 2**32 - 1},
    {"hadamard": True},
    {"hadamard": True, "block": "16x16", "rounding": "stochastic"},
    {"hadamard": True, "scale": "row"},
    {"hadamard": True, "scale": "expert"},
    {"hadamard": True, "scale": "row", "rounding": "stochastic", "seed": 7},
    {"hadamard": True, "scale_source": "static", "static_amax": 3.5},
]


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(f"{k}={v[k]}" for k in v) or "default")
def test_triton_matches_reference_adversarial(profile, variant):
    x = adversarial(48, 96, seed=len(variant), device=DEV).reshape(3, 16, 96)
    assert_same(x, QuantRecipe(profile=profile, **variant))


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_triton_matches_reference_dtypes(profile, dtype):
    x = adversarial(32, 64, dtype=dtype, seed=3, device=DEV)
    assert_same(x, QuantRecipe(profile=profile))
    assert_same(x, QuantRecipe(profile=profile, hadamard=True, scale="row"))


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("hadamard", [False, True])
def test_triton_midpoints(profile, hadamard):
    x = midpoint_tensor(32, 128, seed=2, hadamard=hadamard).to(DEV)
    if hadamard:  # the rotated values are the midpoint tensor (first block 2688, 0, ...): still on ties
        y = midpoint_tensor(32, 128, seed=2)
        y[0, 1:16] = 0.0
        assert torch.equal(hadamard16(x), y.to(DEV))
    assert_same(x, QuantRecipe(profile=profile, hadamard=hadamard))


def test_triton_odd_shapes_padding_noncontiguous():
    x = torch.randn(37, 50, device=DEV)
    assert_same(x, QuantRecipe(pad=True))
    assert_same(x, QuantRecipe(pad=True, scale="row", rounding="stochastic"))
    assert_same(torch.randn(1, 16, device=DEV), QuantRecipe())
    assert_same(torch.randn(16, device=DEV), QuantRecipe(scale="row"))
    y = torch.randn(64, 33, device=DEV).t()  # non-contiguous [33, 64]
    assert_same(y, QuantRecipe(block="16x16"))
    assert_same(torch.randn(2, 3, 20, 48, device=DEV), QuantRecipe(block="16x16", scale="expert"))


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("scale", ["tensor", "row", "expert"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_dequantize_matches(profile, scale, dtype):
    x = adversarial(32, 80, seed=9, device=DEV)
    t = quantize(x, QuantRecipe(profile=profile, scale=scale), backend="torch")
    assert_same_values(dequantize(t, dtype, backend="torch"), dequantize(t, dtype, backend="triton"))


@pytest.mark.parametrize("profile", PROFILES)
def test_triton_fuzz_many_blocks(profile):
    """>= 1e5 blocks per profile in one launch each (4e5 over the four profiles), random + adversarial."""
    x = adversarial(256, 6400, seed=100 + PROFILES.index(profile), device=DEV)  # 102,400 blocks
    recipe = QuantRecipe(profile=profile, scale="row" if profile in ("te", "modelopt") else "tensor")
    assert_same(x, recipe)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.integers(1, 40),
    nblk=st.integers(1, 5),
    profile=st.sampled_from(PROFILES),
    scale=st.sampled_from(["tensor", "row", "none", "expert"]),
    block=st.sampled_from(["1x16", "16x16"]),
    rounding=st.sampled_from(["nearest", "stochastic"]),
    hadamard=st.booleans(),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    seed=st.integers(0, 2**31),
)
def test_triton_matches_reference_hypothesis(
    rows, nblk, profile, scale, block, rounding, hadamard, dtype, seed
):
    if block == "16x16" and scale == "row":
        scale = "tensor"
    x = adversarial(rows, 16 * nblk, dtype=dtype, seed=seed % 1000, device=DEV)
    recipe = QuantRecipe(profile=profile, scale=scale, block=block, rounding=rounding, hadamard=hadamard)
    assert_same(x, recipe, seed=seed)


def test_triton_backend_errors_on_cpu_without_interpreter(monkeypatch):
    from triage.kernels.nvfp4 import device

    monkeypatch.setattr(device, "interpreting", lambda: False)
    if DEV == "cpu":
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            quantize(torch.randn(2, 16), backend="triton")
    assert device.available(torch.device("cpu")) is False


@pytest.mark.parametrize("spelling", ["true", "ON"])
def test_triton_backend_follows_tritons_own_interpreter_switch(monkeypatch, spelling):
    """``TRITON_INTERPRET`` as Triton reads it (a boolean: ``true``, ``on``, ... as well as ``1``) is the one
    rule for the quantizer, the dequantizer and the GEMMs alike: CPU tensors then run the kernels."""
    if torch.cuda.is_available():
        pytest.skip("the CPU interpreter rule")
    monkeypatch.setenv("TRITON_INTERPRET", spelling)
    x = adversarial(4, 32, seed=3)
    t = quantize(x, QuantRecipe(), backend="triton")
    assert_same_bytes(quantize(x, QuantRecipe(), backend="torch"), t, QuantRecipe())
    assert_same_values(dequantize(t, backend="triton"), dequantize(t, backend="torch"))


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize(
    "variant",
    [{}, {"scale": "row"}, {"block": "16x16"}, {"rounding": "stochastic", "seed": 11},
     {"scale_source": "static", "static_amax": 3.5}, {"hadamard": True},
     {"hadamard": True, "scale": "row", "rounding": "stochastic", "seed": 11}],
    ids=lambda v: "-".join(f"{k}={v[k]}" for k in v) or "default",
)  # fmt: skip
def test_triton_bf16_pair_fast_path(profile, variant):
    """The bf16 fast path (int32 pairs, whole blocks per thread; bf16, K % 16 == 0; Hadamard in registers)
    against the reference and the general path, bytes and emit_expanded: several K chunks with a partial last
    chunk (K = 16·21 with 8-block chunks), rows not a multiple of the tile, non-contiguous input, and shapes
    that fall back (fp16, K % 16 != 0, an odd storage offset)."""
    from triage.kernels.nvfp4.quantize_rows import quantize_triton

    x = adversarial(37 if "block" not in variant else 48, 16 * 21, seed=21, device=DEV)
    assert x.dtype == torch.bfloat16
    recipe = QuantRecipe(profile=profile, **variant)
    had = variant.get("hadamard", False)
    ref = quantize(x, recipe, backend="torch")
    # Hadamard: one multi-chunk tiling (the rest of the loop machinery is the same as without), to save time
    tiles = ({"block_rows": 32, "block_k": 128},) if had else ({}, {"block_rows": 16, "block_k": 128})
    for kw in tiles:
        fast = quantize_triton(x, recipe, pairs=True, **kw)
        slow = quantize_triton(x, recipe, pairs=False, **kw)
        for t in (fast, slow):
            assert torch.equal(t.data, ref.data) and torch.equal(
                t.scale.view(torch.uint8), ref.scale.view(torch.uint8)
            )
            assert torch.equal(t.global_scale.nan_to_num(-1.0), ref.global_scale.nan_to_num(-1.0))
    # the expansion written chunk by chunk: one dtype (where it lands does not depend on it; both dtypes' values
    # on the fast path: test_nvfp4_expanded.py), against the general path and the reference's block values
    e1 = quantize_triton(x, recipe, pairs=True, emit_expanded=torch.float16, **tiles[-1])
    e2 = quantize_triton(x, recipe, pairs=False, emit_expanded=torch.float16, **tiles[-1])
    assert torch.equal(e1.expanded.view(torch.int16), e2.expanded.view(torch.int16))
    assert_same_values(e1.expanded, ref.block_values().to(torch.float16))
    assert torch.equal(e1.data, ref.data)
    # not eligible: the fast path must fall back (and still be exact); fp16 + Hadamard: test_..._dtypes
    if not had:
        assert_same(adversarial(20, 48, dtype=torch.float16, seed=4, device=DEV), recipe)
    if "block" not in variant:
        assert_same(x[:, :40], QuantRecipe(profile=profile, pad=True, **variant))  # K % 16 != 0
    if had:
        assert_same(x.t().contiguous().t(), recipe)  # non-contiguous: copied, then the fast path
        assert_same(x.flatten()[1 : 1 + 36 * 336].view(36, 336), recipe)  # odd offset: the general path


_FEW_ROWS_VARIANTS = [
    {}, {"scale": "row"}, {"rounding": "stochastic", "seed": 5}, {"hadamard": True},
    {"hadamard": True, "scale": "row"}, {"scale_source": "static", "static_amax": 3.5},
]  # fmt: skip


@pytest.mark.parametrize(
    "profile,variant",
    # each variant with a sign-bit profile (te / torchao) and another (modelopt / compressed-tensors), each
    # profile three times: the tiles do not touch the profiles' scale rules (every profile × variant on the
    # default tiles: test_triton_bf16_pair_fast_path)
    [(PROFILES[(i + j) % 4], v) for i, v in enumerate(_FEW_ROWS_VARIANTS) for j in (0, 2)],
    ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}={v[k]}" for k in v) or "default",
)
def test_triton_few_rows_tiles(profile, variant):
    """The decode-sized tiles (one row per program, :data:`FEW_ROWS`): the same bytes as the reference on the
    fast and the general path, with the row swept in one step or in several (a partial last one), the
    expansion included; on a GPU they are the default for ≤ FEW_ROWS rows."""
    from triage.kernels.nvfp4.quantize_rows import quantize_triton

    recipe = QuantRecipe(profile=profile, **variant)
    # one partial 512-block step, or several 32-block steps (the last partial); on a GPU host K = 4800 takes
    # the default 512 blocks × 8 warps (K = 336: 32 blocks × 4 warps); the interpreter, which picks its own
    # default tiles, sweeps K = 1200 the same ways at a quarter of the cost
    k1 = 16 * (300 if DEV == "cuda" else 75)
    for rows, k, steps in ((1, k1, (512, 32)), (3, 16 * 21, (32, 8))):
        x = adversarial(rows, k, seed=30 + rows, device=DEV)
        ref = quantize(x, recipe, backend="torch")
        # explicit one-row tiles (one step, several steps), and the default
        for tiles in [{"block_rows": 1, "block_k": 16 * nb} for nb in steps] + [{}]:
            for pairs in (True, False):
                t = quantize_triton(x, recipe, pairs=pairs, emit_expanded=torch.float16, **tiles)
                assert_same_bytes(ref, t, recipe)
                assert_same_values(t.expanded, ref.block_values().to(torch.float16))


def test_few_rows_tile_rule(monkeypatch):
    """On a GPU (not the interpreter) up to FEW_ROWS rows get one row per program (8 warps from 256 blocks, 4
    below); more rows the bandwidth tiles; 16x16 blocks keep 16-row tiles; a tile given in part is completed
    from the many-rows rule; the Hadamard amax pass gets the tile's warps."""
    from triage.kernels.nvfp4 import quantize_rows as qr

    monkeypatch.setattr(qr, "interpreting", lambda: False)
    bf = torch.bfloat16
    assert qr._default_tiles(QuantRecipe(scale="row"), 9728, True, 16) == (1, 512, 8)
    assert qr._default_tiles(QuantRecipe(), 2560, False, qr.FEW_ROWS) == (1, 256, 8)
    assert qr._default_tiles(QuantRecipe(), 2560, True, qr.FEW_ROWS + 1) == (8, 32, None)
    assert qr._default_tiles(QuantRecipe(block="16x16"), 2560, True, 16) == (16, 16, None)
    plan = qr.rows_plan(torch.Size((1, 2560)), bf, QuantRecipe(scale="row"), None, True, None, None, None, False)
    assert plan.grid == (1, 1) and plan.constexprs["BR"] == 1 and plan.constexprs["num_warps"] == 8
    plan = qr.rows_plan(torch.Size((4096, 2560)), bf, QuantRecipe(scale="row"), None, True, None, None, None, False)
    assert plan.grid == (512, 1) and "num_warps" not in plan.constexprs
    assert qr._default_tiles(QuantRecipe(), 64, True, 16) == (1, 4, 4)  # a short row: fewer warps
    # a tile given in part is completed from the many-rows rule, never mixed with the few-rows one
    plan = qr.rows_plan(torch.Size((16, 9728)), bf, QuantRecipe(), None, True, 8, None, None, False)
    assert (plan.constexprs["BR"], plan.constexprs["NB"]) == (8, 32) and "num_warps" not in plan.constexprs
    plan = qr.rows_plan(torch.Size((16, 9728)), bf, QuantRecipe(), None, True, None, 512, None, False)
    assert (plan.constexprs["BR"], plan.constexprs["NB"]) == (8, 32) and "num_warps" not in plan.constexprs
    plan = qr.rows_plan(torch.Size((16, 9728)), bf, QuantRecipe(), None, True, None, None, 4, False)
    assert (plan.constexprs["BR"], plan.constexprs["NB"], plan.constexprs["num_warps"]) == (1, 512, 4)
    # the Hadamard amax pass (per-tensor scale) runs the quantizer's tile with its warps
    plan = qr.rows_plan(torch.Size((16, 9728)), bf, QuantRecipe(hadamard=True), None, True, None, None, None, False)
    assert plan.amax_kind == "pairs" and plan.amax_kwargs["num_warps"] == 8 and plan.amax_kwargs["NB"] == 512
