"""FastLaunch's caching logic, on a stand-in for a compiled Triton kernel (the GPU path is checked bit for
bit against Triton's own launch by experiments/bench/launch_overhead.py)."""

from __future__ import annotations

import sys
import types

import pytest

triton = pytest.importorskip("triton")

from triage.kernels import _launch  # noqa: E402
from triage.kernels.nvfp4.device import interpreting  # noqa: E402


class _Compiled:
    packed_metadata = ("meta",)
    function = "fn-handle"

    def __init__(self) -> None:
        self.runs = []

    def run(self, *args):
        self.runs.append(args)


class _FakeJIT:
    """Mimics JITFunction: ``device_caches[device][-1]`` is the binder; ``fn[grid](...)`` compiles+launches."""

    def __init__(self) -> None:
        self.slow_calls = 0
        self.kernels = {}
        self.device_caches = {0: ({}, {}, "target", "backend", self._binder)}

    @staticmethod
    def _binder(x, n, BLOCK=64, **options):
        spec = [("*fp32", "D"), ("i32", "D" if n % 16 == 0 else None), ("constexpr", BLOCK)]
        return {"x": x, "n": n, "BLOCK": BLOCK}, spec, options

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.slow_calls += 1
            _, spec, options = self._binder(*args, **kwargs)
            key = (tuple(spec), tuple(options.items()))
            return self.kernels.setdefault(key, _Compiled())

        return launch


@pytest.fixture
def fake_gpu(monkeypatch):
    driver = types.SimpleNamespace(
        active=types.SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda d: 1234)
    )
    monkeypatch.setattr("triton.runtime.driver", driver, raising=False)
    hooks = types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None, debug=False, interpret=False)
    compilation = types.SimpleNamespace(instrumentation_mode="")
    monkeypatch.setattr(
        triton, "knobs", types.SimpleNamespace(runtime=hooks, compilation=compilation), raising=False
    )
    return hooks


def _launcher():
    launcher = _launch.FastLaunch(_FakeJIT())
    launcher.fast = True  # what a GPU without the interpreter gets
    return launcher


def test_second_call_with_same_specialization_runs_the_cached_kernel(fake_gpu):
    launcher = _launcher()
    first = launcher[(3,)]("x0", 32, BLOCK=64)
    assert launcher.fn.slow_calls == 1 and launcher.hits == 0
    again = launcher[(5, 2)]("x1", 48, BLOCK=64)  # same specialization: n % 16 == 0
    assert again is first and launcher.fn.slow_calls == 1 and launcher.hits == 1
    grid_x, grid_y, grid_z, stream, function, meta, _, enter, exit_, *args = first.runs[-1]
    assert (grid_x, grid_y, grid_z, stream, function) == (5, 2, 1, 1234, "fn-handle")
    assert enter is None and exit_ is None
    assert args == ["x1", 48, 64]  # every bound parameter, constexprs included, in signature order


def test_a_new_specialization_or_option_compiles_through_triton(fake_gpu):
    launcher = _launcher()
    launcher[(1,)]("x", 32)
    launcher[(1,)]("x", 33)  # not divisible by 16: another kernel
    launcher[(1,)]("x", 32, num_warps=8)  # another option: another kernel
    launcher[(1,)]("x", 32, BLOCK=128)  # another constexpr
    assert launcher.fn.slow_calls == 4 and launcher.hits == 0
    launcher[(1,)]("x", 17)
    assert launcher.fn.slow_calls == 4 and launcher.hits == 1


def test_installed_launch_hooks_use_tritons_path(fake_gpu):
    launcher = _launcher()
    launcher[(1,)]("x", 32)
    fake_gpu.launch_enter_hook = types.SimpleNamespace(calls=[print])  # a HookChain with a hook
    launcher[(1,)]("x", 32)
    assert launcher.fn.slow_calls == 2 and launcher.hits == 0
    fake_gpu.launch_enter_hook = types.SimpleNamespace(calls=[])  # an empty HookChain: fast again
    launcher[(1,)]("x", 32)
    assert launcher.hits == 1


def test_unexpected_triton_internals_fall_back_for_good(fake_gpu):
    launcher = _launcher()
    launcher.fn.device_caches = {0: ("not", "a", "binder")}
    launcher[(1,)]("x", 32)
    assert launcher.fast is False and launcher.fn.slow_calls == 1
    launcher[(1,)]("x", 32)
    assert launcher.fn.slow_calls == 2


def test_interpreter_and_callable_grids_use_tritons_path(fake_gpu):
    launcher = _launch.FastLaunch(_FakeJIT())
    assert launcher.fast is (_launch.ENABLED and not interpreting())
    launcher.fast = True
    launcher[lambda meta: (1,)]("x", 32)
    assert launcher.fn.slow_calls == 1 and launcher.hits == 0


