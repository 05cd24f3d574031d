"""One fused-group rule (triage.kernels.fused_groups): the export, the HF sampler's shared fused weight scales and
the diagnostics group the same layers and share the same amax, the max over a group's shards."""

import math

import pytest
import torch

from triage.kernels.fused_groups import (
    FUSED_GROUPS,
    fused_group_amax,
    fused_group_key,
    fused_group_members,
    group_amax,
)
from triage.kernels.nvfp4 import export_nvfp4_checkpoint
from triage.kernels.nvfp4.export import compressed_tensors_global_scale


def test_members_are_the_siblings_of_one_parent_in_group_order():
    names = [
        "m.layers.0.self_attn.v_proj",
        "m.layers.0.self_attn.q_proj",
        "m.layers.0.self_attn.o_proj",
        "m.layers.1.self_attn.k_proj",
        "m.layers.0.mlp.up_proj",
        "m.layers.0.mlp.gate_proj",
        "m.layers.0.mlp.down_proj",
        "k_proj",
        "q_proj",
    ]
    assert fused_group_members(names) == {
        "m.layers.0.self_attn.v_proj": ("m.layers.0.self_attn.q_proj", "m.layers.0.self_attn.v_proj"),
        "m.layers.0.self_attn.q_proj": ("m.layers.0.self_attn.q_proj", "m.layers.0.self_attn.v_proj"),
        "m.layers.1.self_attn.k_proj": ("m.layers.1.self_attn.k_proj",),  # its siblings are absent
        "m.layers.0.mlp.up_proj": ("m.layers.0.mlp.gate_proj", "m.layers.0.mlp.up_proj"),
        "m.layers.0.mlp.gate_proj": ("m.layers.0.mlp.gate_proj", "m.layers.0.mlp.up_proj"),
        "k_proj": ("q_proj", "k_proj"),  # top-level modules: the parent is the root
        "q_proj": ("q_proj", "k_proj"),
    }
    assert fused_group_key("m.layers.0.self_attn.k_proj") == ("m.layers.0.self_attn", 0)
    assert fused_group_key("m.layers.0.mlp.down_proj") is None
    assert fused_group_members(["a.x", "a.y", "a.q_proj"], fused_groups=(("x", "y"),)) == {
        "a.x": ("a.x", "a.y"),
        "a.y": ("a.x", "a.y"),
    }


@pytest.mark.parametrize(
    "groups, message",
    [
        (
            (("q_proj", "k_proj"), ("k_proj", "v_proj")),
            r"'k_proj' is in fused_groups\[0\] and fused_groups\[1\]",
        ),
        (("q_proj", "k_proj"), r"fused_groups\[0\] must be a tuple of module names, got 'q_proj'"),
        (((1, 2),), r"fused_groups\[0\] must be a tuple of module names"),
        ((("q_proj",), 5), r"fused_groups\[1\] must be a tuple of module names, got 5"),
    ],
)
def test_malformed_fused_groups_are_refused_naming_the_entry(groups, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        fused_group_members(["a.q_proj"], groups)
    state = {f"a.{n}.weight": torch.ones(2, 16) for n in ("q_proj", "k_proj", "v_proj")}
    with pytest.raises(ValueError, match=message):  # the export's fused_groups= argument
        export_nvfp4_checkpoint(
            state, tmp_path, skip=(), fused_groups=groups, config={"architectures": ["X"]}
        )


def test_group_amax_is_the_max_over_the_members_and_nan_in_any_order():
    members = {"a.q_proj": ("a.q_proj", "a.k_proj"), "a.k_proj": ("a.q_proj", "a.k_proj")}
    amax = {"a.q_proj": 1.0, "a.k_proj": 3.0, "a.o_proj": 9.0}
    assert group_amax(amax, members) == {"a.q_proj": 3.0, "a.k_proj": 3.0, "a.o_proj": 9.0}
    for order in (("a.q_proj", "a.k_proj"), ("a.k_proj", "a.q_proj")):
        nan = {n: (math.nan if n == order[0] else 1.0) for n in order}
        assert all(math.isnan(v) for v in group_amax(nan, members).values())


def test_fused_group_amax_groups_siblings_only():
    w = {
        "m.layers.0.self_attn.q_proj": torch.tensor([1.0, -3.0]),
        "m.layers.0.self_attn.k_proj": torch.tensor([2.0]),
        "m.layers.1.self_attn.k_proj": torch.tensor([-5.0]),
        "m.layers.0.self_attn.o_proj": torch.tensor([9.0]),
        "m.layers.0.mlp.up_proj": torch.tensor([4.0]),
    }
    assert fused_group_amax(w) == {
        "m.layers.0.self_attn.q_proj": 3.0,
        "m.layers.0.self_attn.k_proj": 3.0,
        "m.layers.1.self_attn.k_proj": 5.0,
        "m.layers.0.mlp.up_proj": 4.0,
    }
    nan_first = {"a.q_proj": torch.tensor([float("nan")]), "a.k_proj": torch.tensor([1.0])}
    for order in (nan_first, dict(reversed(list(nan_first.items())))):  # a NaN shard: a NaN group amax
        assert all(math.isnan(v) for v in fused_group_amax(order).values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_the_smallest_encode_scale_is_that_of_the_group_amax_unless_a_shard_s_is_replaced(dtype):
    """compressed-tensors' rule (min over the shards of gs(A_m)) equals gs(max A_m) while every gs(A_m) is
    finite (gs does not increase with A), and differs where a shard's gs overflows and is replaced by 1."""
    g = torch.Generator().manual_seed(0)
    amax = (torch.rand(4096, 3, generator=g, dtype=torch.float64) * 12 - 6).exp2().to(dtype)  # 2^-6 .. 2^6
    if dtype == torch.float16:  # keep every fp16 gs finite: A >= 2688 / 65504
        amax = amax.clamp(min=0.05)
    gs = torch.stack([torch.stack([compressed_tensors_global_scale(a) for a in row]) for row in amax])
    assert bool((gs != 1).all())  # no replaced scale in this sweep
    group = torch.stack([compressed_tensors_global_scale(a) for a in amax.amax(1)])
    assert torch.equal(gs.amin(1), group)

    shards = torch.tensor([0.0, 0.5], dtype=dtype)  # an all-zero shard: its gs overflows and is replaced by 1
    gs = torch.stack([compressed_tensors_global_scale(a) for a in shards])
    assert gs.flatten().tolist() == [1.0, 5376.0]
    assert float(gs.amin()) == 1.0 != float(compressed_tensors_global_scale(shards.amax()))


def test_the_export_names_its_fused_group_constant_from_the_one_home():
    from triage.kernels.nvfp4 import export

    assert export.FUSED_GROUPS is FUSED_GROUPS
