"""The torch reference: engine rules per profile, torchao bit-exactness, properties, errors."""

import math
import warnings

import pytest
import torch

from triage.kernels.nvfp4 import (
    PROFILES,
    QuantRecipe,
    dequantize,
    e2m1_decode,
    hadamard16,
    inverse_hadamard16,
    quantize,
    unpack_nibbles,
    unswizzle_scales,
)
from triage.kernels.nvfp4.fuzz import adversarial, midpoint_tensor
from triage.kernels.nvfp4.quantize_columns import quantize_columnwise


@pytest.fixture
def torchao_nvfp4():
    """torchao's NVFP4 quantizer module (a dev extra): the tests that compare with it skip without it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")


def q(x, **kw):
    return quantize(x, QuantRecipe(**kw), backend="torch")


def scale_bytes(t):
    return t.scale.view(torch.uint8)


# ---------------------------------------------------------------- torchao's own quantizer, bit for bit
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_torchao_profile_matches_torchao_two_level(seed, dtype, torchao_nvfp4):
    x = adversarial(512, 512, dtype=dtype, seed=seed, specials=False)  # torchao has no defined NaN rule
    t = q(x, profile="torchao")
    pts = torchao_nvfp4.per_tensor_amax_to_scale(x.float().abs().amax())
    s, d = torchao_nvfp4.nvfp4_quantize(x, per_tensor_scale=pts)
    assert torch.equal(t.global_scale, pts)
    assert torch.equal(scale_bytes(t), s.view(torch.uint8))
    assert torch.equal(t.data, d)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_torchao_profile_matches_torchao_single_level(dtype, torchao_nvfp4):
    x = adversarial(256, 256, dtype=dtype, seed=7, specials=False)
    t = q(x, profile="torchao", scale="none")
    s, d = torchao_nvfp4.nvfp4_quantize(x)
    assert torch.equal(scale_bytes(t), s.view(torch.uint8))
    assert torch.equal(t.data, d)


def test_torchao_profile_matches_torchao_per_expert(torchao_nvfp4):
    x = adversarial(4 * 64, 128, seed=3, specials=False).reshape(4, 64, 128)
    t = q(x, profile="torchao", scale="expert")
    pts = torchao_nvfp4.per_tensor_amax_to_scale(x.float().abs().amax(dim=(1, 2), keepdim=True))
    assert t.global_scale.shape == (4, 1, 1)
    s, d = torchao_nvfp4.nvfp4_quantize(x, per_tensor_scale=pts)
    assert torch.equal(t.global_scale, pts)
    assert torch.equal(scale_bytes(t).reshape(s.shape), s.view(torch.uint8))
    assert torch.equal(t.data.reshape(d.shape), d)


# ---------------------------------------------------------------- engine rules per profile
@pytest.mark.parametrize(
    "profile,byte", [("te", 0x00), ("torchao", 0x08), ("modelopt", 0x38), ("compressed-tensors", 0x20)]
)
def test_zero_block_scale_byte(profile, byte):
    x = torch.randn(2, 32)
    x[0, :16] = 0.0
    t = q(x, profile=profile)
    assert scale_bytes(t)[0, 0].item() == byte
    assert (t.codes()[0, :16] == 0).all()
    assert (t.dequantize()[0, :16] == 0).all()


@pytest.mark.parametrize("profile", PROFILES)
def test_all_zero_tensor_gives_outer_scale_one(profile):
    t = q(torch.zeros(4, 32), profile=profile)
    assert t.global_scale.item() == 1.0 and t.global_encode_scale.item() == 1.0
    assert (t.dequantize() == 0).all()


@pytest.mark.parametrize(
    "profile,negzero", [("te", 8), ("torchao", 8), ("modelopt", 0), ("compressed-tensors", 0)]
)
def test_sign_of_zero_rule(profile, negzero):
    x = torch.full((1, 32), 1.0)
    x[0, 1] = -0.0
    x[0, 2] = -1e-3  # rounds to zero, negative
    codes = q(x, profile=profile).codes()[0]
    assert codes[1].item() == negzero
    assert codes[2].item() == 8


@pytest.mark.parametrize("profile", PROFILES)
def test_nan_rule(profile):
    x = torch.randn(2, 32)
    x[0, 3] = float("nan")
    t = q(x, profile=profile)
    codes = t.codes()
    assert codes[0, 3].item() == 0x7  # NaN -> +6 everywhere
    if profile == "te":  # NaN-ignoring block amax: the rest of the block is quantized normally
        assert scale_bytes(t)[0, 0].item() != 0x7F
        assert torch.isnan(t.dequantize()).sum() == 0
    else:  # torch.amax propagates NaN: scale 0x7F, the block dequantizes to NaN
        assert scale_bytes(t)[0, 0].item() == 0x7F
        assert torch.isnan(t.dequantize()[0, :16]).all()
    assert not torch.isnan(t.dequantize()[1]).any()  # other rows unaffected
    if profile == "compressed-tensors":  # a NaN anywhere makes CT's global scale 1 (its nan -> 1 rule)
        assert t.global_encode_scale.item() == 1.0
    else:
        assert t.global_encode_scale.item() != 1.0


def test_te_inf_saturates_and_resets_outer_scale():
    x = torch.randn(2, 32)
    x[0, 0] = float("inf")
    t = q(x, profile="te")
    assert t.global_encode_scale.item() == 1.0  # 2688 / inf = 0 -> 1
    assert scale_bytes(t)[0, 0].item() == 0x7E  # 448
    assert t.codes()[0, 0].item() == 0x7


def test_te_formula_spot_values():
    x = torch.zeros(1, 16)
    x[0, 0] = 10.0
    x[0, 1] = 2.5
    t = q(x, profile="te")
    r6 = torch.tensor(1.0) / torch.tensor(6.0)
    enc = torch.tensor(2688.0) / torch.tensor(10.0)
    s = (torch.tensor(10.0) * (enc * r6)).to(torch.float8_e4m3fn)
    assert scale_bytes(t)[0, 0] == s.view(torch.uint8)
    assert t.global_encode_scale == enc and t.global_scale == torch.tensor(1.0) / enc


@pytest.mark.parametrize("profile", PROFILES)
def test_midpoints_round_to_even(profile):
    x = midpoint_tensor(8, 64, seed=1)
    t = q(x, profile=profile)
    assert t.global_scale.item() == 1.0
    codes = t.codes().long()
    s = t.scale.float().repeat_interleave(16, -1)
    v = x.float() / s  # exact: s is a power of two
    mags = (codes & 7).tolist()
    expect = {0.25: 0, 0.75: 2, 1.25: 2, 1.75: 4, 2.5: 4, 3.5: 6, 5.0: 6, 6.0: 7}
    for a, m in zip(v.abs().flatten().tolist()[16:], [mm for row in mags for mm in row][16:]):
        assert expect[a] == m


def test_modelopt_codes_match_searchsorted_rule():
    """ModelOpt's _cast_fp4 rule: searchsorted on the bounds plus one at the odd bounds, sign from v < 0."""
    x = adversarial(128, 256, seed=11, specials=False, dtype=torch.float32)
    t = q(x, profile="modelopt")
    s = t.scale.float().repeat_interleave(16, -1)
    v = x / (s * t.global_scale)
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    a = v.abs()
    ordinal = torch.searchsorted(bounds, a.contiguous())
    ordinal = ordinal + (a.unsqueeze(-1) == bounds[[1, 3, 5]]).any(-1).long()
    expect = ordinal | ((v < 0).long() << 3)
    assert torch.equal(t.codes().long(), expect)


