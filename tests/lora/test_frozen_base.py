"""FrozenNVFP4Linear: forward/backward against torch twins, memory, immutability, bad input."""

from __future__ import annotations

import copy

import pytest
import torch
from lora_testkit import FAST
from torch import nn

from triage.kernels import NVFP4Config, NVFP4FrozenConfig, NVFP4Linear, NVFP4LinearConfig, convert
from triage.kernels.frozen_linear import FrozenNVFP4Linear, base_nbytes
from triage.kernels.nvfp4 import QuantRecipe, gemm_reference, gemm_w4a16_reference, quantize


def _frozen(n=40, k=48, *, bias=True, recipe=None, seed=0, scale=1.0, **config):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * scale)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    cfg = NVFP4FrozenConfig(**{**FAST, **config})
    return FrozenNVFP4Linear.from_linear(lin, cfg, recipe=recipe or QuantRecipe()), lin


def _dense64(layer: FrozenNVFP4Linear) -> torch.Tensor:
    return layer.quantized_weight().dequantize(torch.float64)


def test_freezing_an_nvfp4_linear_keeps_its_bytes_and_outputs_and_drops_the_master(nvfp4_model):
    ids = torch.randint(3, 400, (2, 9))
    lin = nvfp4_model.model.layers[0].mlp.down_proj
    wq = lin.quantized_weight()
    with torch.no_grad():
        before = nvfp4_model(ids).logits
    # w4a4 with the NVFP4Linear's own activation recipe and backends
    convert(nvfp4_model, NVFP4Config(linear=None, moe=None, frozen=NVFP4FrozenConfig.like(lin.config)))
    frozen = nvfp4_model.model.layers[0].mlp.down_proj
    assert isinstance(frozen, FrozenNVFP4Linear)
    assert torch.equal(frozen.qweight, wq.data) and torch.equal(
        frozen.weight_scale.view(torch.uint8), wq.scale.view(torch.uint8)
    )
    assert list(frozen.parameters()) == [] and not hasattr(frozen, "weight")
    assert not any(isinstance(m, NVFP4Linear) for m in nvfp4_model.modules())
    with torch.no_grad():
        after = nvfp4_model(ids).logits
    assert torch.equal(before, after)  # the same computation


def test_memory_is_about_0_56_byte_per_base_parameter():
    layer, _ = _frozen(256, 512, bias=False)
    tensors = [t for t in layer.state_dict().values()] + [t for t in layer.parameters()]
    counted = sum(t.numel() * t.element_size() for t in tensors)
    params = 256 * 512
    assert counted == layer.nbytes()
    assert (
        params * 0.5625 <= counted <= params * 0.5625 + 16
    )  # codes 0.5 + e4m3 scales 1/16 + two fp32 scalars
    cached, _ = _frozen(256, 512, bias=False, cache_expanded=True)
    x = torch.randn(4, 512, requires_grad=True)
    cached(x).sum().backward()  # the input gradient fills the cache
    assert cached.nbytes() == counted + params * 2  # + the bf16 expansion, only when asked for
    layer(x).sum().backward()
    assert layer.nbytes() == counted  # without the option the expansion is temporary


def test_base_nbytes_of_a_frozen_model(nvfp4_model):
    convert(nvfp4_model, NVFP4Config(linear=None, moe=None, frozen=NVFP4FrozenConfig(**FAST)))
    nbytes, params = base_nbytes(nvfp4_model)
    assert params == 2 * (64 * 64 * 2 + 64 * 32 * 2 + 64 * 128 * 3)
    assert nbytes / params == pytest.approx(0.5625, abs=2e-3)


