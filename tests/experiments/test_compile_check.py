"""compile_check.launch_spec mirrors Triton's launcher specialization (what the offline sm_90 compile builds)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
tl = triton.language

from triage.experiments.bench.compile_check import launch_spec  # noqa: E402


@triton.jit(do_not_specialize=["seed"])
def _toy(x_ptr, y_ptr, n, stride, seed, alpha, flag, maybe, BLOCK: tl.constexpr, MODE: tl.constexpr = 2):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs * stride, mask=offs < n) * alpha + seed, mask=offs < n)


def test_launch_spec_types_constexprs_and_divisibility():
    if not hasattr(_toy, "arg_names") or type(_toy).__name__ != "InterpretedFunction":
        pytest.skip("launch_spec reads interpreted launches (CPU tests run under TRITON_INTERPRET=1)")
    x = torch.zeros(64, dtype=torch.bfloat16)
    y = torch.zeros(33, dtype=torch.float32)[1:]  # a 4-byte offset: not 16-byte aligned
    spec = launch_spec(_toy, (x, y, 32, 1, 16, 0.5, True, None), dict(BLOCK=32, num_warps=2))
    assert spec["name"] == "_toy" and spec["num_warps"] == 2 and spec["num_stages"] == 3
    sig = spec["signature"]
    assert (
        sig["x_ptr"] == "*bf16" and sig["y_ptr"] == "*fp32" and sig["n"] == "i32" and sig["alpha"] == "fp32"
    )
    assert sig["flag"] == "i1" and sig["seed"] == "i32"  # do_not_specialize: stays an i32 even though 16 | 16
    # an int equal to 1 becomes a constexpr, None is a constexpr, defaults are filled in
    assert spec["constexprs"] == {"stride": 1, "maybe": None, "BLOCK": 32, "MODE": 2}
    assert sig["stride"] == sig["maybe"] == sig["BLOCK"] == "constexpr"
    assert spec["divisible"] == ["x_ptr", "n"]  # y_ptr misaligned; seed not specialized
    assert launch_spec(_toy, (x, y, 2**40, 3, 0, 1.0, False, None), dict(BLOCK=32))["signature"]["n"] == "i64"


def test_same_flags_changed_missing_and_accepts_identical(tmp_path, capsys):
    """``same`` passes only when both hash files hold the same specs with the same instructions."""
    import json

    from triage.experiments.bench.compile_check import same

    def write(name, table):
        path = tmp_path / name
        path.write_text(json.dumps(table))
        return str(path)

    old = {'{"name": "k", "w": 4}': ["m.k w4 s3", "aa (10 instructions)"], '{"name": "j"}': ["m.j", "bb (5)"]}
    assert same(write("old.json", old), write("copy.json", dict(old))) == 0
    assert "2/2 specs with identical instructions" in capsys.readouterr().out
    changed = dict(old, **{'{"name": "k", "w": 4}': ["m.k w4 s3", "cc (11 instructions)"]})
    assert same(write("old.json", old), write("changed.json", changed)) == 1
    assert "DIFFERS m.k w4 s3: aa (10 instructions) -> cc (11 instructions)" in capsys.readouterr().out
    missing = {k: v for k, v in old.items() if "j" not in k}
    assert same(write("old.json", old), write("missing.json", missing)) == 1
    assert "only in" in capsys.readouterr().out


@triton.jit
def _toy_tma(desc, out_ptr, BM: tl.constexpr, BK: tl.constexpr):
    tile = desc.load([0, 0])
    tl.store(out_ptr + tl.arange(0, BM)[:, None] * BK + tl.arange(0, BK)[None, :], tile)


def test_launch_spec_types_a_host_tma_descriptor_by_dtype_and_block():
    """A host TMA descriptor is typed as Triton 3.6's launcher types it: ``tensordesc<dtype[block]>``."""
    if type(_toy_tma).__name__ != "InterpretedFunction":
        pytest.skip("launch_spec reads interpreted launches (CPU tests run under TRITON_INTERPRET=1)")
    from triton.tools.tensor_descriptor import TensorDescriptor

    base = torch.zeros(64, 32, dtype=torch.float16)
    spec = launch_spec(_toy_tma, (TensorDescriptor.from_tensor(base, [16, 32]), base), dict(BM=16, BK=32))
    assert spec["signature"]["desc"] == "tensordesc<fp16[16, 32]>" and spec["signature"]["out_ptr"] == "*fp16"
    assert spec["constexprs"] == {"BM": 16, "BK": 32}
