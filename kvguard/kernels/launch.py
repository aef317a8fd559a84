"""Launching a compiled Triton kernel directly: the per-step launch of a server, without the JIT's per-call work.

``kernel[grid](...)`` binds every argument, computes its specialization, hashes a cache key and looks the
compiled variant up on every call (tens of microseconds of Python per launch, on the scheduler's thread).
:class:`DirectLaunch` does that once per variant: the first call with a new ``key`` goes through the JIT
(which compiles it, or finds it compiled at warm-up) and keeps the compiled kernel; later calls with the
same key hand the raw arguments (pointers as ints) straight to Triton's C launcher.

The caller's ``key`` must name everything the JIT specializes on among the arguments that vary between
calls. Our kernels name every such argument in ``do_not_specialize`` and ``do_not_specialize_on_alignment``,
so what is left is each varying tensor's dtype and device kind and each varying integer's width (i32 or
i64), plus the constexpr values. Arguments fixed for the launcher's lifetime need not be in it.

Off CUDA (the CPU interpreter, ``TRITON_INTERPRET=1``) every call goes through the JIT: same arguments,
same kernel source, so the CPU tests run the argument logic this module feeds the GPU.
"""
from __future__ import annotations

import operator
import os

import torch
import triton

I32 = 2**31  # Triton passes an integer argument as i32 below this and as i64 from it (part of a variant)


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# What the JIT specializes on for a tensor argument it may not specialize on otherwise: (dtype, device kind), as
# ``spec(t)`` (a C call: no Python frame on a per-step launch).
spec = operator.attrgetter("dtype", "is_cuda")


def cuda_index(device: torch.device) -> int:
    """The CUDA device index of ``device`` (the current device for a bare ``cuda``), as the raw-stream calls take it."""
    return device.index if device.index is not None else torch.cuda.current_device()


def _set(hook) -> bool:
    """A launch hook is set: a callable, or a non-empty ``HookChain`` (Triton 3.5+ keeps an empty chain)."""
    return hook is not None and bool(getattr(hook, "calls", True))


class DirectLaunch:
    """One ``@triton.jit`` function's compiled variants, launched directly on CUDA (see the module doc)."""

    def __init__(self, fn, device: torch.device):
        self.fn = fn
        self.device = torch.device(device)
        self.direct = self.device.type == "cuda" and not interpreted()
        self.kernels: dict = {}
        self.direct_launches = 0  # launches that bypassed the JIT (tests and benchmarks read it)
        if self.direct:
            self._index = cuda_index(self.device)
            self._knobs = getattr(triton, "knobs", None)

    def __call__(self, grid: tuple, key: tuple, args: tuple, constexprs: dict) -> None:
        kernel = self.kernels.get(key) if self.direct else None
        if kernel is None or self.hooked():
            compiled = self.fn[grid](*args, **constexprs)
            if self.direct and compiled is not None:
                self.kernels[key] = compiled
            return
        raw = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
        raw.extend(constexprs.values())
        self.run(kernel, (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1), raw)

    def hooked(self) -> bool:
        """A launch hook is set (a profiler such as Proton): launches go through the JIT, which calls it."""
        knobs = self._knobs.runtime if self.direct and self._knobs is not None else None
        return knobs is not None and (_set(knobs.launch_enter_hook) or _set(knobs.launch_exit_hook))

    def run(self, kernel, grid: tuple, raw: list) -> None:
        """One direct launch of a compiled variant: ``raw`` is every argument in signature order (pointers as
        ints, constexprs included), ``grid`` three ints."""
        stream = torch._C._cuda_getCurrentRawStream(self._index)
        kernel.run(grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata, None, None, None, *raw)
        self.direct_launches += 1
