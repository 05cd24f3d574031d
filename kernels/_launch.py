"""A lean host path for launching ``@triton.jit`` kernels.

Triton's ``kernel[grid](*args)`` costs tens of µs of host time per call for a kernel with ~30 arguments
(binding and specializing every argument, a string cache key, option and knob lookups, the global-value
check, launch metadata). A small model's learner step issues ~10 Triton launches per layer and is host-bound
(docs/benchmarks.md), so that time is the step time. :func:`fast_launch` wraps a kernel so that

    kernel[grid](*args, **kwargs)

still reads the same, but after the first call for a given specialization it runs the compiled kernel
directly: Triton's own binder (its C++ ``specialize_impl``: alignment, divisibility by 16, value 1, int32
vs int64, dtypes and constexpr values — exactly the properties its cache keys on) builds the key, and
the compiled kernel's launcher is called with the bound arguments. A key not seen before goes through
``kernel[grid]`` (which compiles and returns the kernel). Correctness therefore rests on Triton's own
specialization; what is skipped is bookkeeping that does not change the launched kernel.

Every launch, fast or Triton's own, runs on the GPU of its first operand (:func:`other_device`), as torch
ops do: Triton itself launches on the current device. (Plans read the current GPU's SM count and TMA
support: one process's GPUs are taken to be of one model.)

Falls back to the plain launch under the interpreter, when a Triton launch hook is installed (profilers such
as proton), for callable grids, when ``TRIAGE_FAST_LAUNCH=0``, and for good if the installed Triton's
internals differ from what this module expects (checked on first use).
"""

from __future__ import annotations

import functools
import os

import torch
import triton

from triage.kernels.nvfp4.device import interpreting

#: Global switch (read at import): ``TRIAGE_FAST_LAUNCH=0`` restores Triton's own launch path everywhere.
ENABLED = os.environ.get("TRIAGE_FAST_LAUNCH", "1") != "0"


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host code: ``triton.cdiv`` is a ``constexpr_function`` since Triton 3.5 and costs
    ~2 µs per host call (a dozen per layer call add up in a host-bound step)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two ≥ ``n`` (as ``triton.next_power_of_2``: 0 for ``n`` ≤ 0), for host code (see
    :func:`cdiv`)."""
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()


def _hooks_active() -> bool:
    """A launch hook is installed (Triton ≥ 3.5 keeps an always-present ``HookChain``; older ones None)."""
    runtime = triton.knobs.runtime
    return any(
        hook is not None and bool(getattr(hook, "calls", True))
        for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook)
    )


def _compile_knobs(fn, kwargs) -> tuple:
    """The run-time knobs Triton's ``run`` adds to a kernel's compile options (debug, instrumentation; Triton
    3.9: fpsan, a stages-inspection hook): part of the key, so toggling one recompiles as Triton would."""
    runtime, compilation = triton.knobs.runtime, triton.knobs.compilation
    debug = bool(kwargs.get("debug", getattr(fn, "debug", None)) or runtime.debug)
    return (
        debug,
        getattr(compilation, "instrumentation_mode", None),
        getattr(compilation, "fpsan_homomorphic_casts", None),
        getattr(runtime, "add_stages_inspection_hook", None),
    )


@functools.cache
def _several_gpus() -> bool:
    """Whether this process sees more than one CUDA device (read once)."""
    return torch.cuda.is_available() and torch.cuda.device_count() > 1


def other_device(args) -> int | None:
    """The CUDA device index of a launch's first argument (a tensor, or a tensor descriptor's base) where it
    is not the current device, else None. Triton launches on the current device (its stream and context);
    every kernel here takes a tensor (or a descriptor) first, so a launch runs under a device guard where
    the operands live on another GPU, as torch ops do. A process that sees one GPU skips the check."""
    if not _several_gpus() or not args:
        return None
    first = args[0]
    if not isinstance(first, torch.Tensor):
        first = getattr(first, "base", None)  # triton.tools.tensor_descriptor.TensorDescriptor
    if not isinstance(first, torch.Tensor):
        return None
    index = first.get_device()  # -1 on the host
    return None if index < 0 or index == torch.cuda.current_device() else index


class FastLaunch:
    """``fn[grid](...)`` with a cached compiled-kernel fast path (module doc). ``fn`` stays reachable as
    ``.fn`` (for ``warmup``, introspection and tests)."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.compiled: dict = {}
        self.fast = ENABLED and not interpreting() and hasattr(fn, "device_caches")
        self.hits = 0

    def __getitem__(self, grid):
        if self.fast and not callable(grid):
            return functools.partial(self._launch, grid)
        if interpreting():
            return self.fn[grid]
        return functools.partial(self._plain, grid)

    def _plain(self, grid, *args, **kwargs):
        """Triton's own launch, on the device of the first tensor argument (:func:`other_device`)."""
        index = other_device(args)
        if index is None:
            return self.fn[grid](*args, **kwargs)
        with torch.cuda.device(index):
            return self.fn[grid](*args, **kwargs)

    def _binder(self, device):
        binder = self.fn.device_caches[device][-1]  # Triton 3.3–3.6: (..., backend, binder)
        if not callable(binder):
            raise TypeError("unexpected Triton device cache layout")
        return binder

    def _launch(self, grid, *args, **kwargs):
        index = other_device(args)
        if index is None:
            return self._launch_here(grid, *args, **kwargs)
        with torch.cuda.device(index):
            return self._launch_here(grid, *args, **kwargs)

    def _launch_here(self, grid, *args, **kwargs):
        """:meth:`_launch` on the current device."""
        from triton.runtime import driver

        try:
            if _hooks_active() or getattr(self.fn, "pre_run_hooks", None):
                return self.fn[grid](*args, **kwargs)
            device = driver.active.get_current_device()
            params, specialization, options = self._binder(device)(*args, **kwargs)
            key = (device, tuple(specialization), tuple(options.items()), _compile_knobs(self.fn, kwargs))
            kernel = self.compiled.get(key)
        except Exception:  # a Triton whose internals differ: use its own path from now on
            self.fast = False
            return self.fn[grid](*args, **kwargs)
        if kernel is None:
            kernel = self.fn[grid](*args, **kwargs)  # compiles (or finds) and launches
            if hasattr(kernel, "result"):
                kernel = kernel.result()
            if getattr(kernel, "packed_metadata", None) is None:  # pragma: no cover - other Triton layouts
                self.fast = False
                return kernel
            self.compiled[key] = kernel
            return kernel
        n = len(grid)
        stream = driver.active.get_current_stream(device)
        kernel.run(
            grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, kernel.function,
            kernel.packed_metadata, None, None, None, *params.values(),
        )  # fmt: skip
        self.hits += 1
        return kernel


def fast_launch(fn):
    """Decorator (outside ``@triton.jit``): launch through :class:`FastLaunch`."""
    return FastLaunch(fn)
