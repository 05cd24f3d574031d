"""Quantized-weight caches follow every optimizer and in-place update; non-finite operands give NaN outputs.

Plain training loops (no TRL): after each optimizer step the layer's output equals, bit for bit, the output
of a layer freshly converted from the new weights. ``torch.optim.AdamW(fused=True)`` (transformers'
default ``adamw_torch_fused``) and fused SGD write the parameters without bumping their ``_version``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _dense_operands import device
from torch import nn

from triage.kernels import FrozenNVFP4Linear, NVFP4Linear, NVFP4LinearConfig
from triage.kernels.moe.experts import NVFP4MoEConfig, NVFP4MoeExperts
from triage.kernels.nvfp4 import QuantRecipe, quantize
from triage.kernels.nvfp4.matmul import gemm

CFG = NVFP4LinearConfig(quant_backend="torch", gemm_backend="reference")
OPTIMIZERS = {
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=0.05, fused=True),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=0.05, foreach=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "sgd-fused": lambda ps: torch.optim.SGD(ps, lr=0.05, fused=True),
}


def _fresh_linear(layer: NVFP4Linear) -> NVFP4Linear:
    lin = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
    with torch.no_grad():
        lin.weight.copy_(layer.weight)
        if layer.bias is not None:
            lin.bias.copy_(layer.bias)
    return NVFP4Linear.from_linear(lin, layer.config)


@pytest.mark.parametrize("backward", ["bf16-backward", "nvfp4-backward"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_nvfp4_linear_follows_every_optimizer(name, backward):
    torch.manual_seed(0)
    layer = NVFP4Linear(32, 16, config=dataclasses.replace(CFG, backward=backward))
    opt = OPTIMIZERS[name](layer.parameters())
    x, dy = torch.randn(8, 32), torch.randn(8, 16)
    for _ in range(3):
        (layer(x) * dy).sum().backward()  # the cache holds this step's W_q
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            assert torch.equal(layer(x), _fresh_linear(layer)(x))


def test_nvfp4_linear_follows_manual_updates():
    from triage.kernels.linear import invalidate_weight_caches

    torch.manual_seed(0)
    layer = NVFP4Linear(32, 16, config=CFG)
    x = torch.randn(4, 32)
    with torch.no_grad():
        layer(x)
        layer.weight.add_(0.3)  # autograd-visible in-place write: bumps _version
        assert torch.equal(layer(x), _fresh_linear(layer)(x))
        layer.load_state_dict({"weight": torch.randn(16, 32), "bias": torch.randn(16)})
        assert torch.equal(layer(x), _fresh_linear(layer)(x))
        for p in layer.parameters():  # a hand-written update loop through .data: invisible to any key ...
            p.data.add_(0.7)
        invalidate_weight_caches()  # ... so it is the user's one call
        assert torch.equal(layer(x), _fresh_linear(layer)(x))


class _Experts(nn.Module):
    """transformers-5 fused experts layout (what NVFP4MoeExperts wraps)."""

    def __init__(self, e=4, h=32, i=16):
        super().__init__()
        self.num_experts, self.hidden_dim, self.intermediate_dim = e, h, i
        self.gate_up_proj = nn.Parameter(torch.randn(e, 2 * i, h) * 0.2)
        self.down_proj = nn.Parameter(torch.randn(e, h, i) * 0.2)
        self.act_fn = nn.SiLU()


def _fresh_experts(m: NVFP4MoeExperts) -> NVFP4MoeExperts:
    e = _Experts(m.num_experts, m.hidden_dim, m.intermediate_dim)
    with torch.no_grad():
        e.gate_up_proj.copy_(m.gate_up_proj)
        e.down_proj.copy_(m.down_proj)
    return NVFP4MoeExperts(e, m.config)


@pytest.mark.parametrize("backward", ["bf16-backward", "nvfp4-backward"])
@pytest.mark.parametrize("name", ["adamw-fused", "adamw-foreach", "sgd"])
def test_moe_experts_follow_every_optimizer(name, backward):
    torch.manual_seed(0)
    weight = QuantRecipe(scale="expert", block="16x16")
    cfg = NVFP4MoEConfig(gemm_backend="reference", backward=backward, weight=weight)
    experts = NVFP4MoeExperts(_Experts(), cfg)
    opt = OPTIMIZERS[name](experts.parameters())
    x = torch.randn(6, 32)
    idx = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]])
    w, dy = torch.rand(6, 2), torch.randn(6, 32)
    for _ in range(3):
        (experts(x, idx, w) * dy).sum().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            assert torch.equal(experts(x, idx, w), _fresh_experts(experts)(x, idx, w))


# ----------------------------------------------------------------------------------------- non-finite values


@pytest.mark.parametrize("quant_backend", ["torch", "triton"])  # triton: the kernel-side rule (rows_plan)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_nonfinite_weight_or_input_gives_nan_like_nn_linear(bad, quant_backend):
    torch.manual_seed(0)
    layer = NVFP4Linear(32, 16, config=dataclasses.replace(CFG, quant_backend=quant_backend)).to(device())
    x = torch.randn(4, 32).to(device())
    with torch.no_grad():
        assert torch.isfinite(layer(x)).all()
        xb = x.clone()
        xb[1, 3] = bad
        assert not layer.to_linear()(xb)[1].isfinite().any()  # nn.Linear: NaN/Inf where it enters
        assert layer(xb).isnan().all()
        layer.weight[2, 5] = bad  # bumps _version: the cache re-quantizes
        assert layer(x).isnan().all()  # was 0 / finite: the quantizer maps NaN to finite codes


@pytest.mark.parametrize("quant_backend", ["torch", "triton"])  # triton: the kernel's per-row rule
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_per_row_scales_keep_a_nonfinite_value_in_its_row_like_nn_linear(bad, quant_backend):
    """Per-row outer scales over 1×16 blocks: a NaN/±Inf in x row r makes output row r NaN, in W row n
    output column n; every other output is what it is without that value (nn.Linear's NaN pattern)."""
    torch.manual_seed(0)
    row = QuantRecipe(scale="row", profile="compressed-tensors")
    config = dataclasses.replace(CFG, activation=row, weight=row, quant_backend=quant_backend)
    layer = NVFP4Linear(32, 16, config=config).to(device())
    x = torch.randn(4, 32).to(device())
    with torch.no_grad():
        clean = layer(x)
        assert clean.isfinite().all()
        xb = x.clone()
        xb[1, 3] = bad
        y = layer(xb)
        assert y[1].isnan().all() and torch.equal(y[[0, 2, 3]], clean[[0, 2, 3]])
        frozen = FrozenNVFP4Linear.from_linear(layer)  # W4A4 with the same activation recipe and backends
        assert torch.equal(frozen(x), clean)
        y = frozen(xb)
        assert y[1].isnan().all() and torch.equal(y[[0, 2, 3]], clean[[0, 2, 3]])
        layer.weight[2, 5] = bad
        y = layer(x)
        others = [n for n in range(16) if n != 2]
        assert y[:, 2].isnan().all() and torch.equal(y[:, others], clean[:, others])


#: Recipes of the non-finite rule's plan tests: ``(id, recipe, applies)``, ``applies``: the kernel applies the rule
_RULE_RECIPES = [
    ("te", QuantRecipe(), True),  # TE: per-tensor dynamic
    ("te-16x16", QuantRecipe(block="16x16"), True),  # the weights' recipe: W's rule in the kernel too
    ("te-hadamard", QuantRecipe(hadamard=True), True),
    ("te-stochastic", QuantRecipe(rounding="stochastic"), True),  # the nvfp4-backward grad recipe's rounding
    ("ct", QuantRecipe(profile="compressed-tensors"), True),
    ("modelopt", QuantRecipe(profile="modelopt"), True),
    ("ct-row", QuantRecipe(scale="row", profile="compressed-tensors"), True),  # per-row: the rule per row
    ("te-row", QuantRecipe(scale="row"), True),  # per-row TE: the amax ignores NaN, the kernel's flag sees it
    ("te-row-hadamard", QuantRecipe(scale="row", hadamard=True), True),
    ("static", QuantRecipe(scale_source="static", static_amax=4.0), False),  # given scales: the layer's rule
    ("checkpoint", QuantRecipe(scale_source="checkpoint", checkpoint_scale=600.0), False),
    ("none", QuantRecipe(scale="none"), False),
]


def _same_quantization(got, want) -> None:
    """Equal codes, block and encode scales, amax and decode scale (NaN where the other is NaN)."""
    assert torch.equal(got.data, want.data) and torch.equal(got.scale.view(torch.uint8), want.scale.view(torch.uint8))
    ge, we = got.global_encode_scale, want.global_encode_scale
    assert torch.equal(ge.isnan(), we.isnan()) and torch.equal(ge.nan_to_num(), we.nan_to_num())
    for a, b in ((got.amax, want.amax), (got.global_scale, want.global_scale)):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.shape == b.shape and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("recipe", [r for _, r, _ in _RULE_RECIPES], ids=[i for i, _, _ in _RULE_RECIPES])
@pytest.mark.parametrize("dtype,bad", [(torch.float32, None), (torch.bfloat16, float("nan")),
                                       (torch.float16, float("inf")), (torch.float32, -float("inf")),
                                       (torch.bfloat16, "overflow"), (torch.float16, "overflow")])  # fmt: skip
def test_the_quantizer_plan_applies_the_nonfinite_rule_as_the_torch_ops_do(recipe, dtype, bad):
    """The layers' Triton plan (rows_plan(nonfinite=True)) puts the non-finite rule into the quantizer for
    per-tensor and per-row scales: the same codes, block and encode scales as the plain quantizer, and the
    decode scale nan_if_nonfinite gives (equal bits when finite, NaN when not; per row: row 5 alone)."""
    from triage.kernels.linear import _quantize, _rows_plan, nan_if_nonfinite

    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 64, generator=g).to(dtype)
    if bad == "overflow":  # finite input whose rotation overflows bf16 (Hadamard); finite otherwise
        x[5, :16] = torch.finfo(dtype).max
    elif bad is not None:
        x[5, 7] = bad
    x = x.to(device())
    plan = _rows_plan(recipe, "triton", tuple(x.shape), dtype, x.device, None)
    assert plan.nonfinite == (recipe.scale in ("tensor", "row") and recipe.scale_source == "dynamic")
    got = _quantize(x, recipe, "triton", seed=7, plan=plan)
    want = nan_if_nonfinite(quantize(x, recipe, backend="triton", seed=7), x)
    _same_quantization(got, want)
    if bad not in (None, "overflow"):
        if recipe.scale == "row":  # the rule per row: row 5 alone
            assert got.global_scale.reshape(-1).isnan().tolist() == [r == 5 for r in range(32)]
        else:
            assert got.global_scale.isnan().all()


