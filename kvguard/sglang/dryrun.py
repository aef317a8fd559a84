"""``kvguard check <sglang.launch_server arguments>``: would kvguard serve this launch line? Nothing is started.

Also ``python -m kvguard.sglang.launch --dry-run <arguments>``. The arguments are parsed by SGLang's own
parser (``prepare_server_args``) and resolved the way ``launch_server`` resolves them (``resolve_once``); the
model's config is read through SGLang's ``ModelConfig`` when the model path is a local folder with a
``config.json`` (or, offline, a config in the Hugging Face cache). The verdict is the path registry's
(:mod:`kvguard.sglang.paths`: ``facts_of``, ``active``, ``refusal``), the one the server applies at start.

Prints every path the configuration turns on, each ``checked`` (what kvguard follows there) or ``refused``
(why), and exits 0 (served) or 2 (refused; also a bad argument, with SGLang's message, or an environment the
launcher refuses: :func:`environment_problem`, which the launcher uses too). Where the model's config could
not be read, it names the facts it could not know (the model's own: MLA, sliding window, ...) and what each
would turn on; the scheduler decides those at start, on the model it loads.

NOTE: nothing here reaches the network. SGLang's resolution and ``ModelConfig`` fetch a hub id's config
from the Hugging Face hub (on a machine without a route there: ~45 s of retries per read), so a model path
that is not a local folder is read only in offline mode (``HF_HUB_OFFLINE=1``, cache only), which
:func:`main` sets for its process before SGLang is imported.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import textwrap
import warnings
from dataclasses import dataclass, replace
from typing import Mapping

from ..incidents import prepare_dir
from ..settings import SettingsError, TrackerConfig
from . import paths
from .model_facts import MODEL_FACTS

EXIT_SERVED, EXIT_REFUSED = 0, 2
USAGE = """usage: kvguard check <sglang.launch_server arguments>
       python -m kvguard.sglang.launch --dry-run <sglang.launch_server arguments>

Says, without starting anything, which serving paths this launch line turns on and whether kvguard
(KVGUARD_MODE=check) checks each or refuses the configuration. Exit 0: served; 2: refused or bad input."""


class BadArguments(ValueError):
    """SGLang's parser rejected the launch line (the message is SGLang's)."""


@dataclass(frozen=True)
class Verdict:
    """The registry's answer for one launch line, and what it was decided on."""

    argv: tuple[str, ...]
    facts: paths.Facts
    active: tuple[paths.Path, ...]  # the paths the configuration turns on (paths.active)
    refusal: str | None  # paths.refusal: None = served
    model: str  # what was read of the model, or why nothing was
    unknown: tuple[str, ...]  # model facts not known (the config was not read); () when it was
    unresolved: str | None  # None: SGLang resolved the arguments; else why not (decided on them as written)

    @property
    def exit_code(self) -> int:
        return EXIT_SERVED if self.refusal is None else EXIT_REFUSED


def check(argv: list[str] | tuple[str, ...]) -> Verdict:
    """The verdict on ``argv`` (``sglang.launch_server`` arguments); :class:`BadArguments` if SGLang rejects them."""
    argv = tuple(argv)
    server_args = _parse(argv)
    model_path = str(getattr(server_args, "model_path", "") or "")
    unreadable = _unreadable(model_path)
    unresolved = unreadable
    if unreadable is None:
        try:
            _resolve(server_args)
        except Exception as err:  # e.g. no accelerator here: decide on the arguments as written
            unresolved = f"{type(err).__name__}: {_first_line(err)}"
            server_args = _parse(argv)  # a failed resolution leaves partial writes on its record
    model_config, model = _model_config(server_args, model_path, unreadable)
    facts = paths.facts_of(_view(server_args), model_config)
    unknown = () if model_config is not None else tuple(MODEL_FACTS)
    return Verdict(argv, facts, tuple(paths.active(facts)), paths.refusal(facts), model, unknown, unresolved)


def _parse(argv: tuple[str, ...]):
    """SGLang's own parser; its usage text is swallowed and only its error line kept."""
    from sglang.srt.server_args import prepare_server_args

    err = io.StringIO()
    root = logging.getLogger()
    saved = root.handlers[:], root.level  # prepare_server_args reconfigures the root logger (force=True)
    try:
        with contextlib.redirect_stderr(err), _quiet():
            return prepare_server_args(list(argv))
    except SystemExit as exc:
        lines = [ln for ln in err.getvalue().splitlines() if "error:" in ln] or err.getvalue().splitlines()[-1:]
        raise BadArguments("\n".join(lines) or f"SGLang's parser exited with status {exc.code}") from None
    except Exception as exc:  # a constructor check on the parsed values
        raise BadArguments(f"{type(exc).__name__}: {exc}") from None
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


def _resolve(server_args) -> None:
    """SGLang's ``resolve_once``, as ``launch_server`` runs it; the variables it sets for a server are put back."""
    saved = dict(os.environ)
    try:
        with _quiet():
            server_args.resolve_once()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _unreadable(model_path: str) -> str | None:
    """None if the model's config can be read without the network; else why not."""
    if os.path.isfile(os.path.join(model_path, "config.json")):
        return None
    if os.path.isdir(model_path):
        return f"{model_path!r} has no config.json"
    try:
        from huggingface_hub import constants
    except ImportError:
        return f"{model_path!r} is not a local folder"
    if constants.HF_HUB_OFFLINE:
        return None  # a hub id, read from the local cache only
    return (f"{model_path!r} is not a local folder, and the dry run does not fetch from the hub "
            f"(with HF_HUB_OFFLINE=1 it reads a cached config)")


