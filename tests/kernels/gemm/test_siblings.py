"""Sibling layers (q/k/v, gate/up) run their decode GEMMs as one launch (:mod:`triage.kernels.siblings`).

The group kernel (``launch_decode_group``) against each member's own decode launch with the same tiles and
split, bit for bit, and the fp64 reference; the layer-level rules (same x, same operands, each kept output
handed out once, no group with autograd or above SMALL_M rows); which layers ``link_siblings`` links.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import io

import pytest
import torch
from _dense_operands import device, random_nvfp4, rel_err
from torch import nn

import triage.kernels.nvfp4.gemm_decode as gd
from triage.kernels import NVFP4Config, NVFP4LinearConfig, convert
from triage.kernels.nvfp4 import QuantRecipe
from triage.kernels.nvfp4.matmul import SMALL_M, gemm_w4a16_reference
from triage.kernels.siblings import SiblingGroup, link_siblings


def _members(widths, K, gen, scale, bias, odtype):
    ws = [random_nvfp4((n, K), gen=gen, scale=scale, zero_block_frac=0.1) for n in widths]
    bs = [torch.randn(n, generator=gen).to(odtype).to(device()) if bias else None for n in widths]
    return ws, bs


@pytest.mark.parametrize(
    "widths,K,split,scale,bias,xdtype",
    [
        ((32, 48), 96, 1, "row", False, torch.bfloat16),
        ((40, 16, 16), 96, 3, "row", True, torch.float16),
        ((37, 20, 9), 208, 2, "tensor", True, torch.bfloat16),  # ragged: tiles shorter than BN
        ((16, 16, 16), 64, 4, "tensor", False, torch.float16),
    ],
)
@pytest.mark.parametrize("M", [1, 5, 16])
def test_group_launch_gives_each_members_lone_bits(widths, K, split, scale, bias, xdtype, M):
    gen = torch.Generator().manual_seed(M * 7 + split)
    x = torch.randn(M, K, generator=gen).to(xdtype).to(device())
    ws, bs = _members(widths, K, gen, scale, bias, torch.float32)
    cfg = dict(gd.decode_config(M, sum(widths), K), SPLIT_K=split)
    outs = [torch.full((M, n), float("nan"), device=device()) for n in widths]
    members = [(w.data, w.scale, o, w.global_scale.reshape(-1), b) for w, o, b in zip(ws, outs, bs)]
    for _ in range(2):  # twice: the split-K tickets are back at zero after a launch
        assert gd.launch_decode_group(x, members, K, None, config=dict(cfg)) == outs
        for w, o, b in zip(ws, outs, bs):
            assert not o.isnan().any(), "unwritten output"
            lone = torch.full_like(o, float("nan"))
            gd.launch_decode(x, w.data, w.scale, K, lone, None, w.global_scale.reshape(-1), b, config=dict(cfg))
            assert torch.equal(o, lone)
            ref = gemm_w4a16_reference(x, w, out_dtype=torch.float64, bias=b)
            assert rel_err(o, ref) < 2e-6


def test_group_launch_with_an_activation_scale_and_a_nan_block():
    """W4A4's form (per-row activation scale g_a) and the non-finite rule: a NaN block scale in one member
    makes exactly that member's output row NaN."""
    gen = torch.Generator().manual_seed(3)
    M, K, widths = 4, 64, (24, 16)
    x = torch.randn(M, K, generator=gen).to(torch.float16).to(device())
    g_a = (torch.rand(M, generator=gen) + 0.5).to(device())
    ws, _ = _members(widths, K, gen, "tensor", False, torch.float32)
    sc = ws[1].scale.view(torch.uint8).clone()
    sc[5, 1] = 0x7F  # e4m3 NaN
    ws[1].scale = sc.view(torch.float8_e4m3fn)
    outs = [torch.empty(M, n, device=device()) for n in widths]
    members = [(w.data, w.scale, o, w.global_scale.reshape(-1), None) for w, o in zip(ws, outs)]
    gd.launch_decode_group(x, members, K, g_a)
    assert not outs[0].isnan().any()
    assert outs[1][:, 5].isnan().all() and not outs[1][:, [i for i in range(16) if i != 5]].isnan().any()
    ref = gemm_w4a16_reference(x, ws[0], out_dtype=torch.float64) * g_a.double()[:, None]
    assert rel_err(outs[0], ref) < 2e-6


