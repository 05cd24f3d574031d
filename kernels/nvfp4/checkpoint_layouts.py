"""The two NVFP4 safetensors layouts inference engines load, as data: tensor names, scale conventions, configs.

Per quantized Linear ``m`` with weight ``W`` [N, K] (K % 16 == 0), ``q`` the E2M1 codes, ``s`` the E4M3
block scales, ``A`` the weight amax and ``A_x`` the calibrated activation amax:

==================  ==========================================  ============================================
tensor              ModelOpt (``quant_algo: NVFP4``)            compressed-tensors (``nvfp4-pack-quantized``)
==================  ==========================================  ============================================
packed codes        ``m.weight`` uint8 [N, K/2]                 ``m.weight_packed`` uint8 [N, K/2]
block scales        ``m.weight_scale`` e4m3 [N, K/16]           ``m.weight_scale`` e4m3 [N, K/16]
weight outer scale  ``m.weight_scale_2`` f32 [] = A/2688         ``m.weight_global_scale`` f32 [1] = 2688/A
                    (DECODE: ``W = q·s·weight_scale_2``)          (ENCODE: ``W = q·s / weight_global_scale``)
activation scale    ``m.input_scale`` f32 [] = A_x/2688           ``m.input_global_scale`` f32 [1] = 2688/A_x
==================  ==========================================  ============================================

Element 2i is in the low nibble; scales are linear (not swizzled). Sources: nvidia-modelopt's HF exporter,
compressed-tensors' ``NVFP4PackedCompressor`` and vLLM's NVFP4 checkpoint loaders (the tests compare against
the first two packages' own output).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "GROUP_SIZE",
    "LAYOUTS",
    "Layout",
    "compressed_tensors_config",
    "get_layout",
    "modelopt_configs",
]

GROUP_SIZE = 16


@dataclass(frozen=True)
class Layout:
    """Names and conventions of one checkpoint layout.

    Attributes:
        name: ``"modelopt"`` or ``"compressed-tensors"``.
        profile: the ``QuantRecipe.profile`` whose formulas the format's producer uses by default, and whose
            ``scale_source="checkpoint"`` convention matches the stored outer scales (decode for modelopt,
            encode for compressed-tensors).
        weight / weight_scale / weight_global / input_global: tensor-name suffixes.
        stores_encode: the outer scales are ENCODE scales ``2688/amax`` (True) or DECODE ``amax/2688``.
        global_shape: shape of a stored outer scale: ``()`` (ModelOpt) or ``(1,)`` (compressed-tensors).
        profiles: quantizer profiles whose outer scale survives the layout exactly: the stored value ``v``
            gives back the tensor's decode multiplier (``v`` itself, or ``RN(1/v)`` for encode layouts,
            which is how te and compressed-tensors derive decode from encode).
    """

    name: str
    profile: str
    weight: str
    weight_scale: str
    weight_global: str
    input_global: str
    stores_encode: bool
    global_shape: tuple[int, ...]
    profiles: tuple[str, ...]


MODELOPT = Layout(
    name="modelopt",
    profile="modelopt",
    weight="weight",
    weight_scale="weight_scale",
    weight_global="weight_scale_2",
    input_global="input_scale",
    stores_encode=False,
    global_shape=(),
    profiles=("te", "torchao", "modelopt", "compressed-tensors"),
)
COMPRESSED_TENSORS = Layout(
    name="compressed-tensors",
    profile="compressed-tensors",
    weight="weight_packed",
    weight_scale="weight_scale",
    weight_global="weight_global_scale",
    input_global="input_global_scale",
    stores_encode=True,
    global_shape=(1,),
    profiles=("te", "compressed-tensors"),
)
LAYOUTS = {MODELOPT.name: MODELOPT, COMPRESSED_TENSORS.name: COMPRESSED_TENSORS}


def get_layout(name: str) -> Layout:
    if name not in LAYOUTS:
        raise ValueError(f"unknown NVFP4 checkpoint layout {name!r}; expected one of {tuple(LAYOUTS)}")
    return LAYOUTS[name]


def modelopt_configs(exclude: list[str], weight_only: bool, producer_version: str) -> tuple[dict, dict]:
    """``(hf_quant_config.json, config.json["quantization_config"])`` as ModelOpt writes them.

    ``hf_quant_config.json``: vLLM requires ``group_size``, ``kv_cache_quant_algo`` and ``exclude_modules``
    for NVFP4. ``config.json``: ModelOpt's ``convert_hf_quant_config_format`` form (``quant_method:
    "modelopt"``, ``quant_algo``, ``ignore``, ``config_groups``), which vLLM's ``modelopt_fp4`` method
    detects. ``quant_algo`` is ``"NVFP4"`` (W4A4, needs every ``input_scale``) or ``"W4A16_NVFP4"``
    (weights only).
    """
    algo = "W4A16_NVFP4" if weight_only else "NVFP4"
    producer = {"name": "modelopt", "version": producer_version}
    hf_quant = {
        "producer": producer,
        "quantization": {
            "quant_algo": algo,
            "kv_cache_quant_algo": None,
            "group_size": GROUP_SIZE,
            "exclude_modules": list(exclude),
        },
    }
    args = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": GROUP_SIZE}
    group: dict = {"weights": dict(args), "targets": ["Linear"]}
    if not weight_only:
        group = {"input_activations": dict(args), **group}
    quantization_config = {
        "config_groups": {"group_0": group},
        "ignore": list(exclude),
        "quant_algo": algo,
        "producer": producer,
        "quant_method": "modelopt",
    }
    return hf_quant, quantization_config


def compressed_tensors_config(ignore: list[str], weight_only: bool) -> dict:
    """``config.json["quantization_config"]`` for compressed-tensors ``nvfp4-pack-quantized``.

    The NVFP4 preset of compressed-tensors (§3.6): weights ``num_bits=4, type=float, symmetric,
    strategy=tensor_group, group_size=16, dynamic=False``; activations the same with ``dynamic="local"``
    (block scales computed at run time, the global scale static = ``input_global_scale``), or ``None`` for
    weight-only (vLLM's ``CompressedTensorsW4A16Fp4``). ``ignore`` lists module names.
    """
    weights = {
        "num_bits": 4,
        "type": "float",
        "symmetric": True,
        "strategy": "tensor_group",
        "group_size": GROUP_SIZE,
        "dynamic": False,
        "actorder": None,
        "block_structure": None,
        "observer": "minmax",
        "observer_kwargs": {},
    }
    inputs = None if weight_only else {**weights, "dynamic": "local", "observer": "minmax"}
    return {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": inputs,
                "output_activations": None,
                "format": "nvfp4-pack-quantized",
            }
        },
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
    }
