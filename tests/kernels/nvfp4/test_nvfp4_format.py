"""E2M1/E4M3 encode-decode, nibble packing and the 128x4 swizzle."""

import math

import pytest
import torch

from triage.kernels.nvfp4 import (
    E2M1_VALUES,
    e2m1_codes,
    e2m1_decode,
    e4m3_decode,
    e4m3_encode,
    pack_nibbles,
    swizzle_scales,
    unpack_nibbles,
    unswizzle_scales,
)

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_e2m1_decode_table():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = e2m1_decode(codes)
    assert vals[:8].tolist() == GRID
    assert vals[8:].tolist() == [-g for g in GRID]
    assert torch.signbit(vals[8])


@pytest.mark.parametrize(
    "value,code",
    [(0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6)],
)
def test_e2m1_ties_to_even(value, code):
    assert e2m1_codes(torch.tensor([value])).item() == code
    assert e2m1_codes(torch.tensor([-value])).item() == code | 8


def test_e2m1_round_to_nearest_matches_brute_force():
    # every fp32 value in a dense sweep: the nearest grid point, ties to the even code
    v = torch.linspace(-7, 7, 200_001)
    grid = torch.tensor(GRID)
    dist = (v.abs()[:, None] - grid[None, :]).abs()
    best = dist.min(dim=1, keepdim=True).values
    cands = (dist == best).int()
    # among tied candidates prefer the even code index
    idx = torch.arange(8)
    score = cands * (2 - (idx % 2))  # even codes score 2, odd 1
    mag = score.argmax(dim=1)
    expect = mag.to(torch.uint8) | (torch.signbit(v).to(torch.uint8) << 3)
    assert torch.equal(e2m1_codes(v), expect)


def test_e2m1_specials():
    v = torch.tensor([math.nan, -math.nan, math.inf, -math.inf, 7.0, -100.0, -0.0, 0.0, -0.1, 0.1])
    assert e2m1_codes(v, "signbit").tolist() == [7, 7, 7, 15, 7, 15, 8, 0, 8, 0]
    assert e2m1_codes(v, "negative").tolist() == [7, 7, 7, 15, 7, 15, 0, 0, 8, 0]
    with pytest.raises(ValueError, match="negative_zero"):
        e2m1_codes(v, "bogus")


def test_e2m1_roundtrip_all_codes():
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(e2m1_codes(e2m1_decode(codes)), codes)


def test_e4m3_satfinite_and_rne():
    v = torch.tensor(
        [math.nan, math.inf, -math.inf, 464.0, 500.0, 2.0**-10, 1.5 * 2.0**-10, 1.5 * 2.0**-9, 0.0]
    )
    b = e4m3_encode(v).view(torch.uint8).tolist()
    assert b[0] & 0x7F == 0x7F  # NaN
    assert b[1] == 0x7E and b[2] == 0xFE and b[3] == 0x7E and b[4] == 0x7E  # +-448
    assert b[5] == 0x00  # tie to even (0)
    assert b[6] == 0x01  # 2^-9
    assert b[7] == 0x02  # tie to even (2 * 2^-9)
    assert b[8] == 0x00
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = ~torch.isnan(every.float())
    assert torch.equal(
        e4m3_encode(e4m3_decode(every[finite])).view(torch.uint8), every[finite].view(torch.uint8)
    )


def test_pack_low_nibble_first():
    codes = torch.tensor([[1, 2, 3, 15]], dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0xF3]]
    assert torch.equal(unpack_nibbles(packed), codes)
    with pytest.raises(ValueError, match="even"):
        pack_nibbles(torch.zeros(3, dtype=torch.uint8))


def _swizzle_offset(r, c, cols):
    nkt = (cols + 3) // 4
    return ((r // 128) * nkt + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)


@pytest.mark.parametrize("rows,cols", [(1, 1), (128, 4), (130, 7), (300, 12)])
def test_swizzle_matches_offset_formula(rows, cols):
    s = torch.randint(1, 255, (rows, cols), dtype=torch.uint8)
    sw = swizzle_scales(s)
    assert sw.shape == ((rows + 127) // 128 * 32, (cols + 3) // 4 * 16)
    flat = sw.flatten()
    r = torch.arange(rows)[:, None].expand(rows, cols)
    c = torch.arange(cols)[None, :].expand(rows, cols)
    off = _swizzle_offset(r, c, cols)
    assert torch.equal(flat[off], s)
    mask = torch.ones_like(flat, dtype=torch.bool)
    mask[off.flatten()] = False
    assert (flat[mask] == 0).all()  # padding is zero
    assert torch.equal(unswizzle_scales(sw, rows, cols), s)


def test_swizzle_fp8_and_batched():
    s = torch.rand(3, 130, 5).to(torch.float8_e4m3fn)
    sw = swizzle_scales(s)
    assert sw.dtype == torch.float8_e4m3fn and sw.shape == (3, 64, 32)
    for e in range(3):
        assert torch.equal(sw[e].view(torch.uint8), swizzle_scales(s[e]).view(torch.uint8))
    assert torch.equal(unswizzle_scales(sw, 130, 5).view(torch.uint8), s.view(torch.uint8))


def test_values_table_is_fp32():
    assert E2M1_VALUES.dtype == torch.float32 and E2M1_VALUES.numel() == 16