def test_group_launch_refuses_members_that_do_not_fit():
    gen = torch.Generator().manual_seed(4)
    K = 64
    x = torch.randn(2, K, generator=gen).to(torch.float16).to(device())
    (w0, w1), _ = _members((16, 32), K, gen, "row", False, torch.float32)
    out0, out1 = torch.empty(2, 16, device=device()), torch.empty(2, 32, device=device())

    def member(w, out, g="row", bias=None):
        return (w.data, w.scale, out, w.global_scale.reshape(-1)[: 1 if g == "tensor" else None], bias)

    with pytest.raises(ValueError, match="of one kind"):
        gd.launch_decode_group(x, [member(w0, out0), member(w1, out1, "tensor")], K, None)
    with pytest.raises(ValueError, match="of one kind"):
        gd.launch_decode_group(x, [member(w0, out0), member(w1, out1, bias=torch.zeros(32, device=device()))], K, None)
    with pytest.raises(ValueError, match="of one kind"):  # one pointer type reads every member's bias
        gd.launch_decode_group(x, [member(w0, out0, bias=torch.zeros(16, device=device())),
                                   member(w1, out1, bias=torch.zeros(32, device=device(), dtype=torch.float16))],
                               K, None)  # fmt: skip
    with pytest.raises(ValueError, match="member 1's output"):
        gd.launch_decode_group(x, [member(w0, out0), member(w1, torch.empty(2, 32, 2, device=device())[..., 0])], K, None)
    with pytest.raises(ValueError, match="2 or 3 members"):
        gd.launch_decode_group(x, [member(w0, out0)] * 4, K, None)
    with pytest.raises(ValueError, match="fused_reduce"):
        gd.decode_launch(2, (16, 32), K, K // 16, torch.float16, torch.float32, fused_reduce=False)
    with pytest.raises(ValueError, match="M <= 64"):
        gd.launch_decode_group(torch.zeros(65, K, device=device()), [member(w0, torch.empty(65, 16))] * 2, K, None)


# -- layers ------------------------------------------------------------------------------------------------


class Block(nn.Module):
    """A decoder layer's Linears under the names the fused groups know (q/k/v, o; gate/up, down)."""

    def __init__(self, h: int = 64, bias: bool = False) -> None:
        super().__init__()
        self.self_attn, self.mlp = nn.Module(), nn.Module()
        a, m = self.self_attn, self.mlp
        a.q_proj, a.k_proj, a.v_proj = nn.Linear(h, 64, bias), nn.Linear(h, 32, bias), nn.Linear(h, 32, bias)
        a.o_proj = nn.Linear(64, h, bias)
        m.gate_proj, m.up_proj, m.down_proj = nn.Linear(h, 80, bias), nn.Linear(h, 80, bias), nn.Linear(80, h, bias)
        self.gain = nn.Parameter(torch.ones(h))  # a parameter that stays when every Linear is frozen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, m = self.self_attn, self.mlp
        x = x * self.gain
        h = x + a.o_proj(a.q_proj(x) * torch.cat([a.k_proj(x), a.v_proj(x)], -1))
        return h + m.down_proj(nn.functional.silu(m.gate_proj(h)) * m.up_proj(h))


ACT = QuantRecipe(scale="row", profile="compressed-tensors")
CONFIGS = {
    "nvfp4": NVFP4Config.from_recipe(ACT),
    "w4a4": NVFP4Config.from_recipe(ACT, frozen="w4a4"),
    "w4a16": NVFP4Config.from_recipe(ACT, frozen="w4a16"),
}


def _block(kind: str, bias: bool = False, seed: int = 0) -> Block:
    torch.manual_seed(seed)
    block = Block(bias=bias).to(device(), torch.float16)
    return convert(block, CONFIGS[kind])


@pytest.fixture
def launches(monkeypatch):
    """Group launches made (``DecodeLaunch.launch_group`` calls: a sibling group's, and ``run_group``'s)."""
    calls = []
    real = gd.DecodeLaunch.launch_group

    def counting(self, *args, **kwargs):
        calls.append(len(self.members))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(gd.DecodeLaunch, "launch_group", counting)
    return calls


@pytest.mark.parametrize("kind", list(CONFIGS))
@pytest.mark.parametrize("bias", [False, True])
def test_linked_layers_give_the_unlinked_outputs(kind, bias, launches):
    linked = _block(kind, bias)
    assert link_siblings(copy.deepcopy(linked)) == 2  # q/k/v and gate/up
    unlinked = copy.deepcopy(linked)
    link_siblings(unlinked, fused_groups=())
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(1)).to(device(), torch.float16)
    with torch.no_grad():
        y = linked(x)
        assert launches == [3, 2]  # one launch for q/k/v, one for gate/up
        y_alone = unlinked(x)
        assert launches == [3, 2]
    # the interpreter's tiles never split K (decode_config): the same bits as each layer's own launch
    assert torch.equal(y, y_alone)


