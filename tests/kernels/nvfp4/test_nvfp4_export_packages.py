"""The exported bytes against the producers' own code: compressed-tensors 0.20.1 (``generate_gparam``,
``calculate_qparams``, ``NVFP4PackedCompressor.compress``) and nvidia-modelopt 0.47.0 (``mtq.quantize`` +
``export_hf_checkpoint``), on bf16, fp16 and fp32 weights. Both are test-only dependencies (``dev`` extra)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from triage.kernels.nvfp4 import export_nvfp4_checkpoint, load_nvfp4_checkpoint
from triage.kernels.nvfp4.export import FUSED_GROUPS, compressed_tensors_quantize

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def assert_same_tensors(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), f"{what}: {sorted(set(got) ^ set(want))[:6]}"
    bad = [
        k
        for k in want
        if got[k].dtype != want[k].dtype
        or got[k].shape != want[k].shape
        or not torch.equal(raw(got[k]), raw(want[k]))
    ]
    assert not bad, f"{what}: {len(bad)} of {len(want)} tensors differ, e.g. {bad[:4]}"


# --------------------------------------------------------------------------------- compressed-tensors


@pytest.fixture(scope="module")
def ct():
    pytest.importorskip("compressed_tensors", minversion="0.20.1")
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    scheme = preset_name_to_scheme("NVFP4", ["Linear"])

    class Package:
        @staticmethod
        def global_scale(x: torch.Tensor) -> torch.Tensor:
            """llm-compressor's observer: min/max of the tensor in its own dtype -> generate_gparam."""
            lo, hi = torch.aminmax(x)
            return generate_gparam(lo, hi)

        @staticmethod
        def compress(w: torch.Tensor, gs: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
            gs = Package.global_scale(w) if gs is None else gs
            g = w.unflatten(-1, (-1, 16))
            scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), scheme.weights, global_scale=gs)
            state = {
                "weight": w,
                "weight_scale": scale.to(w.dtype),
                "weight_global_scale": gs,
            }  # module params
            return NVFP4PackedCompressor.compress(state, scheme)

        @staticmethod
        def decompress(state: dict[str, torch.Tensor]) -> torch.Tensor:
            return NVFP4PackedCompressor.decompress(state, scheme)["weight"]

    return Package


