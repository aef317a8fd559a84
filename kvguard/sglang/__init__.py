"""kvguard inside SGLang 0.5.23, without a fork.

SGLang's plugin loader (entry-point group ``sglang.srt.plugins``) calls :func:`register` in every SGLang
process. With ``KVGUARD_MODE=check`` it registers hooks with SGLang's ``HookRegistry``; with the default
``KVGUARD_MODE=off`` it registers nothing and SGLang runs untouched. See docs/sglang.md.

This package is light on purpose: importing it imports neither SGLang nor torch. Only the functions in
:mod:`kvguard.sglang.plugin` import SGLang, and only when they run.
"""
import os

_MODE = "KVGUARD_MODE"


def register() -> None:
    """The ``sglang.srt.plugins`` entry point (zero arguments, like every SGLang general plugin).

    NOTE (fail closed): SGLang's loader catches every ``Exception`` an entry point raises (an ImportError of
    one of kvguard's dependencies included) and serves on without the plugin. So the mode is read here with
    the standard library first: unless it is plainly ``off`` (or unset), any failure to import or register
    becomes a ``SystemExit`` naming it, which the loader does not catch, and the process stops.
    """
    mode = os.environ.get(_MODE, "off").strip().lower()
    try:
        from .plugin import register as _register

        _register()
    except SystemExit:
        raise  # kvguard's own refusal (KVGuardStartupError), already worded
    except BaseException as err:
        if mode == "off":
            raise  # (the loader logs it; kvguard is off: SGLang runs untouched)
        raise SystemExit(f"kvguard: refusing to start: {_MODE}={os.environ.get(_MODE)!r} but kvguard's SGLang "
                         f"plugin failed to load ({type(err).__name__}: {err}); the server must not run "
                         f"unguarded. Fix the installation, or set {_MODE}=off") from err


__all__ = ["register"]