@pytest.mark.parametrize(
    "recipe",
    [r for _, r, _ in _RULE_RECIPES if r.block == "1x16"],
    ids=[i for i, r, _ in _RULE_RECIPES if r.block == "1x16"],
)
@pytest.mark.parametrize("dtype,bad", [(torch.bfloat16, None), (torch.bfloat16, float("nan")),
                                       (torch.float16, -float("inf")), (torch.bfloat16, "overflow")])  # fmt: skip
def test_the_columnwise_plan_applies_the_nonfinite_rule_as_the_torch_ops_do(recipe, dtype, bad):
    """nvfp4-backward's wgrad operands xᵀ, dyᵀ (columnwise quantizer, columns_plan(nonfinite=True)): the rule
    in the kernel for per-tensor and per-row scales, the same quantization as the torch ops give Y = xᵀ
    (per row: Y's row 7, x's channel 7, alone)."""
    from triage.kernels.linear import _columns_plan, _quantize_t, nan_if_nonfinite
    from triage.kernels.nvfp4.quantize_columns import quantize_columnwise

    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 48, generator=g).to(dtype)  # 64 tokens (Y's blocks run along them), 48 channels
    if bad == "overflow":  # finite input whose rotation overflows (Hadamard); finite otherwise
        x[:16, 7] = torch.finfo(dtype).max
    elif bad is not None:
        x[5, 7] = bad
    x = x.to(device())
    plan = _columns_plan(recipe, "triton", tuple(x.shape), dtype, x.device, True)
    applies = dict((i, a) for i, _, a in _RULE_RECIPES)[[i for i, r, _ in _RULE_RECIPES if r == recipe][0]]
    assert plan.nonfinite == applies
    got = _quantize_t(x, recipe, "triton", seed=7, expanded=True, plan=plan)
    want = nan_if_nonfinite(quantize_columnwise(x, recipe, backend="triton", seed=7, emit_expanded=torch.bfloat16), x.t())
    _same_quantization(got, want)
    assert torch.equal(got.expanded.view(torch.int16), want.expanded.view(torch.int16))
    if bad not in (None, "overflow"):
        if recipe.scale == "row":
            assert got.global_scale.reshape(-1).isnan().tolist() == [c == 7 for c in range(48)]
        else:
            assert got.global_scale.isnan().all()