def adversarial_weights(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random weights over many magnitudes, all-zero rows and blocks, huge and tiny amaxes (the global
    scale overflows to 1), exact E2M1 ties and signed zeros."""
    g = torch.Generator().manual_seed(7)
    big = torch.finfo(dtype).max / 8
    out = {
        f"randn{i}": torch.randn(48, 64, generator=g) * float(torch.rand((), generator=g)) ** 6 * 10
        for i in range(6)
    }
    heavy = torch.randn(32, 128, generator=g) * torch.exp(torch.randn(32, 1, generator=g) * 3)
    heavy[::5] = 0.0  # all-zero rows
    heavy[1, 16:32] = 0.0  # an all-zero block in a non-zero row
    heavy[2, :16] *= 1e-6  # block scales that round to zero
    out["heavy_tails"] = heavy
    out["huge"] = torch.randn(16, 32, generator=g) / 4 * big
    out["tiny"] = torch.randn(16, 32, generator=g) * (1e-6 if dtype == torch.float16 else 1e-37)
    ties = torch.tensor(
        [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.0]
    )
    out["ties"] = torch.cat([ties * 2.0**e for e in range(-6, 6)]).reshape(6, 32)
    out["signed_zeros"] = torch.tensor([0.0, -0.0] * 16).reshape(1, 32).repeat(4, 1)
    out["zeros"] = torch.zeros(8, 32)
    return {k: v.to(dtype) for k, v in out.items()}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compressed_tensors_quantize_is_the_package_bit_for_bit(ct, dtype):
    """Own global scale, and a given one (gs = 1 makes the ``ties`` land exactly on E2M1 midpoints)."""
    for name, w in adversarial_weights(dtype).items():
        for gs in (None, torch.ones(1)):
            want = ct.compress(w, gs)
            t = compressed_tensors_quantize(w, gs)
            enc = t.global_encode_scale.reshape(1)
            got = {"weight_packed": t.data, "weight_scale": t.scale, "weight_global_scale": enc}
            assert_same_tensors(got, want, f"{dtype} {name} gs={gs}")
            assert torch.equal(t.global_scale, torch.reciprocal(want["weight_global_scale"]).reshape(()))


@pytest.fixture(scope="module")
def tokenizer():
    from triage.trainers.tiny import build_tokenizer

    return build_tokenizer()


def tiny_qwen3(tokenizer, dtype):
    """Tiny Qwen3 with unequal fused shards, zero and subnormal-scale blocks (as test_nvfp4_export)."""
    from triage.trainers.tiny import build_model

    m = build_model(tokenizer, seed=3, dtype=dtype)
    with torch.no_grad():
        for i, layer in enumerate(m.model.layers):
            layer.self_attn.k_proj.weight.mul_(7.0 + i)
            layer.self_attn.v_proj.weight.mul_(0.05)
            layer.mlp.up_proj.weight.mul_(3.0)
            layer.self_attn.o_proj.weight[:2, :16] = 0.0
            layer.mlp.down_proj.weight[0, :16] *= 1e-3
    return m


def fused_members(module: str, modules: list[str]) -> list[str]:
    parent, _, leaf = module.rpartition(".")
    for group in FUSED_GROUPS:
        if leaf in group:
            return [m for m in (f"{parent}.{x}" for x in group) if m in modules]
    return [module]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compressed_tensors_checkpoint_of_a_tiny_qwen3_is_the_package_s(ct, tokenizer, dtype, tmp_path):
    """End to end: every tensor on disk equals the package's; fused q/k/v and gate/up share the smallest
    global scale (llm-compressor's ``update_fused_layer_weight_global_scales``), for weights and for
    calibrated activations; the package's own decompressor reads our files back to our dequantized weights."""
    model = tiny_qwen3(tokenizer, dtype)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    g = torch.Generator().manual_seed(1)
    input_amax = {n: float(torch.rand((), generator=g)) * 10 + 0.5 for n in linears}
    res = export_nvfp4_checkpoint(model, tmp_path, layout="compressed-tensors", input_amax=input_amax)
    disk = load_file(str(tmp_path / "model.safetensors"))

    sd = model.state_dict()
    want = {k: v for k, v in sd.items() if k.removesuffix(".weight") not in linears}
    gs = {n: ct.global_scale(sd[f"{n}.weight"]) for n in linears}
    for n in linears:
        shared = torch.cat([gs[x] for x in fused_members(n, linears)]).min().reshape(1)
        want.update({f"{n}.{k}": v for k, v in ct.compress(sd[f"{n}.weight"], shared).items()})
        a = max(input_amax[x] for x in fused_members(n, linears))
        want[f"{n}.input_global_scale"] = ct.global_scale(torch.tensor([-a, a]))
    assert_same_tensors(disk, want, f"{dtype} checkpoint")

    loaded = load_nvfp4_checkpoint(tmp_path)
    for n in linears:
        state = {k.removeprefix(f"{n}."): v for k, v in disk.items() if k.startswith(f"{n}.weight")}
        theirs = ct.decompress(state).float()  # q·s / weight_global_scale; ours multiplies by RN(1/gs)
        torch.testing.assert_close(
            theirs, loaded[f"{n}.weight"].dequantize(torch.float32), rtol=2**-7, atol=0
        )
        assert torch.equal(loaded[f"{n}.weight"].data, res.weights[f"{n}.weight"].data)


def test_compressed_tensors_parses_our_quantization_config(ct, tokenizer, tmp_path):
    from compressed_tensors.quantization import QuantizationConfig

    export_nvfp4_checkpoint(tiny_qwen3(tokenizer, torch.bfloat16), tmp_path, layout="compressed-tensors")
    qc = QuantizationConfig.model_validate(
        json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    )
    args = qc.config_groups["group_0"].weights
    assert (args.num_bits, args.type, args.strategy, args.group_size) == (4, "float", "tensor_group", 16)
    assert qc.format == "nvfp4-pack-quantized"


# ---------------------------------------------------------------------------------------------- ModelOpt


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_modelopt_checkpoint_of_a_tiny_qwen3_is_modelopt_s(tokenizer, dtype, tmp_path):
    """nvidia-modelopt quantizes (NVFP4_DEFAULT_CFG, calibrated on a small batch) and exports the same
    model; our export with its calibrated input amaxes writes the same tensors, byte for byte (except the
    tied lm_head, which ModelOpt drops and we write as a copy) and the same quantization configs."""
    pytest.importorskip("modelopt", minversion="0.47.0")
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    model = tiny_qwen3(tokenizer, dtype)
    ours = copy.deepcopy(model)
    model.config.architectures = ["Qwen3ForCausalLM"]  # ModelOpt reads it before writing
    ids = torch.randint(0, len(tokenizer), (2, 12), generator=torch.Generator().manual_seed(0))
    mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, lambda m: m(ids))
    export_hf_checkpoint(model, export_dir=tmp_path / "modelopt")
    amax = {
        n: float(m.input_quantizer.amax)
        for n, m in model.named_modules()
        if n != "lm_head" and getattr(m, "input_quantizer", None) is not None and m.input_quantizer.is_enabled
    }
    export_nvfp4_checkpoint(ours, tmp_path / "ours", layout="modelopt", input_amax=amax)

    theirs = load_file(str(tmp_path / "modelopt" / "model.safetensors"))
    mine = load_file(str(tmp_path / "ours" / "model.safetensors"))
    assert torch.equal(mine.pop("lm_head.weight"), mine["model.embed_tokens.weight"])  # tied copy
    assert_same_tensors(mine, theirs, f"{dtype} ModelOpt checkpoint")
    for f in ("hf_quant_config.json", "config.json"):
        a, b = (json.loads((tmp_path / d / f).read_text()) for d in ("modelopt", "ours"))
        qa, qb = (x.get("quantization", x.get("quantization_config")) for x in (a, b))
        for q in (qa, qb):
            q.pop("producer", None)
            for key in ("exclude_modules", "ignore"):
                if key in q:
                    q[key] = sorted(q[key])
        assert qa == qb, f
    cfg = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["dtype"] == str(dtype).removeprefix("torch.")
