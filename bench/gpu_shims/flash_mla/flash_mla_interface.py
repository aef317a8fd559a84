"""Import-only stand-in (see the package docstring)."""
from . import _absent


class FlashMLASchedMeta:  # a type SGLang names in annotations and isinstance checks only
    def __init__(self, *args, **kwargs):
        _absent("FlashMLASchedMeta")()


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _absent(name)