def _model_config(server_args, model_path: str, unreadable: str | None):
    """SGLang's ``ModelConfig`` of the launch line and what was read, or (None, why not)."""
    if unreadable is not None:
        return None, f"not read: {unreadable}"
    try:
        from sglang.srt.configs.model_config import ModelConfig

        with _quiet():
            config = ModelConfig.from_server_args(server_args)
    except Exception as err:
        if not os.path.isdir(model_path):  # offline: only the local cache was asked
            return None, (f"not read: {model_path!r} is not a local folder, and its config is not in the Hugging "
                          f"Face cache (the dry run does not fetch; {type(err).__name__})")
        return None, f"not read: {model_path!r}: {type(err).__name__}: {_first_line(err)}"
    archs = ", ".join(getattr(getattr(config, "hf_config", None), "architectures", None) or []) or "?"
    return config, f"{model_path} (config read: {archs})"


def _view(server_args):
    """What SGLang resolved (live view over the record; the raw record where resolution did not run)."""
    try:
        from sglang.srt.arg_groups.model_override_base import resolving_view

        return resolving_view(server_args)
    except Exception:
        return server_args


@contextlib.contextmanager
def _quiet():
    """SGLang's import-time and resolution warnings are not the dry run's to print."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def would_turn_on(facts: paths.Facts, name: str) -> list[paths.Path]:
    """The paths a model fact, if true, would add to this configuration."""
    now = set(p.name for p in paths.active(facts))
    return [p for p in paths.active(replace(facts, **{name: True})) if p.name not in now]


def report(verdict: Verdict) -> str:
    """The dry run's text: the paths, each checked or refused with its reason, and the verdict."""
    wrap = textwrap.TextWrapper(width=110, subsequent_indent=" " * 11)
    out = [f"kvguard check: sglang.launch_server {' '.join(verdict.argv)}".rstrip(),
           f"  model:   {verdict.model}",
           "  args:    " + ("resolved by SGLang, as launch_server resolves them" if verdict.unresolved is None
                            else f"decided as written (SGLang's resolution did not run: {verdict.unresolved})")]
    if verdict.unknown:
        out.append("  not known without the model's config (the scheduler decides them at start, on the model):")
        for name in verdict.unknown:
            adds = ", ".join(f"{p.name} ({p.status})" for p in would_turn_on(verdict.facts, name)) or "nothing"
            out.append(f"    {name}: would turn on {adds}")
    out.append("paths this configuration turns on (KVGUARD_MODE=check):")
    for p in verdict.active:
        out.append(wrap.fill(f"  {p.status:<8} {p.name} [{p.turned_on_by}]: {p.why}"))
    for p in (p for p in paths.PATHS if p.per_request):
        out.append(wrap.fill(f"  per request, {p.status}: {p.name} [{p.turned_on_by}]"))
    if verdict.refusal is None:
        caveat = "; the model facts above are not known" if verdict.unknown else ""
        out.append(f"verdict: served: every path it turns on is checked{caveat} (exit {EXIT_SERVED})")
    else:
        out.append(f"verdict: refused (exit {EXIT_REFUSED}): {verdict.refusal}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """The dry run as a command: prints :func:`report` and returns the exit status (0 served, 2 refused)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else EXIT_REFUSED
    os.environ["HF_HUB_OFFLINE"] = "1"  # before SGLang (and huggingface_hub) is imported: see the NOTE above
    # what would stop the launcher here, as it would run (KVGUARD_MODE=check where unset); nothing is created
    problem = environment_problem({**os.environ, "KVGUARD_MODE": os.environ.get("KVGUARD_MODE", "check")},
                                  prepare=False)
    if problem is not None:
        print(problem, file=sys.stderr)
        return EXIT_REFUSED
    if os.environ.get("KVGUARD_MODE", "").strip().lower() == "off":
        print("kvguard check: note: KVGUARD_MODE=off here, so the launcher would start SGLang without kvguard; "
              "this is the verdict with KVGUARD_MODE=check", file=sys.stderr)
    try:
        verdict = check(argv)
    except BadArguments as err:
        print(f"kvguard check: SGLang rejects these arguments, nothing would start:\n{err}", file=sys.stderr)
        return EXIT_REFUSED
    print(report(verdict))
    return verdict.exit_code


def environment_problem(env: Mapping[str, str], *, prepare: bool = True) -> str | None:
    """Why the launcher refuses to start in this environment, or None: an invalid ``KVGUARD_*`` value, an
    incident folder where no file can be made (created and probed only if ``prepare``; the dry run does not),
    ``SGLANG_PLUGINS`` set without kvguard."""
    try:
        config = TrackerConfig.from_env(env)
        if config.mode == "check" and prepare:
            prepare_dir(config.incident_dir)
    except SettingsError as err:
        return f"kvguard: refusing to start: {err}"
    allowed = env.get("SGLANG_PLUGINS", "")
    if allowed.strip() and "kvguard" not in {x.strip() for x in allowed.split(",")}:
        return (f"kvguard: refusing to start: SGLANG_PLUGINS={allowed!r} does not include kvguard, so SGLang "
                f"would not load it; add kvguard to SGLANG_PLUGINS")
    return None


def cli(argv: list[str] | None = None) -> None:
    """The ``kvguard`` console script: ``kvguard check <sglang.launch_server arguments>``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        raise SystemExit(0)
    if argv[:1] != ["check"]:
        problem = f"kvguard: unknown command {argv[0]!r}" if argv else "kvguard: no command given"
        print(f"{problem}\n{USAGE}", file=sys.stderr)
        raise SystemExit(EXIT_REFUSED)
    raise SystemExit(main(argv[1:]))


if __name__ == "__main__":
    raise SystemExit(main())
