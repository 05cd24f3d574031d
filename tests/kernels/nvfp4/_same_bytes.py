"""Shared assertion: two NVFP4Tensors hold the same bytes (data, scales) and the same outer scales and amax."""

import torch


def assert_same_bytes(a, b, what) -> None:
    assert a.data.shape == b.data.shape and a.scale.shape == b.scale.shape
    bad_data = (a.data != b.data).sum().item()
    bad_scale = (a.scale.view(torch.uint8) != b.scale.view(torch.uint8)).sum().item()
    assert bad_data == 0 and bad_scale == 0, f"{what}: {bad_data} data bytes, {bad_scale} scale bytes differ"
    for name in ("global_scale", "global_encode_scale", "amax"):
        ga, gb = getattr(a, name), getattr(b, name)
        assert (ga is None) == (gb is None), name
        if ga is not None:
            assert ga.shape == gb.shape, name
            assert torch.equal(ga.nan_to_num(-1.0), gb.nan_to_num(-1.0)), name
