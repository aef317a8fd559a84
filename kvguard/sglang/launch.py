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

``--dry-run`` (anywhere in the arguments) starts nothing: it prints the paths the launch line turns on, each
checked or refused, and exits 0 (served) or 2 (refused): :mod:`kvguard.sglang.dryrun` (also ``kvguard check``).
"""
import os
import runpy
import sys

from .dryrun import environment_problem
from .dryrun import main as dry_run


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--dry-run" in args:  # say what kvguard would do with this launch line; start nothing
        args.remove("--dry-run")
        raise SystemExit(dry_run(args))
    os.environ.setdefault("KVGUARD_MODE", "check")
    problem = environment_problem(os.environ)
    if problem is not None:
        print(problem, file=sys.stderr)
        raise SystemExit(2)
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
