"""NVFP4 checkpoint export/import (ModelOpt and compressed-tensors layouts) on tiny Qwen3 models."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from triage.kernels.nvfp4 import (
    QuantRecipe,
    dequantized_state_dict,
    detect_layout,
    e2m1_decode,
    export_nvfp4_checkpoint,
    load_activation_recipes,
    load_nvfp4_checkpoint,
    quantize,
)
from triage.kernels.nvfp4.export import (
    DEFAULT_SKIP,
    compressed_tensors_global_scale,
    compressed_tensors_quantize,
    model_config,
)

LAYOUTS = ("modelopt", "compressed-tensors")
PROFILE = {"modelopt": "modelopt", "compressed-tensors": "compressed-tensors"}
NAMES = {  # packed, block scale, weight outer, activation outer, outer shape
    "modelopt": ("weight", "weight_scale", "weight_scale_2", "input_scale", ()),
    "compressed-tensors": (
        "weight_packed",
        "weight_scale",
        "weight_global_scale",
        "input_global_scale",
        (1,),
    ),
}
F32 = torch.float32


def f32(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=F32)


@pytest.fixture(scope="module")
def tokenizer():
    from triage.trainers.tiny import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    """Tiny Qwen3 whose q/k/v and gate/up shards have very different amaxes (so sharing is visible)."""
    from triage.trainers.tiny import build_model

    m = build_model(tokenizer, seed=3)
    with torch.no_grad():
        for i, layer in enumerate(m.model.layers):
            layer.self_attn.k_proj.weight.mul_(7.0 + i)
            layer.self_attn.v_proj.weight.mul_(0.05)
            layer.mlp.up_proj.weight.mul_(3.0)
            layer.self_attn.o_proj.weight[:2, :16] = 0.0  # zero blocks: per-layout zero-block scale byte
            layer.mlp.down_proj.weight[0, :16] *= 1e-6  # subnormal block scales
    return m


def linear_modules(model):
    return [n for n, mod in model.named_modules() if isinstance(mod, torch.nn.Linear) and n != "lm_head"]


@pytest.fixture(scope="module")
def input_amax(model):
    g = torch.Generator().manual_seed(0)
    amax = {n: float(torch.rand((), generator=g)) * 10 + 0.5 for n in linear_modules(model)}
    return amax


@pytest.fixture(scope="module", params=LAYOUTS)
def exported(request, model, tokenizer, input_amax, tmp_path_factory):
    layout = request.param
    path = tmp_path_factory.mktemp(layout)
    res = export_nvfp4_checkpoint(model, path, layout=layout, input_amax=input_amax, tokenizer=tokenizer)
    return layout, path, res


def raw_bytes(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def producer_quantize(layout, w):
    """What the layout's producer writes for ``w`` with its own outer scale (the export's default)."""
    if layout == "compressed-tensors":
        return compressed_tensors_quantize(w)
    return quantize(w, QuantRecipe(profile="modelopt"))


# ----------------------------------------------------------------------------------------- round trip


def test_round_trip_bytes_scales_and_values(exported, model):
    layout, path, res = exported
    assert detect_layout(path) == layout
    loaded = load_nvfp4_checkpoint(path)
    expected = {f"{n}.weight" for n in linear_modules(model)}
    assert set(loaded) == set(res.weights) == expected
    for name, t in res.weights.items():
        got = loaded[name]
        assert torch.equal(got.data, t.data), name
        assert torch.equal(raw_bytes(got.scale), raw_bytes(t.scale)), name
        assert torch.equal(got.global_scale, t.global_scale), name  # decode multiplier, bit for bit
        assert got.shape == t.shape and got.dtype == model.dtype == t.dtype
        assert torch.equal(got.dequantize(), t.dequantize()), name
        assert got.recipe.scale_source == "checkpoint" and got.recipe.profile == PROFILE[layout]


def test_read_gives_the_weights_and_every_other_tensor_as_stored(exported, model):
    """``read_nvfp4_checkpoint``: the quantized weights as ``load_nvfp4_checkpoint`` gives them, and the other
    tensors (norms, embeddings, head) as the model holds them; no code or scale tensor in either part."""
    from triage.kernels.nvfp4 import read_nvfp4_checkpoint

    _, path, _ = exported
    weights, rest = read_nvfp4_checkpoint(path)
    loaded = load_nvfp4_checkpoint(path)
    assert weights.keys() == loaded.keys() and all(torch.equal(weights[k].data, loaded[k].data) for k in loaded)
    state = model.state_dict()
    assert set(rest) == set(state) - set(weights)
    assert all(torch.equal(rest[k], state[k]) for k in rest)


def test_files_on_disk_have_engine_names_dtypes_and_shapes(exported, model):
    layout, path, res = exported
    packed, bscale, wglob, iglob, gshape = NAMES[layout]
    disk = load_file(str(path / "model.safetensors"))
    sd = model.state_dict()
    for n in linear_modules(model):
        w = sd[f"{n}.weight"]
        N, K = w.shape
        assert disk[f"{n}.{packed}"].dtype == torch.uint8 and disk[f"{n}.{packed}"].shape == (N, K // 2)
        assert disk[f"{n}.{bscale}"].dtype == torch.float8_e4m3fn and disk[f"{n}.{bscale}"].shape == (
            N,
            K // 16,
        )
        for s in (wglob, iglob):
            assert disk[f"{n}.{s}"].dtype == F32 and tuple(disk[f"{n}.{s}"].shape) == gshape
        if layout == "compressed-tensors":
            assert f"{n}.weight" not in disk
    for name, t in sd.items():  # unquantized tensors (embeddings, norms, tied lm_head) as they were
        if name.removesuffix(".weight") not in linear_modules(model):
            assert torch.equal(disk[name], t), name


def test_stored_outer_scales_follow_each_layout_convention(exported, model, input_amax):
    """ModelOpt stores DECODE scales amax/2688, compressed-tensors ENCODE scales 2688/amax (survey §3.7)."""
    layout, path, _ = exported
    _, _, wglob, iglob, _ = NAMES[layout]
    disk = load_file(str(path / "model.safetensors"))
    sd = model.state_dict()
    for n in ("model.layers.0.self_attn.o_proj", "model.layers.1.mlp.down_proj"):  # not fused: own amax
        a = sd[f"{n}.weight"].abs().amax().float()
        ax = f32(input_amax[n])
        got, got_in = disk[f"{n}.{wglob}"].reshape(()), disk[f"{n}.{iglob}"].reshape(())
        if layout == "modelopt":
            assert torch.equal(got, a / f32(2688.0)) and torch.equal(got_in, ax / f32(2688.0))
        else:  # the package's own rounding (reciprocal times 2688): test_nvfp4_export_packages.py
            torch.testing.assert_close(got, f32(2688.0) / a, rtol=2**-23, atol=0)
            torch.testing.assert_close(got_in, f32(2688.0) / ax, rtol=2**-23, atol=0)


def test_engine_dequantization_formula_matches(exported):
    """What an engine computes from the files: ModelOpt q·s·weight_scale_2 (bit-exact with ours);
    compressed-tensors q·s / weight_global_scale (ours multiplies by RN(1/gs): within 1 ulp)."""
    layout, path, res = exported
    packed, bscale, wglob, _, _ = NAMES[layout]
    disk = load_file(str(path / "model.safetensors"))
    for name, t in res.weights.items():
        n = name.removesuffix(".weight")
        b = disk[f"{n}.{packed}"]
        codes = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)
        qs = e2m1_decode(codes) * disk[f"{n}.{bscale}"].float().repeat_interleave(16, -1)
        g = disk[f"{n}.{wglob}"].reshape(())
        ours = t.dequantize(F32)
        if layout == "modelopt":
            assert torch.equal(qs * g, ours), name
        else:
            torch.testing.assert_close(qs / g, ours, rtol=2**-23, atol=0)


def test_zero_block_scale_byte_is_the_producer_s(exported):
    layout, _, res = exported
    s = raw_bytes(res.weights["model.layers.0.self_attn.o_proj.weight"].scale)
    assert int(s[0, 0]) == (0x38 if layout == "modelopt" else 0x20)  # survey §4 pitfall 5


def test_dequantized_state_dict_loads_into_plain_and_nvfp4_models(exported, model, tokenizer):
    from triage.kernels import NVFP4Config, NVFP4Linear, convert
    from triage.trainers.tiny import build_model

    layout, path, res = exported
    sd = dequantized_state_dict(path)
    assert set(sd) == set(model.state_dict())
    plain = build_model(tokenizer, seed=99)
    plain.load_state_dict(sd)
    for name, t in res.weights.items():
        assert torch.equal(plain.get_parameter(name), t.dequantize())
    conv = convert(
        build_model(tokenizer, seed=99), NVFP4Config.from_recipe(QuantRecipe(profile=PROFILE[layout]))
    )
    q = conv.model.layers[0].self_attn.q_proj
    stale = q.quantized_weight()  # cache the pre-load W_q: load_state_dict must invalidate it
    conv.load_state_dict(sd)
    assert isinstance(q, NVFP4Linear)
    assert torch.equal(q.weight, res.weights["model.layers.0.self_attn.q_proj.weight"].dequantize())
    fresh = q.quantized_weight()  # NVFP4Linear re-quantizes the loaded (dequantized) master weight
    assert fresh is not stale and torch.equal(fresh.data, quantize(q.weight.detach(), q.config.weight).data)


def test_activation_recipes_reproduce_the_static_input_scale(exported, input_amax):
    layout, path, _ = exported
    recipes = load_activation_recipes(path)
    assert set(recipes) == set(input_amax)
    x = torch.randn(8, 64)
    for n in ("model.layers.0.self_attn.o_proj", "model.layers.1.mlp.gate_proj"):
        # gate/up are a fused group: their activation amaxes were unified to the max
        a = input_amax[n]
        if n.endswith("gate_proj"):
            a = max(a, input_amax[n.replace("gate_proj", "up_proj")])
        if layout == "modelopt":
            static = QuantRecipe(profile="modelopt", scale_source="static", static_amax=a)
        else:  # generate_gparam of the calibrated amax, stored as the encode scale
            enc = float(compressed_tensors_global_scale(f32(a)))
            static = QuantRecipe(
                profile="compressed-tensors", scale_source="checkpoint", checkpoint_scale=enc
            )
        want, got = quantize(x, static), quantize(x, recipes[n])
        assert torch.equal(got.data, want.data) and torch.equal(got.global_scale, want.global_scale)


# -------------------------------------------------------------------------------- shared fused scales


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fused_shards_share_one_outer_scale_equal_to_quantizing_the_fused_weight(layout, model, tmp_path):
    """vLLM loads q/k/v (gate/up) as one tensor with one outer scale: the shards' bytes must be exactly the
    quantization of the concatenated weight, i.e. quantized with amax = max of the shards' amaxes."""
    res = export_nvfp4_checkpoint(model, tmp_path, layout=layout)
    disk = load_file(str(tmp_path / "model.safetensors"))
    wglob = NAMES[layout][2]
    sd = model.state_dict()
    for i in range(len(model.model.layers)):
        for parent, group in (
            (f"model.layers.{i}.self_attn", "qkv"),
            (f"model.layers.{i}.mlp", ("gate", "up")),
        ):
            shards = [f"{parent}.{s}_proj" for s in group]
            fused = producer_quantize(layout, torch.cat([sd[f"{s}.weight"] for s in shards]))
            stored = {float(disk[f"{s}.{wglob}"]) for s in shards}
            assert len(stored) == 1
            assert stored == {
                float(fused.global_encode_scale if layout != "modelopt" else fused.global_scale)
            }
            rows = 0
            for s in shards:
                t = res.weights[f"{s}.weight"]
                n = t.shape[0]
                assert torch.equal(t.data, fused.data[rows : rows + n]), s
                assert torch.equal(raw_bytes(t.scale), raw_bytes(fused.scale[rows : rows + n])), s
                assert torch.equal(t.global_scale, fused.global_scale), s
                rows += n


