"""A 2-process ``accelerate launch`` run on CPU (gloo) of a recipe-built trainer: metrics all-reduced, one τ."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:  # a fresh port: 29500 may still be in TIME_WAIT from another launch
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_accelerate_run(tiny_model_dir, tmp_path):
    # `--multi_gpu` selects accelerate's torchrun launcher (2 processes); with no CUDA and use_cpu=True each
    # process builds a CPU Accelerator and the process group runs on gloo. (`--cpu` would launch one process.)
    env = dict(os.environ, OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1", HF_HUB_OFFLINE="1")
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--multi_gpu", "--num_processes", "2", "--mixed_precision", "no", "--num_machines", "1", "--dynamo_backend", "no",
        "--main_process_port", str(_free_port()),
        os.path.join(HERE, "ddp_run.py"), tiny_model_dir, str(tmp_path),
    ]  # fmt: skip
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    except subprocess.TimeoutExpired as e:  # ddp_run.py dumps its stacks at 120 s: show where it hung
        out, err = (
            x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr)
        )
        pytest.fail(f"accelerate launch hung:\n{out[-3000:]}\n{err[-8000:]}")
    if proc.returncode != 0:
        pytest.fail(
            f"accelerate launch failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["world_size"] == 2
    steps = [h for h in result["history"] if "loss" in h]
    assert len(steps) == 2
    for h in steps:
        # 2 processes × 2 completions: the all-reduced token count covers both processes' completions
        global_tokens = h["completions/mean_length"] * 4
        assert h["triage/tokens"] == pytest.approx(global_tokens)
        assert 0.0 <= h["triage/suppressed_frac"] <= 1.0
        assert h["triage/mean_abs_delta"] > 0  # the bf16 sampler copy vs the fp32 learner
    assert result["tau"]["steps"] == 2
