"""An import-only stand-in for the ``flash_mla`` package (``sgl-flash-mla``), absent from the offline SGLang bundle.

GPU benchmarks only (``bench/sglang_h200_setup.sh`` puts ``bench/gpu_shims`` on ``PYTHONPATH``). SGLang 0.5.23's
EAGLE v2 worker imports FlashMLA's backend on every CUDA start, to list the backends its draft CUDA graphs
support; the benchmarks here run the Triton backend and never call FlashMLA. Every name resolves to a function
that raises, so a call, unlike an import, fails loudly.
"""


def _absent(name):
    def fail(*args, **kwargs):
        raise RuntimeError(f"flash_mla.{name}: FlashMLA is not installed on this machine (bench/gpu_shims stub)")
    fail.__name__ = name
    return fail


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _absent(name)
