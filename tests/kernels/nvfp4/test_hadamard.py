"""The Hadamard transform's range: huge finite inputs give the float64 result (rounded to the dtype) in the
torch reference and in every Triton path (row-major general, bf16 fast path with its amax passes,
columnwise); the overflow rule where the correct result does not fit; the same bits as the previous formula
(x 1/4 after the butterflies) wherever that did not overflow; the inverse."""

import os
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest
import torch
from _same_bytes import assert_same_bytes

from triage.kernels.nvfp4 import QuantRecipe, quantize
from triage.kernels.nvfp4.fuzz import adversarial
from triage.kernels.nvfp4.hadamard import (
    TE_SIGNS,
    _butterfly16,
    hadamard16,
    hadamard16_matrix,
    inverse_hadamard16,
)
from triage.kernels.nvfp4.quantize_columns import quantize_columnwise
from triage.kernels.nvfp4.quantize_rows import quantize_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy overflow casts in the interpreter
SIGNS = torch.tensor(TE_SIGNS, dtype=torch.float32)


def rotate64(x: torch.Tensor) -> torch.Tensor:
    """``x_b @ H`` of every 16-block in float64 (exact for these inputs: no rounding before the cast), on
    x's device."""
    h = hadamard16_matrix(torch.float64).to(x.device)
    return (x.double().unflatten(-1, (-1, 16)) @ h).flatten(-2)


def huge_blocks(rows: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """[rows, k] of 16-blocks of magnitude 1e37 .. 3e38 whose rotation fits the dtype (bf16/fp32), built so
    that the fp32 butterflies round exactly as float64 does (sums of 8-bit integers times one power of two,
    or one huge value among small ones): c * TE_SIGNS with c = 3e37 (the unscaled sums reach 16c = 4.8e38,
    beyond fp32) and c = 8e37 (rotated 3.2e38, next to the bf16 maximum); integers in [-127, 127] * 2^118
    (up to 4.2e37); one +-1e38 or +-3e38 among small values; ordinary gaussians."""
    g = torch.Generator().manual_seed(seed)
    n = rows * k // 16
    kind = torch.randint(0, 6, (n,), generator=g)
    kind[:2] = torch.tensor([0, 1])  # the aligned cases always present
    small = torch.randint(-8, 9, (n, 16), generator=g).float() * 0.125
    one = torch.nn.functional.one_hot(torch.randint(0, 16, (n,), generator=g), 16).bool()
    sign = torch.where(torch.rand(n, 1, generator=g) < 0.5, -1.0, 1.0)
    aligned = SIGNS.expand(n, 16)
    choices = [
        aligned * 3e37,
        aligned * 8e37,
        torch.randint(-127, 128, (n, 16), generator=g).float() * 2.0**118,
        torch.where(one, sign * 1e38, small),
        torch.where(one, sign * 3e38, small),
        torch.randn(n, 16, generator=g),
    ]
    out = torch.zeros(n, 16)
    for i, c in enumerate(choices):
        out[kind == i] = c.to(torch.bfloat16).float()[kind == i]  # bf16 values: exact in both dtypes
    return out.reshape(rows, k).to(dtype).to(DEV)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_hadamard16_of_huge_inputs_is_the_float64_rotation(dtype):
    x = huge_blocks(32, 64, dtype)
    expect = rotate64(x).to(dtype)
    assert torch.isfinite(expect).all()
    got = hadamard16(x)
    assert torch.equal(got, expect), (
        f"{(got != expect).sum().item()} values differ, e.g. {got[got != expect][:4]}"
    )


def assert_paths_give(x, recipe, expect):
    """Every Triton path's quantization of x has the bytes of ``expect`` (all paths checked, then reported)."""
    bad = []
    for name, fn in _paths(x.dtype):
        try:
            assert_same_bytes(fn(x, recipe), expect, name)
        except AssertionError as e:
            bad.append(str(e))
    assert not bad, bad


def _paths(dtype):
    """(name, quantize function) for every Triton path that applies the transform to a [rows, K] tensor."""
    paths = [
        ("row-major", lambda x, r: quantize_triton(x, r)),  # bf16: the fast path (pairs) with its amax passes
        ("columnwise", lambda x, r: quantize_columnwise(x.t().contiguous(), r, backend="triton")),
    ]
    if dtype == torch.bfloat16:
        paths.append(("general", lambda x, r: quantize_triton(x, r, pairs=False)))
    return paths


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "variant",
    [{}, {"scale": "row"}, {"scale": "row", "rounding": "stochastic", "seed": 7},
     {"scale_source": "static", "static_amax": 1e38}],
    ids=lambda v: "-".join(f"{k}={v[k]}" for k in v) or "default",
)  # fmt: skip
def test_every_triton_path_quantizes_the_float64_rotation_of_huge_inputs(dtype, variant):
    """Each path's bytes are those of quantizing the float64 rotation (rounded to the dtype) without the
    transform: before the transform scaled first, its unscaled fp32 sums overflowed (garbage blocks)."""
    x = huge_blocks(16, 64, dtype, seed=1)
    recipe = QuantRecipe(hadamard=True, **variant)
    expect = quantize(rotate64(x).to(dtype), replace(recipe, hadamard=False), backend="torch")
    assert_same_bytes(quantize(x, recipe, backend="torch"), expect, "reference")
    assert_paths_give(x, recipe, expect)


