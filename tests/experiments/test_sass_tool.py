"""The offline SASS tool (experiments/bench/sass.py) compiles a kernel for sm_90 on a CPU-only machine."""

import os
import re
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import triton
    import triton.language as tl
    from triage.experiments.bench.sass import compile_sass, hot_loop, loop_report

    @triton.jit
    def scale_sum(x_ptr, y_ptr, n, B: tl.constexpr):
        acc = tl.zeros((B,), tl.float32)
        for i in range(0, n, B):
            o = i + tl.arange(0, B)
            acc += tl.load(x_ptr + o, mask=o < n, other=0.0) * 3.0
        tl.store(y_ptr + tl.arange(0, B), acc)

    sass = compile_sass(scale_sum, {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "B": "constexpr"}, {"B": 512})
    loop = hot_loop(sass)
    ops = {op.split(".")[0] for _, op, _ in loop}
    assert "LDG" in ops and ("FFMA" in ops or "FMUL" in ops), ops
    assert 0 < len(loop) < 200, len(loop)
    print(loop_report(sass, 512))
    """
)


def test_compile_sass_counts_the_hot_loop(tmp_path):
    path = tmp_path / "k.py"  # @triton.jit needs its source in a file
    path.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env, timeout=300)
    if "ptxas" in proc.stderr and proc.returncode:
        pytest.skip(f"no usable ptxas in this Triton install: {proc.stderr[-200:]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "hot loop:" in proc.stdout


def test_decode_kernel_bf16_loop_has_no_half_swaps():
    """experiments/bench/sass_decode.py: the decode GEMV's hot loop with bf16 activations runs no more PRMTs
    than with fp16 (the scale multiply reads the scale's half in place: no half-swap around each HMUL2, 256
    more PRMTs per K step with Triton's own bf16 multiply) and at most ~2 % more instructions."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, os.path.join(root, "experiments", "bench", "sass_decode.py")],
                          capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    if "ptxas" in proc.stderr and proc.returncode:
        pytest.skip(f"no usable ptxas in this Triton install: {proc.stderr[-200:]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    counts = {}
    for line in proc.stdout.splitlines():
        if line.startswith(("bf16:", "fp16:")):
            dtype, rest = line.split(":", 1)
            ops = rest.split("):", 1)[1].split()
            counts[dtype] = dict(total=int(rest.split()[0]), **dict(zip(ops[::2], map(int, ops[1::2]))))
    bf16, fp16 = counts["bf16"], counts["fp16"]
    assert bf16["HMUL2"] == fp16["HMUL2"] > 0
    assert bf16.get("PRMT", 0) <= fp16.get("PRMT", 0), (bf16, fp16)
    assert bf16["total"] <= 1.02 * fp16["total"], (bf16, fp16)


def test_grouped_tma_kernel_reads_the_weights_by_tma_and_multiplies_on_wgmma():
    """experiments/bench/sass_grouped.py: the persistent grouped kernel at its default tiles compiles for
    sm_90 to TMA bulk copies of the weight tiles (UTMALDG), wgmma (HGMMA) and no spills; the pointer kernel
    has no TMA copy."""
    code = textwrap.dedent(
        """
        from triage.experiments.bench.sass_grouped import TMA_TILES, report
        from triage.kernels.moe.grouped_triton import GROUPED_CONFIG
        print(report(TMA_TILES[0]))
        print(report(GROUPED_CONFIG))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    if "ptxas" in proc.stderr and proc.returncode:
        pytest.skip(f"no usable ptxas in this Triton install: {proc.stderr[-200:]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    tma, pointer = (
        {op: int(n) for op, n in re.findall(r"([A-Z]+) (\d+)", line.split("instructions")[1])}
        for line in proc.stdout.splitlines()[-2:]
    )
    assert tma["UTMALDG"] > 0 and tma["HGMMA"] > 0 and tma["LDL"] == tma["STL"] == 0, tma
    assert pointer["UTMALDG"] == 0 and pointer["HGMMA"] > 0, pointer