def test_compressed_tensors_scale_formula():
    x = adversarial(64, 128, seed=5, specials=False, dtype=torch.float32)
    t = q(x, profile="compressed-tensors")
    amax = x.abs().amax()
    gs = torch.tensor(2688.0) / amax
    assert t.global_encode_scale == gs
    bamax = x.abs().unflatten(-1, (-1, 16)).amax(-1)
    s = (gs * (bamax / torch.tensor(6.0))).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    s = torch.where(s == 0, 0.125, s)
    assert torch.equal(t.scale.float(), s)


# ---------------------------------------------------------------- properties
@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("scale", ["tensor", "row", "none"])
def test_dequantize_error_bound(profile, scale):
    """Every dequantized value is within one grid half-gap (<= 1 * block scale) of the input, in blocks whose
    E4M3 scale is normal (a subnormal scale can round down by up to 50% and then the block max clips)."""
    x = (torch.randn(64, 128) * torch.exp(torch.randn(64, 1) * 2)).clamp(-1000, 1000)  # < 2688: no clipping
    t = q(x, profile=profile, scale=scale)
    y = t.dequantize()
    s = t.scale.float().repeat_interleave(16, -1)
    step = s * t.global_scale
    normal = s >= 2.0**-6
    assert normal.float().mean() > 0.5
    assert ((y - x).abs() <= step * (1 + 1e-5) + 1e-30)[normal].all()
    assert torch.equal(e2m1_decode(t.codes()) * t.scale.float().repeat_interleave(16, -1), t.block_values())


