"""kvguard inside SGLang 0.5.23, without a fork.

SGLang's plugin loader (entry-point group ``sglang.srt.plugins``) calls :func:`register` in every SGLang
process. With ``KVGUARD_MODE=check`` it registers hooks with SGLang's ``HookRegistry``; with the default
``KVGUARD_MODE=off`` it registers nothing and SGLang runs untouched. See docs/sglang.md.

This package is light on purpose: importing it imports neither SGLang nor torch. Only the functions in
:mod:`kvguard.sglang.plugin` import SGLang, and only when they run.
"""


def register() -> None:
    """The ``sglang.srt.plugins`` entry point (zero arguments, like every SGLang general plugin)."""
    from .plugin import register as _register

    _register()


__all__ = ["register"]
