"""SGLang 0.5.23's mamba2 causal convolution on a plain CPU device (test environment only).

``sglang/srt/layers/attention/mamba/mamba.py`` binds its causal-conv1d functions by platform at import: CUDA,
NPU, or XPU, whose branch binds SGLang's portable Triton implementation
(``sglang.kernels.ops.mamba.causal_conv1d_triton``) to all four names. With ``device="cpu"`` on a plain host no
branch runs, and a mamba2 layer's first forward raises ``NameError: causal_conv1d_fn_triton``.

:func:`install` binds the four names as SGLang's own XPU branch does: SGLang's own Triton kernels, run by
Triton's interpreter (``TRITON_INTERPRET=1``). SGLang's Triton SSD ops (``sglang.kernels.ops.mamba.triton_ops``)
enter ``torch.get_device_module(device).device(index)`` around each launch, which ``torch.cpu`` lacks: a no-op
context is given to it (``torch.cpu.device``, only where torch has none). Their autotuners time each config,
which the interpreter cannot (no active driver): each keeps one config, its smallest tile (any config computes the
same result). Nothing of SGLang's logic is reimplemented. Called by faultlab's
SGLang plugin (:func:`faultlab.sglang_live.inject.register`) when ``FAULTLAB_SGLANG_CPU_MAMBA=1`` is set, in
every SGLang process (the scheduler included) before a forward runs. Does nothing on a CUDA host, or where the
module already bound them.
"""
from __future__ import annotations

ENV_VAR = "FAULTLAB_SGLANG_CPU_MAMBA"
MODULE = "sglang.srt.layers.attention.mamba.mamba"
TRITON = "sglang.kernels.ops.mamba.causal_conv1d_triton"
NAMES = {"causal_conv1d_fn": "causal_conv1d_fn", "causal_conv1d_fn_triton": "causal_conv1d_fn",
         "causal_conv1d_update": "causal_conv1d_update", "causal_conv1d_update_triton": "causal_conv1d_update"}


def install() -> bool:
    """Bind the mamba mixer's causal-conv1d names to SGLang's Triton implementation (its XPU branch).

    Returns False (and changes nothing) when CUDA is available or the module bound them itself."""
    import importlib

    import torch

    if torch.cuda.is_available():
        return False
    mixer = importlib.import_module(MODULE)
    if all(hasattr(mixer, name) for name in NAMES):
        return False
    triton_ops = importlib.import_module(TRITON)
    for name, source in NAMES.items():
        setattr(mixer, name, getattr(triton_ops, source))
    if not hasattr(torch.cpu, "device"):
        torch.cpu.device = _NoDevice
    _one_config(OPS)
    return True


OPS = "sglang.kernels.ops.mamba"


def _one_config(package: str) -> None:
    """Every Triton autotuner of ``package``'s modules keeps one config: its smallest tile."""
    import importlib
    import pkgutil

    from triton.runtime.autotuner import Autotuner

    root = importlib.import_module(package)
    for info in pkgutil.walk_packages(root.__path__, package + "."):
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # a module of another platform (its kernels are not SGLang's CPU path)
            continue
        for value in list(vars(module).values()):
            if isinstance(value, Autotuner) and len(value.configs) > 1:
                value.configs = [min(value.configs, key=_footprint)]


def _footprint(config) -> tuple:
    size = 1
    for block in config.kwargs.values():
        size *= block if isinstance(block, int) else 1
    return size, config.num_stages, config.num_warps


class _NoDevice:
    """``torch.cpu.device(index)``: a no-op context (one CPU device)."""

    def __init__(self, index=None):
        self.index = index

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