def test_16x16_weight_and_transpose_quantize_identically():
    w = torch.randn(64, 96) * torch.exp(torch.randn(64, 96) * 0.5)
    a = q(w, block="16x16").dequantize()
    b = q(w.t().contiguous(), block="16x16").dequantize()
    assert torch.equal(a, b.t())
    s = q(w, block="16x16").scale.float()
    assert torch.equal(s, s[::16].repeat_interleave(16, 0))  # one scale per tile, repeated on its rows


def test_16x16_rows_not_multiple_of_16_use_zero_padded_tiles():
    w = torch.randn(20, 32)
    t = q(w, block="16x16")
    s = t.scale.float()
    assert torch.equal(s[16:], s[16:17].expand(4, -1))
    bottom = q(torch.cat([w[16:], torch.zeros(12, 32)]), block="16x16", scale="none")
    assert t.data.shape == (20, 16)
    del bottom


def test_stochastic_rounding_is_unbiased_and_seeded():
    vals = torch.tensor([0.3, 0.6, 1.1, 2.2, 2.9, 3.3, 4.7, 5.5])
    n = 8192
    x = torch.zeros(n, 16)
    x[:, 0] = 6.0  # pins the block scale to 1 with scale="none"
    x[:, 1:9] = vals
    t = q(x, profile="te", scale="none", rounding="stochastic", seed=123)
    assert (t.scale.float() == 1.0).all()
    mean = t.dequantize()[:, 1:9].mean(0)
    assert (mean - vals).abs().max() < 4 * 1.0 / math.sqrt(n)  # step <= 2, std <= 1
    t2 = q(x, profile="te", scale="none", rounding="stochastic", seed=123)
    t3 = quantize(
        x, QuantRecipe(profile="te", scale="none", rounding="stochastic"), backend="torch", seed=124
    )
    assert torch.equal(t.data, t2.data) and not torch.equal(t.data, t3.data)
    exact = torch.zeros(4, 16)
    exact[:, 0] = 6.0
    exact[:, 1:8] = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # grid points never move
    te = q(exact, scale="none", rounding="stochastic")
    assert torch.equal(te.dequantize(), exact)


def test_hadamard_is_orthogonal_and_quantizes_rotated_values():
    x = torch.randn(8, 64)
    assert torch.allclose(inverse_hadamard16(hadamard16(x)), x, atol=1e-5)
    t = q(x, hadamard=True)
    ref = q(hadamard16(x))
    assert torch.equal(t.data, ref.data) and torch.equal(scale_bytes(t), scale_bytes(ref))
    xb = x.bfloat16()
    assert hadamard16(xb).dtype == torch.bfloat16


def test_padding_rule():
    x = torch.randn(3, 20)
    with pytest.raises(ValueError, match="K=20.*pad=True"):
        q(x)
    t = q(x, pad=True)
    assert t.data.shape == (3, 16) and t.scale.shape == (3, 2) and t.shape == (3, 20)
    assert (t.codes()[:, 20:] == 0).all()
    assert t.dequantize().shape == (3, 20)
    xp = torch.nn.functional.pad(x, (0, 12))
    assert torch.equal(q(xp).data, t.data)


def test_non_contiguous_input():
    x = torch.randn(64, 48)
    a = q(x.t())
    b = q(x.t().contiguous())
    assert torch.equal(a.data, b.data) and torch.equal(scale_bytes(a), scale_bytes(b))


@pytest.mark.parametrize("profile", PROFILES)
def test_checkpoint_and_static_sources_reproduce_dynamic(profile):
    x = torch.randn(32, 64)
    t = q(x, profile=profile)
    native = t.global_encode_scale if profile in ("te", "compressed-tensors") else t.global_scale
    c = q(x, profile=profile, scale_source="checkpoint", checkpoint_scale=native.item())
    assert torch.equal(c.data, t.data) and torch.equal(scale_bytes(c), scale_bytes(t))
    s = q(x, profile=profile, scale_source="static", static_amax=t.amax.item())
    assert torch.equal(s.data, t.data) and torch.equal(s.global_scale, t.global_scale)


def test_static_amax_below_data_saturates():
    x = torch.randn(4, 32)
    t = q(x, scale_source="static", static_amax=1e-3)
    assert (scale_bytes(t) == 0x7E).all()