@pytest.mark.parametrize("row_scale", [False, True], ids=["tensor-scale", "row-scale"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w4a4_forward_and_input_grad_match_the_torch_twins(row_scale, dtype):
    recipe = QuantRecipe(scale="row") if row_scale else QuantRecipe(block="16x16")
    layer, _ = _frozen(40, 48, recipe=recipe)
    x = (torch.randn(2, 3, 96)[..., ::2] * 3).to(dtype).requires_grad_(True)  # non-contiguous, 3-D
    y = layer(x)
    xq = quantize(x.detach().reshape(-1, 48), QuantRecipe())
    ref = gemm_reference(xq, layer.quantized_weight(), out_dtype=dtype, bias=layer.bias)
    assert y.dtype == dtype and torch.equal(y.detach().reshape(-1, 40), ref)
    dy = torch.randn(2, 3, 40).to(dtype)
    y.backward(dy)
    dx_ref = (dy.double().reshape(-1, 40) @ _dense64(layer)).to(dtype).reshape(2, 3, 48)
    torch.testing.assert_close(x.grad, dx_ref, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w4a16_forward_matches_the_weight_only_twin(dtype):
    layer, _ = _frozen(40, 48, compute="w4a16")
    x = torch.randn(5, 48).to(dtype)
    y = layer(x)
    if dtype == torch.bfloat16:
        ref = gemm_w4a16_reference(x, layer.quantized_weight(), bias=layer.bias)
        assert torch.equal(y, ref)
    else:  # fp32 activations: fp32 matmul on the exact expansion
        ref = (x.double() @ _dense64(layer).T + layer.bias.double()).float()
        torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
def test_triton_paths_under_the_interpreter_match_the_reference(mode):
    """Default backends ("auto") run the Triton kernels (interpreter on CPU, the real ones on a GPU)."""
    torch.manual_seed(0)
    lin = nn.Linear(32, 24, bias=True)
    ref_layer = FrozenNVFP4Linear.from_linear(lin, NVFP4FrozenConfig(compute=mode, **FAST))
    auto = FrozenNVFP4Linear.from_quantized(
        ref_layer.quantized_weight(), ref_layer.bias, NVFP4FrozenConfig(compute=mode)
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    auto, ref_layer = auto.to(device), ref_layer.to(device)
    x = torch.randn(3, 32, device=device, dtype=torch.bfloat16, requires_grad=True)
    y = auto(x)
    torch.testing.assert_close(y, ref_layer(x.detach()), rtol=1e-2, atol=1e-2)
    y.float().sum().backward()
    dx_ref = (torch.ones(3, 24, dtype=torch.float64, device=device) @ _dense64(auto)).to(torch.bfloat16)
    torch.testing.assert_close(x.grad, dx_ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    "weight",
    [
        torch.zeros(32, 32),  # zero blocks: outer scale 1, codes 0
        torch.full((32, 32), 3e4),  # huge
        torch.full((32, 32), 1e-30),  # subnormal-small
    ],
    ids=["zeros", "huge", "tiny"],
)
def test_adversarial_weights_give_finite_exact_results(weight):
    lin = nn.Linear(32, 32, bias=False)
    with torch.no_grad():
        lin.weight.copy_(weight)
    layer = FrozenNVFP4Linear.from_linear(lin, NVFP4FrozenConfig(compute="w4a16", **FAST))
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    y = layer(x)
    assert torch.isfinite(y).all()
    # fp32 activations: an fp32 matmul on the exact expansion, then the outer scale. Each of the K = 32
    # products and sums and the scaling round once in fp32 (unit roundoff u = 2^-24), in whatever order the
    # BLAS sums: |y - y64| <= γ·(|x|·|W|ᵀ), γ = (K + 1)u / (1 - (K + 1)u) (no overflow or underflow: the
    # scales keep huge and tiny weights in range; zero weights give exact zeros). No bound relative to |y|
    # alone holds: with all-equal weights the sums cancel, by how much depends on x.
    w64, x64 = _dense64(layer), x.detach().double()
    ku = (x.shape[1] + 1) * 2.0**-24
    bound = ku / (1 - ku) * (x64.abs() @ w64.abs().T)
    assert ((y.double() - x64 @ w64.T).abs() <= bound).all()
    y.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_nan_weights_and_bad_inputs_are_refused_with_a_name():
    lin = nn.Linear(32, 16)
    with torch.no_grad():
        lin.weight[3, 5] = float("nan")
    with pytest.raises(ValueError, match=r"NaN/Inf.*\[3, 5\]"):
        FrozenNVFP4Linear.from_linear(lin)
    model = nn.Sequential(nn.Linear(32, 16), lin)
    with pytest.raises(ValueError, match="layer '1'"):
        convert(
            model, NVFP4Config(linear=NVFP4LinearConfig(weight=QuantRecipe()), frozen=NVFP4FrozenConfig())
        )
    layer, _ = _frozen(16, 32)
    with pytest.raises(ValueError, match="last dim 31"):
        layer(torch.randn(2, 31))
    with pytest.raises(TypeError, match="floating point"):
        layer(torch.ones(2, 32, dtype=torch.long))
    with pytest.raises(ValueError, match="not a multiple of 16"):
        FrozenNVFP4Linear.from_linear(nn.Linear(24, 16), NVFP4FrozenConfig(), recipe=QuantRecipe(pad=True))
    with pytest.raises(ValueError, match="compute must be one of"):
        NVFP4FrozenConfig(compute="w8a8")
    with pytest.raises(ValueError, match="Hadamard"):
        NVFP4FrozenConfig(activation=QuantRecipe(hadamard=True))


def test_dtype_casts_move_but_never_cast_the_quantized_bytes_and_deepcopy_shares_them():
    layer, _ = _frozen(16, 32)
    dup = copy.deepcopy(layer).to(torch.bfloat16)
    for name in ("qweight", "weight_scale", "weight_scale_2", "weight_encode_scale"):
        assert getattr(dup, name).data_ptr() == getattr(layer, name).data_ptr(), name
        assert getattr(dup, name).dtype == getattr(layer, name).dtype, name
    assert dup.bias.dtype == torch.bfloat16 and dup.bias.data_ptr() != layer.bias.data_ptr()
    x = torch.randn(3, 32).bfloat16()  # the same activation bytes for both: the same W4A4 codes
    torch.testing.assert_close(dup(x).float(), layer(x.float()), rtol=1e-2, atol=1e-2)


def test_load_state_dict_replaces_instead_of_writing_into_shared_bytes():
    layer, _ = _frozen(16, 32, seed=0)
    other, _ = _frozen(16, 32, seed=1)
    dup = copy.deepcopy(layer)
    before = layer.qweight.clone()
    dup.load_state_dict(other.state_dict())
    assert torch.equal(layer.qweight, before)  # the original (sharing the bytes) is untouched
    assert torch.equal(dup.qweight, other.qweight)
    x = torch.randn(2, 32)
    assert torch.equal(dup(x), other(x))
    bad = dict(other.state_dict())
    bad["qweight"] = bad["qweight"][:8]
    with pytest.raises(RuntimeError, match="qweight: expected"):
        dup.load_state_dict(bad)
    with pytest.raises(RuntimeError, match="Missing key"):
        dup.load_state_dict({k: v for k, v in other.state_dict().items() if k != "weight_scale"})


def test_nvfp4linear_config_is_inherited_when_freezing():
    lin = NVFP4Linear(32, 16, config=NVFP4LinearConfig(activation=QuantRecipe(profile="modelopt"), **FAST))
    frozen = FrozenNVFP4Linear.from_linear(lin)
    assert frozen.config.activation.profile == "modelopt" and frozen.config.compute == "w4a4"
    x = torch.randn(5, 32)
    assert torch.equal(frozen(x), lin(x).detach())
    with pytest.raises(ValueError, match="keeps its own weight recipe"):
        FrozenNVFP4Linear.from_linear(lin, recipe=QuantRecipe())


@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
def test_k_not_a_multiple_of_16_with_padded_recipes(mode):
    pad = QuantRecipe(pad=True)
    lin = nn.Linear(40, 24, bias=False)
    layer = FrozenNVFP4Linear.from_linear(
        lin, NVFP4FrozenConfig(compute=mode, activation=pad, **FAST), recipe=pad
    )
    assert layer.qweight.shape == (24, 24)  # Kp = 48
    x = torch.randn(2, 5, 40, requires_grad=True)
    y = layer(x)
    if mode == "w4a16":
        torch.testing.assert_close(y.double(), x.detach().double() @ _dense64(layer).T, rtol=1e-6, atol=1e-6)
    else:
        xq = quantize(x.detach().reshape(-1, 40), pad)
        assert torch.equal(
            y.detach().reshape(-1, 24), gemm_reference(xq, layer.quantized_weight(), out_dtype=x.dtype)
        )
    y.sum().backward()
    torch.testing.assert_close(x.grad.double(), torch.ones(2, 5, 24, dtype=torch.float64) @ _dense64(layer))


def test_loading_the_learner_state_into_a_bf16_copy_casts_only_the_bias():
    """A bf16 sampler copy (HFSampler ``sampler_model="copy"``) reloads the learner's state at every sync."""
    layer, _ = _frozen(16, 32)
    dup = copy.deepcopy(layer).to(torch.bfloat16)
    dup.load_state_dict(layer.state_dict())  # the second sync: an fp32 bias into the bf16 copy
    dup.load_state_dict(layer.state_dict())
    assert dup.bias.dtype == torch.bfloat16 and torch.equal(dup.bias, layer.bias.bfloat16())
    assert dup.qweight.data_ptr() == layer.qweight.data_ptr()
    bad = dict(layer.state_dict())
    bad["weight_scale"] = bad["weight_scale"].float()  # the quantized bytes are never cast
    with pytest.raises(RuntimeError, match="weight_scale: expected"):
        dup.load_state_dict(bad)


def test_w4a16_decode_plan_follows_every_weight_change_and_is_not_copied():
    """A grad-free W4A16 call on the decode kernel keeps its launch and checked weight per weight token: every
    in-place write (outer scale, codes, bias), ``.data`` reassignment and replaced tensor gives what
    ``gemm_w4a16`` gives on the current weights; replace_weight and load_state_dict drop the plan at once;
    buffers made under inference_mode (no version counter) compute without one; copies and pickles carry
    no plan, and a compiled layer still saves."""
    import io

    from triage.kernels.nvfp4 import gemm_w4a16

    device = "cuda" if torch.cuda.is_available() else "cpu"
    lin = nn.Linear(48, 40, bias=True)
    layer = FrozenNVFP4Linear.from_linear(lin, NVFP4FrozenConfig(compute="w4a16")).to(device)
    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(1)).to(device, torch.bfloat16)

    def check() -> torch.Tensor:
        with torch.no_grad():
            y = layer(x)
            assert layer._w4a16_plan is not None and layer._w4a16_plan[2] is not None  # the decode route
            assert torch.equal(y, gemm_w4a16(x, layer.quantized_weight(), bias=layer.bias))
        return y

    def reassign_data() -> None:
        layer.weight_scale_2.data = layer.weight_scale_2 * 4.0  # the same tensor object, no version bump

    def assign() -> None:
        layer.weight_scale_2 = layer.weight_scale_2 * 0.5  # a new tensor

    def replace() -> None:
        w = layer.quantized_weight()
        layer.replace_weight(type(w)(data=w.data.clone(), scale=w.scale.clone(), global_scale=w.global_scale * 3,
                                     shape=w.shape, dtype=w.dtype, recipe=w.recipe))  # fmt: skip
        assert layer._w4a16_plan is None

    def load() -> None:
        layer.load_state_dict({**layer.state_dict(), "weight_scale_2": layer.weight_scale_2 * 0.5})
        assert layer._w4a16_plan is None

    ys = [check()]
    with torch.no_grad():
        for change in (
            lambda: layer.weight_scale_2.mul_(2.0),
            lambda: layer.qweight.bitwise_xor_(0x11),
            lambda: layer.bias.add_(1.0),
            reassign_data,
            assign,
            replace,
            load,
        ):
            change()
            ys.append(check())
    assert all(not torch.equal(a, b) for a, b in zip(ys, ys[1:]))
    assert "_w4a16_plan" not in copy.deepcopy(layer).__dict__
    buf = io.BytesIO()
    torch.save(layer, buf)
    buf.seek(0)
    assert "_w4a16_plan" not in torch.load(buf, weights_only=False).__dict__
    layer.compile()  # nn.Module's own state rules still apply (its compiled call is not pickled)
    torch.save(layer, io.BytesIO())
    with torch.inference_mode():
        frozen = FrozenNVFP4Linear.from_linear(lin, NVFP4FrozenConfig(compute="w4a16")).to(device)
    with torch.no_grad():
        a, b = frozen(x), frozen(x)
    assert torch.equal(a, b) and torch.equal(a, gemm_w4a16(x, frozen.quantized_weight(), bias=frozen.bias))


def test_strided_codes_and_scales_are_stored_row_major_once():
    """A weight whose codes / scales are strided views (a transposed copy transposed back) is stored row-major
    at construction and at replace_weight, as the decode kernel streams it (no copy per call); row-major
    tensors are kept as they are, not copied. The outputs are the contiguous weight's."""
    from dataclasses import replace

    layer, _ = _frozen(32, 64, bias=False)
    w = layer.quantized_weight()
    strided = replace(w, data=w.data.t().contiguous().t(), scale=w.scale.t().contiguous().t())
    assert not strided.data.is_contiguous() and not strided.scale.is_contiguous()
    x = torch.randn(3, 64)
    with torch.no_grad():
        want = layer(x)
        built = FrozenNVFP4Linear(strided, config=layer.config)
        layer.replace_weight(strided)
        for other in (built, layer):
            assert other.qweight.is_contiguous() and other.weight_scale.is_contiguous()
            assert torch.equal(other(x), want)
    kept = FrozenNVFP4Linear(w, config=layer.config)
    assert kept.qweight.data_ptr() == w.data.data_ptr() and kept.weight_scale.data_ptr() == w.scale.data_ptr()
