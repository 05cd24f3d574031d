"""A stochastic-rounding seed held in an int64 tensor (read on the device, as a CUDA graph replay needs):
the same bytes as the int seed, on every quantizer path."""

from __future__ import annotations

import warnings

import pytest
import torch

from triage.kernels.nvfp4 import QuantRecipe, quantize
from triage.kernels.nvfp4.quantize_columns import quantize_columnwise

warnings.filterwarnings("ignore", category=RuntimeWarning)  # numpy overflow/NaN casts in the interpreter
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SR = QuantRecipe(rounding="stochastic")
WGRAD = QuantRecipe(rounding="stochastic", hadamard=True, pad=True)  # the nvfp4-backward wgrad recipe


def _same(a, b) -> bool:
    return torch.equal(a.data, b.data) and torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))


@pytest.mark.parametrize("seed", [0, 7, 2**32 - 1])
def test_a_seed_tensor_gives_the_int_seeds_bytes(seed):
    """Rows (torch reference, Triton's bf16 fast path and general path) and columns (Triton, no transposed
    copy): a seed tensor gives the bytes of the int seed, and of the int seed mod 2^32; another seed gives
    other bytes (so the comparison sees the seed)."""
    g = torch.Generator().manual_seed(seed % 97)
    x = torch.randn(32, 64, generator=g).to(DEV)
    t = torch.tensor(seed, device=DEV)
    for xs in (x.bfloat16(), x):  # bf16 K % 16 == 0: the fast path; fp32: the general path
        for backend in ("torch", "triton"):
            ref = quantize(xs, SR, backend=backend, seed=seed)
            assert _same(quantize(xs, SR, backend=backend, seed=t), ref), (xs.dtype, backend)
            assert _same(quantize(xs, SR, backend=backend, seed=t + 3 * 2**32), ref), (xs.dtype, backend)
            assert not _same(quantize(xs, SR, backend=backend, seed=t + 1), ref), (xs.dtype, backend)
    ref = quantize_columnwise(x.bfloat16(), WGRAD, seed=seed, backend="triton")
    assert _same(quantize_columnwise(x.bfloat16(), WGRAD, seed=t, backend="triton"), ref)
    assert not _same(quantize_columnwise(x.bfloat16(), WGRAD, seed=t + 1, backend="triton"), ref)


def test_a_bad_seed_tensor_is_refused():
    x = torch.randn(16, 32, device=DEV)
    for seed in (torch.tensor(1, dtype=torch.int32, device=DEV), torch.tensor([1, 2], device=DEV),
                 torch.tensor(1, device="meta")):  # fmt: skip
        with pytest.raises(ValueError, match="seed tensor"):
            quantize(x, SR, seed=seed)
        with pytest.raises(ValueError, match="seed tensor"):
            quantize_columnwise(x, WGRAD, seed=seed)


_STREAM_KEY_COMPILE = """
import triton
import triton.language as tl
from triage.experiments.bench.sass import compile_sass
from triage.kernels.nvfp4.device import stream_key

@triton.jit
def _k(key, out_ptr, SEED_PTR: tl.constexpr):
    tl.store(out_ptr, stream_key(key, SEED_PTR))

for seed_ptr, key_type in ((False, "i32"), (True, "*i64")):
    compile_sass(_k, {"key": key_type, "out_ptr": "*u32", "SEED_PTR": "constexpr"}, {"SEED_PTR": seed_ptr}, arch=90)
print("compiled")
"""


def test_stream_key_compiles_for_sm90_with_a_seed_pointer(tmp_path):
    """The interpreter runs Python semantics; the compiler does not: a statement after an early return in a
    constexpr ``if`` is still compiled (casting the seed pointer to uint32 then fails). Compile both arms for
    sm_90 with the installed Triton, outside the interpreter (no GPU needed: Triton ships ptxas)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = tmp_path / "compile_stream_key.py"  # @triton.jit needs its source in a file
    script.write_text(_STREAM_KEY_COMPILE)
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode and ("ptxas" in proc.stderr.lower() and "not found" in proc.stderr.lower()):
        pytest.skip("no ptxas for an offline sm_90 compile")
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-1500:]