def test_swizzled_scale_roundtrip():
    x = torch.randn(200, 128)
    t = q(x)
    sw = t.swizzled_scale()
    assert sw.shape == (64, 32)
    assert torch.equal(unswizzle_scales(sw, 200, 8).view(torch.uint8), scale_bytes(t))


def test_row_and_expert_global_scale_shapes():
    x = torch.randn(2, 5, 32)
    assert q(x, scale="row").global_scale.shape == (2, 5, 1)
    assert q(x, scale="expert").global_scale.shape == (2, 1, 1)
    assert q(x).global_scale.shape == ()
    assert q(x, scale="none").global_scale.item() == 1.0


def test_unpack_matches_data():
    x = torch.randn(4, 32)
    t = q(x)
    assert torch.equal(unpack_nibbles(t.data), t.codes())


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "x,recipe,err,match",
    [
        (torch.ones(4, 16, dtype=torch.int32), {}, TypeError, "dtype torch.int32"),
        (torch.ones(4, 16, dtype=torch.float64), {}, TypeError, "float64"),
        (torch.ones(4, 17), {}, ValueError, "multiple of 16"),
        (torch.ones(0, 16), {}, ValueError, "non-empty"),
        (torch.ones(16), {"block": "16x16"}, ValueError, "16x16"),
    ],
)
def test_bad_input(x, recipe, err, match):
    with pytest.raises(err, match=match):
        q(x, **recipe)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"profile": "vllm"}, "profile"),
        ({"scale_source": "static"}, "static_amax is required"),
        ({"scale_source": "static", "static_amax": 0.0}, "finite and > 0"),
        ({"scale_source": "static", "static_amax": float("nan")}, "finite and > 0"),
        ({"scale_source": "static", "static_amax": -1.0}, "finite and > 0"),
        ({"scale_source": "checkpoint", "checkpoint_scale": float("inf")}, "finite and > 0"),
        # finite in float64 but not in float32 (the outer scale would be inf or 0): NaN / zero outputs
        ({"scale_source": "static", "static_amax": 1e39}, "static_amax must be finite and > 0 in float32"),
        ({"scale_source": "static", "static_amax": 1e-50}, "static_amax must be finite and > 0 in float32"),
        ({"scale_source": "checkpoint", "checkpoint_scale": 1e39}, "checkpoint_scale .*float32"),
        ({"scale_source": "checkpoint", "checkpoint_scale": 1e-39}, "finite float32 reciprocal"),
        # wrong types: a truthy string must not switch a feature on
        ({"scale_source": "static", "static_amax": "3"}, "static_amax must be a real number"),
        ({"scale_source": "static", "static_amax": True}, "static_amax must be a real number"),
        ({"pad": "no"}, "pad must be a bool"),
        ({"hadamard": "no"}, "hadamard must be a bool"),
        ({"hadamard": 1}, "hadamard must be a bool"),
        ({"seed": True}, "seed"),
        ({"scale_source": "static", "static_amax": 1.0, "scale": "row"}, "scale='tensor'"),
        ({"block": "16x16", "scale": "row"}, "16x16"),
        ({"rounding": "up"}, "rounding"),
        ({"seed": -1}, "seed"),
        ({"static_amax": 1.0}, "only used"),
    ],
)
def test_bad_recipe(kw, match):
    with pytest.raises(ValueError, match=match):
        QuantRecipe(**kw)


def test_recipe_accepts_real_numbers_in_the_float32_range():
    for v in (3, 2.5, 3e-39, 3.4e38):
        assert QuantRecipe(scale_source="static", static_amax=v).static_amax == v
    assert (
        QuantRecipe(profile="modelopt", scale_source="checkpoint", checkpoint_scale=1e-30).checkpoint_scale
        == 1e-30
    )


def test_bad_backend_and_seed():
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="backend"):
        quantize(x, backend="cuda")
    with pytest.raises(ValueError, match="seed"):
        quantize(x, seed=2**40)
    for bad in (True, False):  # refused like QuantRecipe(seed=True)
        with pytest.raises(ValueError, match="quantize: seed must be an int"):
            quantize(x, QuantRecipe(rounding="stochastic"), seed=bad)
        with pytest.raises(ValueError, match="quantize_columnwise: seed must be an int"):
            quantize_columnwise(x, QuantRecipe(rounding="stochastic"), seed=bad)
    with pytest.raises(TypeError, match="NVFP4Tensor"):
        dequantize(x)
    with pytest.raises(TypeError, match="QuantRecipe"):
        quantize(x, "te")