def test_no_group_launch_above_small_m_or_with_autograd(launches):
    block = _block("w4a16")
    with torch.no_grad():
        block(torch.randn(SMALL_M + 1, 64, device=device(), dtype=torch.float16))
    assert launches == []
    x = torch.randn(4, 64, device=device(), dtype=torch.float16, requires_grad=True)
    y = block(x)  # the frozen layers' input gradient needs their own autograd nodes
    assert launches == [] and y.requires_grad
    y.sum().backward()
    assert x.grad is not None


def test_kept_outputs_are_handed_out_once_for_the_same_x_and_operands(launches):
    block = _block("w4a16")
    a = block.self_attn
    twin = copy.deepcopy(block)  # a copy loads unlinked: every layer alone
    b = twin.self_attn
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 64, generator=gen).to(device(), torch.float16)
    with torch.no_grad():
        q = a.q_proj(x)
        assert launches == [3]
        q2 = a.q_proj(x)  # called again: a new launch, a new tensor
        assert launches == [3, 3] and q2 is not q and torch.equal(q, q2)
        assert torch.equal(a.k_proj(x), b.k_proj(x)) and launches == [3, 3]  # kept from the second launch
        x.add_(1.0)  # x changed in place (version counter): v computes again, on the new x
        assert torch.equal(a.v_proj(x), b.v_proj(x)) and launches == [3, 3, 3]
        assert torch.equal(a.q_proj(x), b.q_proj(x)) and launches == [3, 3, 3]  # kept from v's launch
        new = b.k_proj.quantized_weight()  # k's weight replaced between the launch and k's call
        other = copy.deepcopy(new)
        other.data = new.data.flip(0).contiguous()
        a.k_proj.replace_weight(other)
        b.k_proj.replace_weight(other)
        assert torch.equal(a.k_proj(x), b.k_proj(x))  # not the kept output of the old weight: k alone
        assert launches == [3, 3, 3] and a.k_proj._siblings._kept is None
        # another tensor with x's values is another input
        assert torch.equal(a.v_proj(x.clone()), b.v_proj(x)) and launches == [3, 3, 3, 3]
        # a buffer written in place (its version counter) between the launch and the call: alone again
        a.q_proj(x)
        for layer in (a.k_proj, b.k_proj):
            layer.weight_scale_2.mul_(2.0)
        assert torch.equal(a.k_proj(x), b.k_proj(x)) and launches == [3, 3, 3, 3, 3]


def test_kept_outputs_die_with_their_input():
    block = _block("w4a16")
    group = block.self_attn.q_proj._siblings
    x = torch.randn(2, 64, device=device(), dtype=torch.float16)
    with torch.no_grad():
        block.self_attn.q_proj(x)
    assert group._kept is not None
    del x
    gc.collect()
    assert group._kept is None