@pytest.mark.parametrize("layout", LAYOUTS)
def test_unshared_scales_are_per_shard(layout, model, tmp_path):
    res = export_nvfp4_checkpoint(model, tmp_path, layout=layout, share_fused_scales=False)
    sd = model.state_dict()
    shards = [f"model.layers.0.self_attn.{s}_proj.weight" for s in "qkv"]
    scales = {float(res.weights[s].global_scale) for s in shards}
    assert len(scales) == 3
    for s in shards:
        own = producer_quantize(layout, sd[s])
        assert torch.equal(res.weights[s].data, own.data) and torch.equal(
            res.weights[s].global_scale, own.global_scale
        )


# ------------------------------------------------------------------------------------- configs, skip


def test_configs(exported, model, tokenizer):
    layout, path, res = exported
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["hidden_size"] == model.config.hidden_size
    assert cfg["dtype"] == "float32"
    qc = cfg["quantization_config"]
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(path)("1 + 2").input_ids == tokenizer("1 + 2").input_ids
    if layout != "modelopt":
        assert not (path / "hf_quant_config.json").exists()
        check_compressed_tensors_config(qc, res)
        return
    hf = json.loads((path / "hf_quant_config.json").read_text())
    assert hf["producer"]["name"] == "modelopt"
    q = hf["quantization"]
    assert q["quant_algo"] == "NVFP4" and q["group_size"] == 16
    assert "kv_cache_quant_algo" in q and q["kv_cache_quant_algo"] is None  # vLLM requires the key
    assert q["exclude_modules"] == res.excluded == ["model.embed_tokens", "lm_head"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "NVFP4"
    assert qc["ignore"] == res.excluded
    g = qc["config_groups"]["group_0"]
    assert (
        g["weights"]
        == g["input_activations"]
        == {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    )


def check_compressed_tensors_config(qc, res):
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "nvfp4-pack-quantized"
    assert qc["quantization_status"] == "compressed" and qc["ignore"] == res.excluded
    g = qc["config_groups"]["group_0"]
    assert g["targets"] == ["Linear"]
    for args in (g["weights"], g["input_activations"]):  # vLLM's _is_fp4a4_nvfp4 checks these fields
        assert (args["num_bits"], args["type"], args["strategy"], args["group_size"], args["symmetric"]) == (
            4,
            "float",
            "tensor_group",
            16,
            True,
        )
    assert g["weights"]["dynamic"] is False and g["input_activations"]["dynamic"] == "local"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_weight_only_when_not_calibrated(layout, model, tmp_path):
    export_nvfp4_checkpoint(model, tmp_path, layout=layout)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    if layout == "modelopt":
        assert qc["quant_algo"] == "W4A16_NVFP4"
        assert json.loads((tmp_path / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == (
            "W4A16_NVFP4"
        )
    else:
        assert qc["config_groups"]["group_0"]["input_activations"] is None
    assert not any(k.endswith(NAMES[layout][3]) for k in load_file(str(tmp_path / "model.safetensors")))
    assert load_activation_recipes(tmp_path) == {}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_skip_list_is_honoured(layout, model, tmp_path):
    skip = ("lm_head", "*embed_tokens*", "*norm*", "*.mlp.down_proj", "model.layers.1.self_attn.o_proj")
    res = export_nvfp4_checkpoint(model, tmp_path, layout=layout, skip=skip)
    disk = load_file(str(tmp_path / "model.safetensors"))
    kept = ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj", "model.layers.1.self_attn.o_proj"]
    for n in kept:
        assert torch.equal(disk[f"{n}.weight"], model.get_parameter(f"{n}.weight"))
        assert not any(k.startswith(f"{n}.") and k != f"{n}.weight" for k in disk)
        assert n in res.excluded and f"{n}.weight" not in res.weights
    assert "model.layers.0.self_attn.o_proj.weight" in res.weights
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert set(kept) <= set(qc["ignore"])
    assert set(load_nvfp4_checkpoint(tmp_path)) == set(res.weights)


def test_skipping_part_of_a_fused_group_is_an_error(model, tmp_path):
    with pytest.raises(ValueError, match=r"fused group .*k_proj"):
        export_nvfp4_checkpoint(model, tmp_path, skip=("lm_head", "*embed_tokens*", "*.k_proj"))


# ------------------------------------------------------------------------------ recipes and sharding


@pytest.mark.parametrize("layout", LAYOUTS)
def test_te_16x16_recipe_round_trips(layout, model, tmp_path):
    recipe = QuantRecipe(profile="te", block="16x16")
    res = export_nvfp4_checkpoint(model, tmp_path, layout=layout, recipe=recipe, max_shard_bytes=20_000)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    loaded = load_nvfp4_checkpoint(tmp_path)
    for name, t in res.weights.items():
        assert torch.equal(loaded[name].data, t.data) and torch.equal(
            loaded[name].global_scale, t.global_scale
        )
        assert torch.equal(loaded[name].dequantize(), t.dequantize())


def test_sharded_export_files_index_and_metadata(model, tmp_path):
    """``max_shard_bytes`` is huggingface_hub's ``max_shard_size``: shards ``model-0000i-of-0000n.safetensors``
    of at most that many bytes (a larger tensor alone in its shard), an index whose ``weight_map`` names every
    tensor in the shard that holds it and whose ``total_size`` is their bytes, ``{"format": "pt"}`` in every
    file; the shards hold exactly the tensors of the one-file export."""
    from safetensors import safe_open

    limit = 20_000
    assert export_nvfp4_checkpoint(model, tmp_path / "one").files == ["model.safetensors"]
    single = load_file(str(tmp_path / "one" / "model.safetensors"))
    with safe_open(str(tmp_path / "one" / "model.safetensors"), "pt") as fh:
        assert fh.metadata() == {"format": "pt"}
    many = tmp_path / "many"
    files = export_nvfp4_checkpoint(model, many, max_shard_bytes=limit).files
    n = len(files)
    assert n > 2 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(p.name for p in many.glob("*.safetensors")) == files
    index = json.loads((many / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(single) and set(index["weight_map"].values()) == set(files)
    assert index["metadata"] == {"total_size": sum(t.numel() * t.element_size() for t in single.values())}
    for f in files:
        shard = load_file(str(many / f))
        assert set(shard) == {name for name, where in index["weight_map"].items() if where == f}
        assert sum(t.numel() * t.element_size() for t in shard.values()) <= limit or len(shard) == 1
        assert all(torch.equal(t, single[name]) for name, t in shard.items())
        with safe_open(str(many / f), "pt") as fh:
            assert fh.metadata() == {"format": "pt"}
    assert (many / "config.json").read_text() == (tmp_path / "one" / "config.json").read_text()


# ------------------------------------------------------------------------------ re-export, configs


@pytest.mark.parametrize("layout", LAYOUTS)
def test_re_export_into_a_folder_with_an_earlier_sharded_export_loads_the_new_weights(
    layout, model, tmp_path
):
    """The earlier shards, index and ModelOpt config are removed, so nothing stale is read back."""
    export_nvfp4_checkpoint(model, tmp_path, layout="modelopt", max_shard_bytes=20_000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    newer = {k: v * 2 for k, v in model.state_dict().items()}
    res = export_nvfp4_checkpoint(newer, tmp_path, layout=layout, config=model_config(model))
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()
    assert (tmp_path / "hf_quant_config.json").exists() == (layout == "modelopt")
    loaded = load_nvfp4_checkpoint(tmp_path)
    for name, t in res.weights.items():
        assert torch.equal(loaded[name].data, t.data) and torch.equal(
            loaded[name].global_scale, t.global_scale
        )
    assert torch.equal(dequantized_state_dict(tmp_path)["model.norm.weight"], newer["model.norm.weight"])


def test_re_export_removes_only_the_files_of_the_earlier_export(model, tmp_path):
    """Only the names an export writes (model.safetensors, model-NNNNN-of-NNNNN.safetensors, the index,
    hf_quant_config.json) are replaced; another file that merely starts with "model" is the user's."""
    export_nvfp4_checkpoint(model, tmp_path, layout="modelopt", max_shard_bytes=20_000)
    notes = tmp_path / "model_notes.safetensors"
    save_file({"x": torch.ones(3)}, str(notes))
    before = notes.read_bytes()
    export_nvfp4_checkpoint(model, tmp_path, layout="modelopt")
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors", notes.name]
    assert notes.read_bytes() == before
    assert set(load_nvfp4_checkpoint(tmp_path)) == set(export_nvfp4_checkpoint(model, tmp_path).weights)


def test_export_refuses_a_folder_holding_another_checkpoint(model, tmp_path):
    model.save_pretrained(tmp_path)  # a plain (not NVFP4) checkpoint: never deleted
    before = (tmp_path / "model.safetensors").read_bytes()
    with pytest.raises(FileExistsError, match=r"model\.safetensors.*not an NVFP4 export.*delete them"):
        export_nvfp4_checkpoint(model, tmp_path)
    assert (tmp_path / "model.safetensors").read_bytes() == before


def test_config_names_the_architecture_as_save_pretrained_does(model, tokenizer, tmp_path):
    from transformers import AutoConfig

    from triage.trainers.tiny import build_model

    fresh = build_model(tokenizer, seed=1)  # never saved: its config has no architectures yet
    assert fresh.config.architectures is None
    export_nvfp4_checkpoint(fresh, tmp_path / "a")
    assert json.loads((tmp_path / "a" / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    assert AutoConfig.from_pretrained(tmp_path / "a").architectures == ["Qwen3ForCausalLM"]
    assert fresh.config.architectures is None  # the model's own config is left alone
    sd = small_state_dict()
    with pytest.raises(ValueError, match="'architectures' must name the model class"):
        export_nvfp4_checkpoint(sd, tmp_path / "b", config={"model_type": "toy"})
    with pytest.raises(ValueError, match="'architectures' must name the model class"):
        export_nvfp4_checkpoint(sd, tmp_path / "c", config=fresh.config)


# ------------------------------------------------------------------------------------------ bad input


def small_state_dict(k: int = 32) -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "layers.0.proj.weight": torch.randn(32, k, generator=g),
        "layers.0.norm.weight": torch.ones(k),
    }


def test_state_dict_export_with_config(tmp_path):
    sd = small_state_dict()
    cfg = {"model_type": "toy", "architectures": ["ToyForCausalLM"]}
    res = export_nvfp4_checkpoint(sd, tmp_path, layout="compressed-tensors", config=cfg)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "toy"
    assert torch.equal(
        dequantized_state_dict(tmp_path)["layers.0.proj.weight"],
        res.weights["layers.0.proj.weight"].dequantize(),
    )


@pytest.mark.parametrize("pad", [False, True])
def test_k_not_multiple_of_16_names_the_tensor(pad, tmp_path):
    with pytest.raises(ValueError, match=r"layers\.0\.proj\.weight.*K=40"):
        export_nvfp4_checkpoint(
            small_state_dict(40), tmp_path, recipe=QuantRecipe(profile="modelopt", pad=pad)
        )


def test_weight_whose_amax_has_no_fp32_reciprocal_names_the_tensor(tmp_path):
    """A weight with a subnormal amax (its outer scale 1/amax overflows fp32) is refused naming the tensor."""
    sd = small_state_dict()
    sd["layers.0.proj.weight"] = sd["layers.0.proj.weight"] * 1e-41
    with pytest.raises(ValueError, match=r"layers\.0\.proj\.weight.*amax"):
        export_nvfp4_checkpoint(sd, tmp_path, recipe=QuantRecipe(profile="modelopt"))


def test_bad_arguments(tmp_path):
    sd = small_state_dict()
    with pytest.raises(ValueError, match="unknown NVFP4 checkpoint layout"):
        export_nvfp4_checkpoint(sd, tmp_path, layout="gguf")
    with pytest.raises(ValueError, match="scale='tensor'"):
        export_nvfp4_checkpoint(sd, tmp_path, recipe=QuantRecipe(scale="row"))
    with pytest.raises(ValueError, match="Hadamard"):
        export_nvfp4_checkpoint(sd, tmp_path, recipe=QuantRecipe(hadamard=True))
    with pytest.raises(ValueError, match="ENCODE"):
        export_nvfp4_checkpoint(
            sd, tmp_path, layout="compressed-tensors", recipe=QuantRecipe(profile="torchao")
        )
    with pytest.raises(ValueError, match="compressed-tensors computes, which rounds to nearest"):
        export_nvfp4_checkpoint(
            sd, tmp_path, recipe=QuantRecipe(profile="compressed-tensors", rounding="stochastic")
        )
    bad = dict(sd, **{"layers.0.proj.weight": sd["layers.0.proj.weight"].clone()})
    bad["layers.0.proj.weight"][3, 5] = float("nan")
    with pytest.raises(ValueError, match=r"'layers\.0\.proj\.weight' contains NaN"):
        export_nvfp4_checkpoint(bad, tmp_path)
    with pytest.raises(ValueError, match=r"experts\.w.*3 dims"):
        export_nvfp4_checkpoint(dict(sd, **{"experts.w.weight": torch.randn(2, 16, 16)}), tmp_path)
    with pytest.raises(ValueError, match=r"missing 1 quantized module.*layers\.0\.proj"):
        export_nvfp4_checkpoint(sd, tmp_path, input_amax={})
    with pytest.raises(ValueError, match=r"not quantized: \['nope'\]"):
        export_nvfp4_checkpoint(sd, tmp_path, input_amax={"layers.0.proj": 1.0, "nope": 1.0})
    with pytest.raises(ValueError, match=r"input_amax\['layers\.0\.proj'\] must be finite and > 0"):
        export_nvfp4_checkpoint(sd, tmp_path, input_amax={"layers.0.proj": 0.0})


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("drop", [0, 1, 2])
def test_missing_tensor_on_load_names_it(layout, drop, tmp_path):
    export_nvfp4_checkpoint(small_state_dict(), tmp_path, layout=layout, input_amax={"layers.0.proj": 2.0})
    f = str(tmp_path / "model.safetensors")
    tensors = load_file(f)
    victim = f"layers.0.proj.{NAMES[layout][drop]}"
    del tensors[victim]
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(KeyError, match=victim.replace(".", r"\.")):
        load_nvfp4_checkpoint(tmp_path)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_missing_activation_scale_of_a_w4a4_checkpoint_names_it(layout, tmp_path):
    export_nvfp4_checkpoint(small_state_dict(), tmp_path, layout=layout, input_amax={"layers.0.proj": 2.0})
    f = str(tmp_path / "model.safetensors")
    tensors = load_file(f)
    victim = f"layers.0.proj.{NAMES[layout][3]}"
    del tensors[victim]
    save_file(tensors, f, metadata={"format": "pt"})
    load_nvfp4_checkpoint(tmp_path)  # the weights are complete
    with pytest.raises(KeyError, match=victim.replace(".", r"\.")):
        load_activation_recipes(tmp_path)


def test_malformed_checkpoints(tmp_path):
    export_nvfp4_checkpoint(small_state_dict(), tmp_path)
    f = str(tmp_path / "model.safetensors")
    tensors = load_file(f)
    save_file(dict(tensors, **{"layers.0.proj.weight_scale_2": torch.tensor(-1.0)}), f)
    with pytest.raises(ValueError, match=r"model\.safetensors: 'layers\.0\.proj\.weight_scale_2' = -1\.0"):
        load_nvfp4_checkpoint(tmp_path)
    save_file(
        dict(
            tensors,
            **{"layers.0.proj.weight_scale": tensors["layers.0.proj.weight_scale"][:, :1].contiguous()},
        ),
        f,
    )
    with pytest.raises(ValueError, match=r"'layers\.0\.proj'.*\[N, K/16\]"):
        load_nvfp4_checkpoint(tmp_path)
    save_file(
        dict(tensors, **{"layers.0.proj.weight_scale": tensors["layers.0.proj.weight_scale"].float()}), f
    )
    with pytest.raises(ValueError, match=r"weight_scale' has dtype torch\.float32"):
        load_nvfp4_checkpoint(tmp_path)
    (tmp_path / "config.json").unlink()
    (tmp_path / "hf_quant_config.json").unlink()
    with pytest.raises(ValueError, match="no NVFP4 quantization config"):
        load_nvfp4_checkpoint(tmp_path)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("byte", [0x7F, 0xFF, 0x80, 0xB8])
def test_nan_or_negative_block_scale_byte_is_named_with_its_file(layout, byte, tmp_path):
    export_nvfp4_checkpoint(small_state_dict(), tmp_path, layout=layout)
    f = tmp_path / "model.safetensors"
    tensors = load_file(str(f))
    scale = tensors["layers.0.proj.weight_scale"].view(torch.uint8).clone()
    scale[3, 1] = byte
    save_file(dict(tensors, **{"layers.0.proj.weight_scale": scale.view(torch.float8_e4m3fn)}), str(f))
    with pytest.raises(
        ValueError, match=rf"{f}: 'layers\.0\.proj\.weight_scale' has 1 block-scale.*\(3, 1\)"
    ):
        load_nvfp4_checkpoint(tmp_path)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("value", [float("inf"), float("nan"), 0.0, 1e-45, 3e38, 1e30])
def test_absurd_outer_scale_is_named_with_its_file(layout, value, tmp_path):
    """Weight and activation outer scales: finite, > 0, decode multiplier normal with 2688·decode finite in
    the checkpoint dtype (float32 here)."""
    export_nvfp4_checkpoint(small_state_dict(), tmp_path, layout=layout, input_amax={"layers.0.proj": 2.0})
    f = tmp_path / "model.safetensors"
    tensors = load_file(str(f))
    _, _, wglob, iglob, gshape = NAMES[layout]
    dec = value if layout == "modelopt" else 1 / value if value else float("inf")
    absurd = not (1.2e-38 < dec < 3.4e38 / 2688)
    for victim in (wglob, iglob):
        bad = dict(tensors, **{f"layers.0.proj.{victim}": torch.tensor(value).reshape(gshape)})
        save_file(bad, str(f))
        if not absurd:
            load_activation_recipes(tmp_path)
            continue
        with pytest.raises(
            ValueError, match=rf"{f}: 'layers\.0\.proj\.{victim}' = .*not a usable outer scale"
        ):
            load_activation_recipes(tmp_path)


def test_outer_scale_that_overflows_the_checkpoint_dtype_is_refused(tmp_path):
    sd = {k: v.to(torch.float16) for k, v in small_state_dict().items()}
    export_nvfp4_checkpoint(sd, tmp_path)
    f = tmp_path / "model.safetensors"
    save_file(dict(load_file(str(f)), **{"layers.0.proj.weight_scale_2": torch.tensor(100.0)}), str(f))
    with pytest.raises(ValueError, match=r"weight_scale_2' = 100\.0.*\[2\^-126, 24\.37\].*torch\.float16"):
        load_nvfp4_checkpoint(tmp_path)  # 6·448·100 is Inf in fp16
    load_nvfp4_checkpoint(tmp_path, dtype=torch.float32)


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn", "fp32", 16])
def test_unknown_dtype_in_config_json_is_named(dtype, tmp_path):
    export_nvfp4_checkpoint(small_state_dict(), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, dtype=dtype)))
    with pytest.raises(ValueError, match=rf"{tmp_path / 'config.json'}: dtype {dtype!r} is not a dtype"):
        load_nvfp4_checkpoint(tmp_path)


def test_unreadable_or_inconsistent_files_are_named(tmp_path):
    export_nvfp4_checkpoint(small_state_dict(), tmp_path, max_shard_bytes=300)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    index = tmp_path / "model.safetensors.index.json"
    good = index.read_text()
    weight_map = json.loads(good)["weight_map"]
    first = load_file(str(shards[0]))
    save_file(dict(first, **load_file(str(shards[1]))), str(shards[0]))  # a tensor in two shards
    with pytest.raises(ValueError, match=rf"is in both {shards[0].name} and {shards[1].name}"):
        load_nvfp4_checkpoint(tmp_path)
    save_file(first, str(shards[0]))
    index.write_text(json.dumps({"weight_map": dict(weight_map, extra=shards[0].name)}))
    with pytest.raises(ValueError, match=rf"index\.json puts 1 tensor.*'extra' in {shards[0].name}"):
        load_nvfp4_checkpoint(tmp_path)
    index.write_text("{not json")
    with pytest.raises(ValueError, match=rf"{index}: not valid JSON"):
        load_nvfp4_checkpoint(tmp_path)
    index.write_text(good)
    shards[1].write_bytes(shards[1].read_bytes()[:40])  # truncated
    with pytest.raises(ValueError, match=rf"{shards[1]}: not a readable safetensors file"):
        load_nvfp4_checkpoint(tmp_path)


def test_recipe_replace_does_not_leak_static_amax(model, tmp_path):
    """The in-memory tensors of shared shards record the shared amax they were quantized with."""
    res = export_nvfp4_checkpoint(model, tmp_path)
    sd = model.state_dict()
    shards = [f"model.layers.0.self_attn.{s}_proj.weight" for s in "qkv"]
    a = max(float(sd[s].abs().amax()) for s in shards)
    for s in shards:
        assert res.weights[s].recipe == replace(
            QuantRecipe(profile="modelopt"), scale_source="static", static_amax=a
        )


# ------------------------------------------------------------------------------ MoE (fused 3-D experts)


@pytest.fixture(scope="module")
def moe_model():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(5)
    m = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()
        m.model.layers[0].mlp.experts.gate_up_proj[:, 32:] *= 4.0  # up rows: larger amax than gate rows
    return m


@pytest.mark.parametrize("layout", LAYOUTS)
def test_moe_experts_are_split_per_expert_with_shared_gate_up_scale(layout, moe_model, tmp_path):
    res = export_nvfp4_checkpoint(moe_model, tmp_path, layout=layout)
    disk = load_file(str(tmp_path / "model.safetensors"))
    experts = moe_model.model.layers[0].mlp.experts
    assert "model.layers.0.mlp.experts.gate_up_proj" not in disk
    assert "model.layers.0.mlp.gate" in res.excluded  # the router stays high precision
    assert torch.equal(disk["model.layers.0.mlp.gate.weight"], moe_model.model.layers[0].mlp.gate.weight)
    for e in range(4):
        p = f"model.layers.0.mlp.experts.{e}"
        fused = producer_quantize(layout, experts.gate_up_proj[e].detach())  # the engine's w13 of expert e
        gate, up = res.weights[f"{p}.gate_proj.weight"], res.weights[f"{p}.up_proj.weight"]
        assert torch.equal(torch.cat((gate.data, up.data)), fused.data)
        assert torch.equal(gate.global_scale, fused.global_scale) and torch.equal(
            up.global_scale, fused.global_scale
        )
        down = producer_quantize(layout, experts.down_proj[e].detach())
        assert torch.equal(res.weights[f"{p}.down_proj.weight"].data, down.data)
        assert disk[f"{p}.gate_proj.{NAMES[layout][0]}"].shape == (32, 16)
    loaded = load_nvfp4_checkpoint(tmp_path)
    for name, t in res.weights.items():
        assert torch.equal(loaded[name].data, t.data) and torch.equal(
            loaded[name].global_scale, t.global_scale
        )
    sd = dequantized_state_dict(tmp_path, fuse_experts=True)
    assert set(sd) == set(moe_model.state_dict())
    gate_up = sd["model.layers.0.mlp.experts.gate_up_proj"]
    for e in range(4):
        p = f"model.layers.0.mlp.experts.{e}"
        want = torch.cat(
            (
                res.weights[f"{p}.gate_proj.weight"].dequantize(),
                res.weights[f"{p}.up_proj.weight"].dequantize(),
            )
        )
        assert torch.equal(gate_up[e], want)
    type(moe_model)(moe_model.config).load_state_dict(sd)


def test_unsupported_fused_expert_layout_is_an_error(tmp_path):
    sd = {"m.experts.gate_up_proj": torch.randn(2, 32, 64), "m.experts.down_proj": torch.randn(2, 64, 32)}
    with pytest.raises(ValueError, match=r"m\.experts\.gate_up_proj.*not \[E, 2I, H\]"):
        export_nvfp4_checkpoint(sd, tmp_path)


def test_mla_q_a_and_kv_a_share_one_outer_scale(tmp_path):
    """vLLM fuses DeepSeek MLA's q_a_proj and kv_a_proj_with_mqa into one GEMM with one outer scale."""
    gen = torch.Generator().manual_seed(0)
    sd = {
        "l.attn.q_a_proj.weight": torch.randn(32, 64, generator=gen),
        "l.attn.kv_a_proj_with_mqa.weight": 4 * torch.randn(16, 64, generator=gen),
    }
    res = export_nvfp4_checkpoint(sd, tmp_path)
    q, kv = (res.weights[f"l.attn.{m}.weight"] for m in ("q_a_proj", "kv_a_proj_with_mqa"))
    assert torch.equal(q.global_scale, kv.global_scale)


def test_embeddings_stay_high_precision_whatever_their_name(tmp_path):
    """GPT-NeoX's embed_in, GPT-2's wte/wpe (names) and any nn.Embedding (modules) are never quantized."""
    gen = torch.Generator().manual_seed(0)
    sd = {
        n: torch.randn(64, 32, generator=gen)
        for n in ("gpt_neox.embed_in.weight", "wte.weight", "h.0.mlp.fc.weight")
    }
    res = export_nvfp4_checkpoint(sd, tmp_path / "sd")
    assert set(res.weights) == {"h.0.mlp.fc.weight"}
    assert {"gpt_neox.embed_in", "wte"} <= set(res.excluded)

    model = torch.nn.ModuleDict({"tok": torch.nn.Embedding(64, 32), "proj": torch.nn.Linear(32, 32)})
    res = export_nvfp4_checkpoint(model, tmp_path / "module")
    assert set(res.weights) == {"proj.weight"} and "tok" in res.excluded


def test_fused_experts_of_an_unknown_model_type_are_refused(tmp_path):
    """Mixtral & co. rename their experts on load: writing Qwen3-MoE names would not load in an engine."""

    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            from transformers import MixtralConfig

            self.config = MixtralConfig()
            self.mlp = torch.nn.Module()
            self.mlp.experts = torch.nn.Module()
            self.mlp.experts.gate_up_proj = torch.nn.Parameter(torch.randn(2, 64, 32))
            self.mlp.experts.down_proj = torch.nn.Parameter(torch.randn(2, 32, 32))

    with pytest.raises(ValueError, match="'mixtral' stores fused experts"):
        export_nvfp4_checkpoint(Toy(), tmp_path / "a")
    export_nvfp4_checkpoint(Toy(), tmp_path / "b", skip=(*DEFAULT_SKIP, "*experts*"))  # skipped: fine