@pytest.mark.parametrize(
    "dtype, c", [(torch.bfloat16, 1e38), (torch.float32, 1e38), (torch.float16, 3e4)], ids=str
)
def test_rotation_beyond_the_dtype_range_is_inf_in_every_path(dtype, c):
    """The documented overflow rule: where the correct rotated value exceeds the dtype's range (a block with
    max|x| > max / 4), it is +-Inf; the block is non-finite; every other block is the float64 rotation."""
    fits = torch.randint(-8, 9, (1, 48), generator=torch.Generator().manual_seed(0)).float()
    x = torch.cat([SIGNS[None] * c, fits], dim=1).repeat(16, 1).to(dtype).to(DEV)
    got = hadamard16(x)
    assert got[:, 0].eq(float("inf")).all()  # 4c, beyond the dtype's maximum
    assert not torch.isfinite(got[:, :16]).all(-1).any()
    assert torch.equal(got[:, 16:], rotate64(x)[:, 16:].to(dtype))
    recipe = QuantRecipe(hadamard=True)
    assert_paths_give(x, recipe, quantize(x, recipe, backend="torch"))


def _wide_range(dtype: torch.dtype, lo: int, hi: int) -> torch.Tensor:
    """[64, 64]: every block at its own scale 2^e, e in [lo, hi), its values spread over 2^-6 .. 2^6 of it
    (so the fp32 sums round), clamped to [2^lo, 2^hi) in magnitude."""
    g = torch.Generator().manual_seed(lo & 0xFFFF)
    e = torch.randint(lo, hi, (256, 1), generator=g).float() + torch.rand(256, 16, generator=g) * 12 - 6
    mag = torch.exp2(e.clamp(lo, hi - 1))
    x = torch.where(torch.rand(256, 16, generator=g) < 0.5, -mag, mag) * (
        1 + torch.rand(256, 16, generator=g)
    )
    return x.reshape(64, 64).to(dtype)


@pytest.mark.parametrize(
    "dtype, lo, hi",
    [(torch.bfloat16, -140, 123), (torch.float16, -30, 14), (torch.float32, -124, 123)],
    ids=str,
)
def test_hadamard16_keeps_the_previous_bits_where_they_did_not_overflow(dtype, lo, hi):
    """Scaling by 1/4 first gives the bits of the previous definition (signs, butterflies, then x 1/4) on
    every input where that did not overflow (|x| < 2^124 / 16 .. 2^124) and x / 4 is exact (all bf16/fp16;
    fp32 from 2^-124): the engine-matched bytes on normal data do not move. bf16 down to its subnormals."""
    for x in (_wide_range(dtype, lo, hi), adversarial(64, 64, dtype=dtype, seed=5)):
        old = (_butterfly16(x.float().unflatten(-1, (-1, 16)) * SIGNS) * 0.25).flatten(-2).to(dtype)
        new = hadamard16(x)
        nan = torch.isnan(old)
        assert torch.equal(nan, torch.isnan(new))
        assert torch.equal(old[~nan].view(torch.int16 if dtype != torch.float32 else torch.int32),
                           new[~nan].view(torch.int16 if dtype != torch.float32 else torch.int32))  # fmt: skip


def test_inverse_hadamard16_of_huge_rotations():
    """``inverse_hadamard16`` recovers blocks of +-3e38 values (whose rotation is finite) without overflowing:
    its butterflies never exceed the result's magnitude (a matrix product's partial sums can)."""
    g = torch.Generator().manual_seed(0)
    x = torch.zeros(512, 16)
    for row in x:
        idx = torch.randperm(16, generator=g)[: int(torch.randint(1, 6, (1,), generator=g))]
        row[idx] = torch.where(torch.rand(len(idx), generator=g) < 0.5, -3e38, 3e38)
    y = hadamard16(x)
    keep = torch.isfinite(y).all(-1)
    assert keep.sum() > 300
    back = inverse_hadamard16(y[keep])
    assert torch.isfinite(back).all()
    torch.testing.assert_close(back, x[keep], rtol=0, atol=3e38 * 2.0**-22)