def test_an_in_place_bias_update_or_a_moved_member_is_never_served_a_stale_output(launches):
    block = _block("nvfp4", bias=True)
    twin = copy.deepcopy(block)  # a copy loads unlinked: every layer alone
    a, b = block.self_attn, twin.self_attn
    x = torch.randn(2, 64, device=device(), dtype=torch.float16)
    with torch.no_grad():
        a.q_proj(x)
        for layer in (a.k_proj, b.k_proj):
            layer.bias.add_(100.0)
        assert torch.equal(a.k_proj(x), b.k_proj(x)) and launches == [3]
        a.v_proj.to("meta")  # offloaded: the others compute alone, not through a launch that reads it
        assert torch.equal(a.q_proj(x), b.q_proj(x)) and launches == [3]


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_a_group_launch_after_a_weight_change_reads_the_new_weights(kind, launches):
    """The group keeps its launch plan (checked operands) per weight version: a write in place (an outer
    scale, the codes, a master weight an optimizer moved), a ``.data`` reassignment or a replaced tensor makes
    the next launch read the new weights, as a fresh unlinked copy of the layers (no plan) computes them."""
    block = _block(kind, bias=True)
    x = torch.randn(3, 64, device=device(), dtype=torch.float16)
    frozen = kind != "nvfp4"

    def change(step: int) -> None:
        a = block.self_attn
        if not frozen:
            a.k_proj.weight.mul_(0.5)  # the master weight: W_q is quantized anew
        elif step == 0:
            a.k_proj.weight_scale_2.mul_(2.0)
        elif step == 1:
            a.v_proj.qweight.bitwise_xor_(0x11)  # flips the low bit of both codes of every byte
        elif step == 2:
            a.q_proj.weight_scale_2.data = a.q_proj.weight_scale_2 * 4.0  # same object, no version bump
        else:
            a.q_proj.weight_scale_2 = a.q_proj.weight_scale_2 * 0.25  # a new tensor

    with torch.no_grad():
        for step in range(5):
            a = block.self_attn
            ys = [a.q_proj(x), a.k_proj(x), a.v_proj(x)]
            assert len(launches) == step + 1 and launches[-1] == 3
            fresh = copy.deepcopy(block)  # the current weights (a copy shares the quantized bytes), no plans
            link_siblings(fresh, fused_groups=())
            b = fresh.self_attn
            for y, layer in zip(ys, (b.q_proj, b.k_proj, b.v_proj)):
                assert torch.equal(y, layer(x))
            if step < 4:
                change(step)


def test_only_frozen_groups_keep_a_plan_and_replacing_their_tensors_drops_it(launches):
    """A kept plan holds the tensors it was made for: a learner's group (NVFP4Linear, whose W_q is quantized
    anew into new tensors after every optimizer step) keeps none; a frozen group drops its plan, and each
    layer its own, as soon as load_state_dict replaces the layers' tensors or they move."""
    x = torch.randn(3, 64, device=device(), dtype=torch.float16)
    learner, frozen = _block("nvfp4"), _block("w4a16")
    with torch.no_grad():
        learner.self_attn.q_proj(x)
        frozen.self_attn.q_proj(x)
        frozen.self_attn.o_proj(torch.randn(3, 64, device=device(), dtype=torch.float16))
    assert launches == [3, 3]
    assert learner.self_attn.q_proj._siblings._plan is None
    a = frozen.self_attn
    assert a.q_proj._siblings._plan is not None and a.o_proj._w4a16_plan is not None
    state = {k: v.clone() for k, v in frozen.state_dict().items()}
    frozen.load_state_dict(state)
    assert a.q_proj._siblings._plan is None and a.o_proj._w4a16_plan is None
    with torch.no_grad():
        a.q_proj(x)
    assert a.q_proj._siblings._plan is not None
    frozen.to(torch.float16)  # a move (here to the same device and dtype: the tensors stay)
    assert a.q_proj._siblings._plan is None


def test_link_siblings_links_only_layers_that_fit():
    block = _block("nvfp4")
    a, m = block.self_attn, block.mlp
    group = a.q_proj._siblings
    assert isinstance(group, SiblingGroup) and group.members == [a.q_proj, a.k_proj, a.v_proj]
    assert m.gate_proj._siblings.members == [m.gate_proj, m.up_proj]
    assert a.o_proj._siblings is None and m.down_proj._siblings is None
    a.v_proj.config = dataclasses.replace(a.v_proj.config, activation=QuantRecipe())  # another activation
    m.up_proj.config = dataclasses.replace(m.up_proj.config, capturable=True)
    assert link_siblings(block) == 0
    assert all(layer._siblings is None for layer in (a.q_proj, a.k_proj, m.gate_proj))
    for layer in (a.v_proj, m.up_proj):
        layer.config = a.q_proj.config
    assert link_siblings(block) == 2
    unshared = NVFP4Config.from_recipe(ACT, frozen="w4a4")
    unshared = dataclasses.replace(unshared, frozen=dataclasses.replace(unshared.frozen, share_inputs=False))
    torch.manual_seed(0)
    assert link_siblings(convert(Block().to(device(), torch.float16), unshared)) == 0  # one x_q per layer
    stochastic = NVFP4Config.from_recipe(QuantRecipe(rounding="stochastic"), frozen="w4a4")
    assert link_siblings(convert(Block().to(device(), torch.float16), stochastic)) == 0  # one draw per layer
    only_linear = convert(Block(), NVFP4Config(linear=NVFP4LinearConfig(), skip=("*k_proj", "*up_proj")))
    assert only_linear.self_attn.q_proj._siblings.members == [only_linear.self_attn.q_proj,
                                                              only_linear.self_attn.v_proj]  # fmt: skip
    assert only_linear.mlp.gate_proj._siblings is None  # alone in its group


