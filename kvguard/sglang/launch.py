"""``python -m kvguard.sglang.launch <sglang.launch_server arguments>``: SGLang with kvguard switched on.

Sets ``KVGUARD_MODE=check`` (unless the environment already sets ``KVGUARD_MODE``), validates every
``KVGUARD_*`` setting (an invalid one exits with status 2 and one message, before SGLang starts), checks
the server arguments against kvguard's path registry (:mod:`kvguard.sglang.paths`: a path kvguard does not
check, e.g. speculative decoding, exits with status 2 naming the path and why), and runs
``sglang.launch_server`` as ``__main__`` with the same arguments, unchanged. SGLang's own
``load_plugins()`` then runs kvguard's entry point in the server process and in every scheduler process
it spawns (they inherit the environment). The entry point (group ``sglang.srt.plugins``, name
``kvguard``) must be installed, i.e. kvguard installed in SGLang's environment; with ``SGLANG_PLUGINS``
set, it must name ``kvguard`` (checked here too).
"""
import os
import runpy
import sys

from ..incidents import prepare_dir
from ..settings import SettingsError, TrackerConfig


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("KVGUARD_MODE", "check")
    try:
        config = TrackerConfig.from_env()
        if config.mode == "check":
            prepare_dir(config.incident_dir)
    except SettingsError as err:
        print(f"kvguard: refusing to start: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    allowed = os.environ.get("SGLANG_PLUGINS", "")
    if allowed.strip() and "kvguard" not in {x.strip() for x in allowed.split(",")}:
        print(f"kvguard: refusing to start: SGLANG_PLUGINS={allowed!r} does not include kvguard, so SGLang "
              f"would not load it; add kvguard to SGLANG_PLUGINS", file=sys.stderr)
        raise SystemExit(2)
    args = list(sys.argv[1:] if argv is None else argv)
    if os.environ["KVGUARD_MODE"] == "check":
        message = _refusal(args)
        if message is not None:
            print(message, file=sys.stderr)
            raise SystemExit(2)
    sys.argv = ["sglang.launch_server", *args]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


def _refusal(args: list[str]) -> str | None:
    """The path registry's verdict on these server arguments (SGLang's own parser; the model's config)."""
    from sglang.srt.server_args import prepare_server_args

    from .plugin import server_refusal

    try:
        server_args = prepare_server_args(args)
    except SystemExit:
        return None  # SGLang's parser printed its own usage error; let SGLang report it the same way
    return server_refusal(server_args)


if __name__ == "__main__":
    main()