@pytest.mark.parametrize("quant_backend", ["torch", "triton"])  # triton: dy's rule in the kernel (rows_plan)
def test_nonfinite_gradients_give_nan_in_nvfp4_backward(quant_backend):
    torch.manual_seed(0)
    config = dataclasses.replace(CFG, backward="nvfp4-backward", quant_backend=quant_backend)
    layer = NVFP4Linear(32, 16, config=config).to(device())
    x = torch.randn(16, 32).to(device()).requires_grad_()
    dy = torch.randn(16, 16).to(device())
    dy[3, 4] = float("nan")
    layer(x).backward(dy)
    assert x.grad.isnan().all() and layer.weight.grad.isnan().all()


def test_nonfinite_expert_weight_or_token_gives_nan():
    torch.manual_seed(0)
    cfg = NVFP4MoEConfig(gemm_backend="reference")
    experts = NVFP4MoeExperts(_Experts(), cfg)
    x, idx, w = torch.randn(4, 32), torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]]), torch.rand(4, 2)
    with torch.no_grad():
        assert torch.isfinite(experts(x, idx, w)).all()
        xb = x.clone()
        xb[0, 0] = float("inf")
        assert experts(xb, idx, w).isnan().all()
        experts.down_proj[1, 0, 0] = float("nan")
        assert experts(x, idx, w).isnan().all()