def test_layer_gives_nan_where_a_rotated_wgrad_operand_overflows():
    """nvfp4-backward: a finite x whose rotated wgrad operand xᵀ overflows (16 tokens of channel 0 at
    1e38 * TE_SIGNS: rotated 4e38) gives a NaN dW by the layers' non-finite rule, not a saturated one (with
    per-row wgrad scales: channel 0's column of dW, the one the overflow enters)."""
    import dataclasses

    from triage.kernels import NVFP4Linear, NVFP4LinearConfig

    cfg = NVFP4LinearConfig(quant_backend="torch", gemm_backend="reference", backward="nvfp4-backward")
    torch.manual_seed(0)
    layer = NVFP4Linear(32, 16, config=cfg)
    x = torch.randn(16, 32)
    x[:, 0] = SIGNS * 1e-3
    layer(x).backward(torch.randn(16, 16))
    assert torch.isfinite(layer.weight.grad).all()
    layer.weight.grad = None
    x[:, 0] = SIGNS * 1e38
    layer(x).backward(torch.randn(16, 16))
    assert layer.weight.grad.isnan().all()
    # per-row wgrad scales (xᵀ's rows are the channels): the rule per row, so channel 0's column of dW alone
    per_row = dataclasses.replace(cfg, wgrad=QuantRecipe(hadamard=True, pad=True, scale="row"))
    layer = NVFP4Linear(32, 16, config=per_row)
    layer(x).backward(torch.randn(16, 16))
    assert layer.weight.grad[:, 0].isnan().all() and layer.weight.grad[:, 1:].isfinite().all()


def test_fp32_subnormal_inputs_round_as_the_reference_in_every_path():
    """fp32 inputs below 2^-124, where x / 4 rounds (odd multiples of 2^-149): every path rounds the product
    where the reference does (on the GPU: ``mul.rn.f32``, no FMA contraction, no flush to zero); the amax
    compared by assert_same_bytes is the largest rotated value's bits."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randint(-(2**10), 2**10, (16, 64), generator=g) * 2 + 1).double() * 2.0**-149
    x = x.float().to(DEV)
    assert (x.abs() < 2.0**-124).all() and (x != 0).all()
    rot = hadamard16(x)
    assert not torch.equal(rot, rotate64(x).float())  # x / 4 did round: the order of roundings matters
    for variant in ({}, {"scale": "row", "rounding": "stochastic"}):
        recipe = QuantRecipe(hadamard=True, **variant)
        assert_paths_give(x, recipe, quantize(x, recipe, backend="torch"))


_PTX_SCRIPT = textwrap.dedent(
    """
    import collections, re
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triage.kernels.nvfp4 import device, quantize_columns, quantize_rows

    common = {"PROPAGATE_NAN": False, "HADAMARD": True, "ROUND": 0, "SIGNS": device.SIGN_MASK, "NB": 4}
    kernels = {
        "tiled (_rht16)": (
            quantize_rows._amax_tiled_kernel,
            {"x_ptr": "*fp32", "amax_ptr": "*i32", "rows_per_group": "i32", "K": "i32", "KP": "i32"},
            {**common, "BR": 64},
        ),
        "columnwise (_quarter)": (
            quantize_columns._amax_colwise_kernel,
            {"x_ptr": "*fp32", "src_ptr": "*fp32", "buf_ptr": "*i32", "C": "i32", "L": "i32", "sx0": "i32"},
            {**common, "sx1": 1, "TILES": 1, "PER_ROW": False, "HAS_SRC": False, "BC": 16},
        ),
    }
    for name, (fn, args, constexprs) in kernels.items():
        fn = getattr(fn, "fn", fn)  # the fast-launch wrapper
        signature = {**args, **{k: "constexpr" for k in constexprs}}
        attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in args}
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
        ops = collections.Counter(re.findall(r"\\b(?:mul|fma|add|sub)(?:\\.rn)?\\.f32\\b", ptx))
        print(name, dict(ops))
        assert ops["mul.rn.f32"] >= 16 and not ops["mul.f32"], (name, dict(ops))
        assert ".ftz" not in ptx, (name, "flushes subnormals")
    """
)


def test_fp32_hadamard_products_compile_uncontracted_for_sm90(tmp_path):
    """The GPU side of the subnormal rule above, checked without a GPU: the interpreter computes
    ``x * (+-1/4)`` as a plain product (it never fuses), so only the compiled kernel shows whether the
    products stay ``mul.rn.f32`` (never contracted) or become FMAs with the first butterfly's adds (a
    plain ``mul.f32`` / ``fma``: ``x / 4`` of a subnormal then not rounded where the reference rounds it).
    No ``.ftz`` either (subnormals kept). Both transform implementations, compiled for sm_90 by the
    installed Triton (its wheel ships ptxas)."""
    path = tmp_path / "ptx_check.py"  # @triton.jit needs its source in a file
    path.write_text(_PTX_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env, timeout=300)
    if "ptxas" in proc.stderr and proc.returncode:
        pytest.skip(f"no usable ptxas in this Triton install: {proc.stderr[-200:]}")
    assert proc.returncode == 0, proc.stdout[-1000:] + proc.stderr[-2000:]