def test_toggling_a_compile_knob_recompiles(fake_gpu):
    launcher = _launcher()
    launcher[(1,)]("x", 32)
    fake_gpu.debug = True  # triton.knobs.runtime.debug: Triton would compile a debug kernel
    launcher[(1,)]("x", 32)
    assert launcher.fn.slow_calls == 2 and launcher.hits == 0
    launcher[(1,)]("x", 32)
    assert launcher.hits == 1


def test_host_cdiv_and_next_power_of_2_match_triton():
    for n in range(-3, 2100):
        assert _launch.next_power_of_2(n) == triton.next_power_of_2(n), n
        for b in (1, 3, 16, 128):
            assert _launch.cdiv(n, b) == triton.cdiv(n, b), (n, b)


def test_other_device_names_the_gpu_of_the_first_operand_when_it_is_not_the_current_one(monkeypatch):
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(_launch, "_several_gpus", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with FakeTensorMode():  # CUDA tensors without a GPU
        on1, on0 = torch.empty(2, device="cuda:1"), torch.empty(2, device="cuda:0")
    assert _launch.other_device((on1, 32)) == 1
    assert _launch.other_device((types.SimpleNamespace(base=on1), 32)) == 1  # a TMA descriptor's base
    assert _launch.other_device((on0, on1)) is None  # the first operand decides: the current GPU
    assert _launch.other_device(()) is None
    assert _launch.other_device(("x", 32)) is None
    assert _launch.other_device((torch.zeros(2), 32)) is None
    assert _launch.other_device((types.SimpleNamespace(base=torch.zeros(2)),)) is None
    monkeypatch.setattr(_launch, "_several_gpus", lambda: False)  # one GPU: nothing to check
    assert _launch.other_device((on1, 32)) is None


@pytest.mark.parametrize("fast", [True, False])
def test_a_launch_on_operands_of_another_gpu_runs_under_its_device_guard(fake_gpu, monkeypatch, fast):
    """Triton launches on the current device: where the first operand lives on another GPU, both launch
    paths (cached and Triton's own) enter that GPU's device guard and launch inside it."""
    import contextlib

    import torch

    entered = []

    @contextlib.contextmanager
    def guard(index):
        entered.append(index)
        yield
        entered.append(-1)

    monkeypatch.setattr(torch.cuda, "device", guard)
    monkeypatch.setattr(_launch, "other_device", lambda args: 3 if args and args[0] == "on-gpu-3" else None)
    monkeypatch.setattr(_launch, "interpreting", lambda: False)
    launcher = _launcher()
    launcher.fast = fast
    inside = []
    fake_fn = launcher.fn
    original = fake_fn.__class__.__getitem__

    def tracking_getitem(self, grid):
        launch = original(self, grid)
        return lambda *a, **k: (inside.append(entered[-1:] == [3]), launch(*a, **k))[1]

    monkeypatch.setattr(fake_fn.__class__, "__getitem__", tracking_getitem)
    runs = []
    monkeypatch.setattr(_Compiled, "run", lambda self, *args: runs.append(entered[-1:] == [3]))
    launcher[(1,)]("on-gpu-3", 32)
    assert entered == [3, -1] and inside == [True]
    launcher[(1,)]("on-gpu-3", 48)  # the same specialization: the cached kernel's own launch (fast path)
    assert entered == [3, -1, 3, -1] and (runs == [True] if fast else inside == [True, True])
    entered.clear(), inside.clear(), runs.clear()
    launcher[(1,)]("x", 33)  # the current device (another specialization: through Triton again): no guard
    assert entered == [] and inside == [False]


@pytest.mark.gpu
def test_a_layer_on_a_second_gpu_gives_its_bits_whatever_the_current_device():
    """The layer's Triton launches (quantize, the decode kernel, the dense and TMA GEMMs) run on its
    operands' GPU, not the current one."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from triage.kernels import NVFP4Linear

    torch.manual_seed(0)
    layer = NVFP4Linear(1024, 2560, device="cuda:1", dtype=torch.bfloat16)
    launchers = [v for m in list(sys.modules.values()) if getattr(m, "__name__", "").startswith("triage.kernels")
                 for v in vars(m).values() if isinstance(v, _launch.FastLaunch)]  # fmt: skip
    for launcher in launchers:
        launcher.compiled.clear()
    for rows in (4, 600, 3000):
        x = torch.randn(rows, 1024, device="cuda:1", dtype=torch.bfloat16)
        with torch.cuda.device(0):
            got = layer(x)
        with torch.cuda.device(1):
            want = layer(x)
        torch.cuda.synchronize(1)
        assert torch.equal(got, want) and want.isfinite().all()
    # every kernel was compiled for and launched on GPU 1 (a launch on GPU 0 could still read GPU 1's memory
    # over peer access and give the right values)
    devices = {key[0] for launcher in launchers for key in launcher.compiled}
    assert devices == ({1} if any(launcher.fast for launcher in launchers) else set())