def test_frozen_base_nan_input_gives_nan():
    from triage.kernels.frozen_linear import FrozenNVFP4Linear, NVFP4FrozenConfig

    torch.manual_seed(0)
    frozen = FrozenNVFP4Linear.from_linear(
        nn.Linear(32, 16), NVFP4FrozenConfig(quant_backend="torch", gemm_backend="reference")
    )
    x = torch.randn(4, 32)
    x[2, 7] = float("nan")
    assert frozen(x).isnan().all()


@pytest.mark.parametrize("backend", ["cublas", "triton", "reference"])
def test_a_nan_device_scale_reaches_the_output_even_when_the_alpha_comes_from_the_recipe(backend):
    """A static activation recipe gives cuBLAS its alpha from the recipe (no device read): a NaN the layer
    put in the device scale must still reach every output."""
    torch.manual_seed(0)
    recipe = QuantRecipe(scale_source="static", static_amax=4.0)
    a = quantize(torch.randn(80, 32).to(device()), recipe, backend="torch")
    b = quantize(torch.randn(16, 32).to(device()), QuantRecipe(), backend="torch")
    a = dataclasses.replace(a, global_scale=a.global_scale * float("nan"))
    assert gemm(a, b, out_dtype=torch.float32, backend=backend).isnan().all()


@pytest.mark.parametrize("weight", ["te-16x16", "te-row", "static"])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), "strided", "padded"])
def test_the_weight_quantization_keeps_the_rule_and_the_expansion_of_the_plain_quantizer(weight, bad):
    """The layer's W_q (``_quantize_weight``: the Triton plan with the rule inside where it applies, the exact
    bf16 expansion written in the same pass) equals the plain quantizer's under the torch rule: codes, scales,
    decode scale (NaN for a non-finite W, per row for a per-row scale) and the expansion's bits; a strided W
    (the plain path) and K % 16 != 0 with padding included."""
    from triage.kernels.linear import _quantize_weight, nan_if_nonfinite

    recipe = dict((i, r) for i, r, _ in _RULE_RECIPES)[weight]
    k = 40 if bad == "padded" else 48
    recipe = dataclasses.replace(recipe, pad=True) if bad == "padded" else recipe
    if bad == "padded" and recipe.block == "16x16":
        pytest.skip("16x16 weight tiles take K % 16 == 0")
    cfg = NVFP4LinearConfig(weight=recipe, quant_backend="triton", gemm_backend="triton",
                            activation=QuantRecipe(pad=bad == "padded"))  # fmt: skip
    g = torch.Generator().manual_seed(4)
    w = torch.randn(32, 2 * k if bad == "strided" else k, generator=g).to(torch.bfloat16)
    w = w[:, ::2] if bad == "strided" else w
    if isinstance(bad, float):
        w[5, 3] = bad
    w = w.to(device())
    got = _quantize_weight(w, cfg)
    want = nan_if_nonfinite(quantize(w, recipe, backend="triton", emit_expanded=torch.bfloat16), w)
    _same_quantization(got.quantized, want)
    assert got.expanded is not None
    assert torch.equal(got.expanded.view(torch.int16), want.expanded.view(torch.int16))
    if isinstance(bad, float) and recipe.scale_source == "dynamic":
        nan = got.quantized.global_scale.reshape(-1).isnan().tolist()
        assert nan == ([r == 5 for r in range(32)] if recipe.scale == "row" else [True])