def test_copies_and_pickles_load_unlinked_and_link_again(launches):
    """A deep copy or a pickle carries no link (nor a sibling it would drag along, nor kept outputs);
    ``link_siblings`` links the copy to its own layers, one group object per group."""
    block = _block("w4a16")
    x = torch.randn(1, 64, device=device(), dtype=torch.float16)
    with torch.no_grad():
        block.self_attn.q_proj(x)  # keeps k's and v's outputs
    single = copy.deepcopy(block.self_attn.q_proj)
    assert single._siblings is None  # k and v are not copied with it
    buf = io.BytesIO()
    torch.save(block, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for model in (copy.deepcopy(block), loaded):
        assert all(getattr(m, "_siblings", None) is None for m in model.modules())
        assert link_siblings(model) == 2
        a, m = model.self_attn, model.mlp
        assert a.q_proj._siblings is a.k_proj._siblings is a.v_proj._siblings
        assert a.q_proj._siblings.members == [a.q_proj, a.k_proj, a.v_proj]
        assert m.gate_proj._siblings is m.up_proj._siblings is not block.mlp.gate_proj._siblings
        launches.clear()
        with torch.no_grad():
            assert torch.equal(model(x), block(x)) and launches == [3, 2, 3, 2]


def test_lora_base_layers_stay_linked(launches):
    """PEFT calls a LoRA layer's frozen base on the wrapper's input: the bases of q/k/v and gate/up keep one
    launch per group, whether linked before wrapping (by convert) or after (``q_proj.base_layer``)."""
    from peft import LoraConfig, get_peft_model

    from triage.trainers.peft_nvfp4 import nvfp4_lora

    torch.manual_seed(0)
    block, lora = nvfp4_lora(Block().to(device(), torch.float16), LoraConfig(r=4, target_modules="all-linear"),
                             CONFIGS["w4a16"])  # fmt: skip
    model = get_peft_model(block, lora)
    bases = [m for n, m in model.named_modules() if n.endswith("q_proj.base_layer")]
    assert len(bases) == 1 and bases[0]._siblings is not None
    assert link_siblings(model) == 2
    x = torch.randn(2, 64, device=device(), dtype=torch.float16)
    with torch.no_grad():
        y = model(x)
        assert launches == [3, 2]
        link_siblings(model, fused_groups=())
        assert torch.equal(y, model(x)) and launches == [3, 2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["w4a16", "nvfp4"])
@pytest.mark.parametrize("rows", [1, 16])
def test_a_captured_group_replays_the_eager_group(kind, rows, launches):
    """Captured inside ``capture_scope`` (as the sampler's graph step), a block's groups replay the eager
    outputs on new inputs copied into the graph's x; a capture outside the scope launches every member alone."""
    from triage.kernels.linear import capture_scope
    from triage.kernels.nvfp4.gemm_decode import graph_counters

    block = _block(kind)
    block.to(torch.bfloat16)
    x = torch.randn(rows, 64, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        block(x)  # warm-up: compiles, quantizes the weights
        launches.clear()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), graph_counters(), capture_scope():
            y = block(x)
        assert launches == [3, 2]
        plain = torch.cuda.CUDAGraph()
        with torch.cuda.graph(plain):
            y_plain = block(x)
        assert launches == [3, 2]
        for seed in range(3):
            x.copy_(torch.randn(rows, 64, generator=torch.Generator().manual_seed(seed)).to(x))
            graph.replay()
            plain.replay()
            torch.cuda.synchronize()
            eager = block(x.clone())
            assert torch.equal(y, eager) and torch.equal(y_plain, eager)


@pytest.mark.parametrize("kind, backend", [("nvfp4", "aot_eager"), ("w4a16", "inductor")])
def test_compiled_layers_still_run_their_groups(kind, backend, launches, monkeypatch):
    """Under ``torch.compile`` each layer's grad-free forward is one custom op whose implementation runs the
    group at run time: one launch per group, also under inductor, which hands the ops (``flexible_layout``)
    the one buffer of their input (here q/k/v's ``x * gain``) instead of a copy per op. The outputs: the same
    block compiled the same way with every layer alone, bit for bit (tiny K: the group's tiles and split are
    a lone launch's), and the eager outputs, except for W4A4 under inductor (on a GPU: inductor for both
    kinds), whose fused elementwise ops skip fp16 roundings that the activation quantizer can turn into
    another code."""
    if device().type == "cuda":
        backend = "inductor"
    block = _block(kind)
    alone = copy.deepcopy(block)
    link_siblings(alone, fused_groups=())
    x = torch.randn(2, 64, device=device(), dtype=torch.float16)
    monkeypatch.setattr(torch._inductor.config, "force_disable_caches", True)  # its keys omit op tags
    torch._dynamo.reset()
    compiled = torch.compile(block, backend=backend, fullgraph=True)
    compiled_alone = torch.compile(alone, backend=backend, fullgraph=True)
    calls = []
    with torch.no_grad():
        eager = block(x)
        for _ in range(2):
            launches.clear()
            y = compiled(x)
            calls.append(list(launches))
            y_alone = compiled_alone(x)
            assert launches == calls[-1], "the unlinked copy ran a group launch"
            assert torch.equal(y, y_alone)
            if kind == "w4a16" or backend == "aot_eager":  # nothing fused: eager's roundings
                torch.testing.assert_close(y, eager, atol=2e-3, rtol=2e-3)
    assert calls == [[3, 2], [3, 2]] and not block.self_attn.q_proj._siblings.compiled_alone


@pytest.mark.parametrize("kind", ["w4a16", "nvfp4"])
def test_ops_handed_copies_of_one_input_compute_alone_after_one_group_launch(kind, launches):
    """Where a compiled graph hands the members different buffers of equal values, the first member's launch
    finds its kept outputs unclaimed: the group's ops compute each member alone from then on (one wasted
    group launch, never one per member), with the eager outputs."""
    block = _block(kind)
    a = block.self_attn
    x = torch.randn(2, 64, device=device(), dtype=torch.float16)

    def run(m, xi):  # the op a compiled graph calls
        if kind == "w4a16":
            return torch.ops.triage.frozen_nvfp4_linear(xi, m._op_id, m.out_features)
        return torch.ops.triage.nvfp4_linear(xi, m.weight, m.bias, m._op_id, False, True)[0]

    with torch.no_grad():
        eager = [m(x) for m in (a.q_proj, a.k_proj, a.v_proj)]
        launches.clear()

        for _ in range(2):
            outs = [run(m, x.clone()) for m in (a.q_proj, a.k_proj, a.v_proj)]
            for y, e in zip(outs, eager):
                assert torch.equal(y, e)
    assert a.q_proj._siblings.compiled_alone and launches == [3]


@pytest.mark.parametrize("kind", ["w4a16", "w4a4", "nvfp4"])
@pytest.mark.parametrize("layout", ["row_stride", "column_major"])
def test_the_ops_take_their_input_in_any_layout(kind, layout, launches):
    """The custom ops are ``flexible_layout`` (inductor hands them its buffers as laid out): a strided or
    column-major x gives the contiguous x's outputs, bit for bit, with the group's one launch."""
    block = _block(kind)
    a = block.self_attn
    x = torch.randn(2, 64, device=device(), dtype=torch.float16)
    if layout == "row_stride":
        strided = torch.zeros(2, 128, device=device(), dtype=torch.float16)[:, :64].copy_(x)
    else:
        strided = x.t().contiguous().t()
    assert not strided.is_contiguous()

    def run(m, xi):
        if kind == "nvfp4":
            return torch.ops.triage.nvfp4_linear(xi, m.weight, m.bias, m._op_id, False, True)[0]
        return torch.ops.triage.frozen_nvfp4_linear(xi, m._op_id, m.out_features)

    with torch.no_grad():
        eager = [m(x) for m in (a.q_proj, a.k_proj, a.v_proj)]
        launches.clear()
        for y, e in zip([run(m, strided) for m in (a.q_proj, a.k_proj, a.v_proj)], eager):
            assert torch.equal(y, e)
    assert launches == [3]


@pytest.mark.parametrize("kind", ["w4a4", "nvfp4"])
def test_a_group_op_on_a_buffer_rewritten_without_a_version_bump_quantizes_it_anew(kind, launches):
    """Compiled code reuses a dead buffer (the same tensor object) for a later value, written by its kernels
    without a version bump: the next block's group, called on it, quantizes the new values, never the
    previous block's x_q (inside the ops no input quantization is shared beyond one group launch)."""
    blocks = [_block(kind, seed=0), _block(kind, seed=1)]

    def run(m, xi):  # the op a compiled graph calls
        if kind == "w4a4":
            return torch.ops.triage.frozen_nvfp4_linear(xi, m._op_id, m.out_features)
        return torch.ops.triage.nvfp4_linear(xi, m.weight, m.bias, m._op_id, False, True)[0]

    values = [torch.randn(2, 64, device=device(), dtype=torch.float16) for _ in blocks]
    members = [(b.self_attn.q_proj, b.self_attn.k_proj, b.self_attn.v_proj) for b in blocks]
    buf = values[0].clone()
    with torch.no_grad():
        eager = [[m(v) for m in ms] for v, ms in zip(values, members)]
        for i, ms in enumerate(members):
            if i:
                version = buf._version
                buf.data.copy_(values[i])  # bypasses the version counter, as compiled kernels do
                assert buf._version == version
            launches.clear()
            for y, e in zip([run(m, buf) for m in ms], eager[i]):
                assert torch.equal(y, e), i
            assert launches == [3]


@pytest.mark.parametrize("kind", ["w4a16", "nvfp4"])
def test_inside_ops_only_the_calls_right_after_a_launch_claim_its_outputs(kind, launches):
    """A member's op called after another op call (here o_proj's, between q's launch and k's claim, and x's
    buffer reused for another value without a version bump, as compiled code may: the key alone cannot tell)
    computes alone on what x holds, and the group's ops compute alone from then on."""
    block = _block(kind)
    a = block.self_attn

    def run(m, xi):  # the op a compiled graph calls
        if kind == "w4a16":
            return torch.ops.triage.frozen_nvfp4_linear(xi, m._op_id, m.out_features)
        return torch.ops.triage.nvfp4_linear(xi, m.weight, m.bias, m._op_id, False, True)[0]

    buf = torch.randn(2, 64, device=device(), dtype=torch.float16)
    new = torch.randn_like(buf)
    with torch.no_grad():
        eager = [m(new) for m in (a.k_proj, a.v_proj)]
        launches.clear()
        run(a.q_proj, buf)
        run(a.o_proj, torch.randn(2, 64, device=device(), dtype=torch.float16))
        buf.data.copy_(new)  # bypasses the version counter
        for y, e in zip([run(m, buf) for m in (a.k_proj, a.v_proj)], eager):
            assert torch.equal(y, e)
    assert launches == [3] and a.q_proj._siblings.compiled_alone


def test_compiled_layers_with_autograd_compute_alone_as_eager_ones_do(launches):
    """With autograd (a compiled training step) every NVFP4Linear computes alone, as in eager code: the op is
    told by its call site (inside an op's implementation grad is always off)."""
    block = _block("nvfp4")
    x = torch.randn(2, 64, device=device(), dtype=torch.float16, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager" if device().type == "cpu" else "inductor")
    launches.clear()
    compiled(x).sum().backward()
    block(x).sum().backward()
    assert launches == []


def test_frozen_fp32_outputs_and_bias_grads_do_not_depend_on_the_layout():
    """What a compiled graph may hand the ops (``flexible_layout``): a column-major x for a frozen W4A16
    layer's fp32 path, a column-major dy for the bias gradient; the row-major bits either way."""
    torch.manual_seed(0)
    frozen = convert(nn.Sequential(nn.Linear(64, 32)), CONFIGS["w4a16"])[0]
    x = torch.randn(2, 64)
    with torch.no_grad():
        assert torch.equal(frozen(x), frozen(x.t().contiguous().t()))
    layer = convert(nn.Sequential(nn.Linear(64, 32)), CONFIGS["nvfp4"])[0]
    x, dy = torch.randn(40, 64), torch.randn(40, 32) * 1e3
    grads = []
    for d in (dy, dy.t().contiguous().t()):
        layer.zero_grad()
        layer(x).backward(d)
        grads.append(layer.bias.grad.clone())
    assert torch.equal(*grads)
