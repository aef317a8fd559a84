"""``python -m kvguard.sglang.launch <sglang.launch_server arguments>``: SGLang with kvguard switched on.

Sets ``KVGUARD_MODE=check`` (unless the environment already sets ``KVGUARD_MODE``), validates every
``KVGUARD_*`` setting (an invalid one exits with status 2 and one message, before SGLang starts), and runs
``sglang.launch_server`` as ``__main__`` with the same arguments, unchanged. SGLang's own
``load_plugins()`` then runs kvguard's entry point in the server process and in every scheduler process
it spawns (they inherit the environment). The entry point (group ``sglang.srt.plugins``, name
``kvguard``) must be installed, i.e. kvguard installed in SGLang's environment; with ``SGLANG_PLUGINS``
set, it must name ``kvguard`` (checked here too).
"""
import os
import runpy
import sys

from ..settings import SettingsError, TrackerConfig


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("KVGUARD_MODE", "check")
    try:
        TrackerConfig.from_env()
    except SettingsError as err:
        print(f"kvguard: refusing to start: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    allowed = os.environ.get("SGLANG_PLUGINS", "")
    if allowed.strip() and "kvguard" not in {x.strip() for x in allowed.split(",")}:
        print(f"kvguard: refusing to start: SGLANG_PLUGINS={allowed!r} does not include kvguard, so SGLang "
              f"would not load it; add kvguard to SGLANG_PLUGINS", file=sys.stderr)
        raise SystemExit(2)
    sys.argv = ["sglang.launch_server", *(sys.argv[1:] if argv is None else argv)]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
