"""``python -m kvguard.sglang.launch <sglang.launch_server arguments>``: SGLang with kvguard switched on.

Sets ``KVGUARD_MODE=check`` (unless the environment already sets ``KVGUARD_MODE``) and runs
``sglang.launch_server`` as ``__main__`` with the same arguments, unchanged. SGLang's own
``load_plugins()`` then runs kvguard's entry point in the server process and in every scheduler process
it spawns (they inherit the environment). The entry point (group ``sglang.srt.plugins``, name
``kvguard``) must be installed, i.e. kvguard installed in SGLang's environment.
"""
import os
import runpy
import sys


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("KVGUARD_MODE", "check")
    sys.argv = ["sglang.launch_server", *(sys.argv[1:] if argv is None else argv)]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
