"""Checks that run before any work: what a scenario needs from this machine, output paths, CLI numbers.

Each failure raises ``UsageError`` (a ValueError; the CLI exits 2) with one message naming the field or
flag, the value and what is allowed. Nothing here writes a file (an output folder is probed by creating
and at once removing an empty file in it: permission bits do not tell root where files can be made).

A light module at import (the SGLang harnesses check their output options with it): what needs the
engine or torch is imported inside the function that uses it.
"""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from faultlab.chaos.limits import LIMITS, MAX_TOKENS, check_number

if TYPE_CHECKING:
    from faultlab.chaos.scenario import Scenario

DEVICES = ("cpu", "cuda", "cuda:N")
MEMORY_SHARE = 2  # KV pages may take at most 1/MEMORY_SHARE of the device's memory
PLOT_SUFFIXES = (".png", ".pdf", ".svg")


class UsageError(ValueError):
    """Bad input from the command line (exit code 2)."""


# -- numbers from the command line -----------------------------------------------------------------
def check_flag(flag: str, value, low, high):
    """A CLI number in [low, high] (None passes: the flag was not given)."""
    if value is None:
        return None
    return check_number(flag, value, low, high, UsageError)


def check_seeds(seeds, first_seed) -> None:
    """``--seeds`` and ``--first-seed``: the same bounds as ``[faults].seeds`` / ``first_seed``."""
    check_flag("--seeds", seeds, *LIMITS[("faults", "seeds")])
    check_flag("--first-seed", first_seed, *LIMITS[("faults", "first_seed")])


def max_jobs() -> int:
    """Worker processes a run may fork: one per core of this machine."""
    return os.cpu_count() or 1


def check_jobs(jobs: int) -> int:
    return check_flag("--jobs", jobs, 0, max_jobs())


def check_tokens(flag: str, value: int, low: int = 1, high: int = MAX_TOKENS) -> int:
    return check_flag(flag, value, low, high)


# -- output paths ----------------------------------------------------------------------------------
def check_output_file(flag: str, path, suffixes: tuple[str, ...] | None = None, *,
                      make_folder: bool = True) -> Path | None:
    """A file we may create or replace: not a directory; its folder one we may create files in. A missing
    folder passes when ``make_folder`` (the command creates it) and files can be made where it would go."""
    if path is None:
        return None
    p = Path(path)
    try:
        if str(path).strip() == "" or _kind(p) == "dir":
            raise UsageError(f"{flag} {str(path)!r} is not valid; give a file path, not a directory")
        if suffixes and p.suffix.lower() not in suffixes:
            raise UsageError(f"{flag} {str(path)!r} is not valid; the file name must end in one of {list(suffixes)}")
        if _kind(p) != "missing" and not os.access(p, os.W_OK):
            raise UsageError(f"{flag} {str(path)!r} is not writable; give a path you may write")
        _check_folder(flag, path, p.parent, make_folder)
    except (OSError, RuntimeError) as err:  # a path we may not look at (no search permission, a symlink loop)
        raise UsageError(f"{flag} {str(path)!r} is not valid: {getattr(err, 'strerror', None) or err}") from None
    return p


def check_output_dir(flag: str, path, *, make_folder: bool = True) -> Path:
    """A folder we may create files in; a missing one passes when ``make_folder`` (the command creates it)
    and files can be made where it would go."""
    p = Path(path)
    try:
        if str(path).strip() == "" or _kind(p) == "file":
            made = " (it is created if missing)" if make_folder else ""
            raise UsageError(f"{flag} {str(path)!r} is not valid; give a folder{made}, not a file")
        _check_folder(flag, path, p, make_folder)
    except (OSError, RuntimeError) as err:
        raise UsageError(f"{flag} {str(path)!r} is not valid: {getattr(err, 'strerror', None) or err}") from None
    return p


def _kind(path: Path) -> str:
    """``"dir"``, ``"file"`` (anything else that exists) or ``"missing"`` (also: a file on the way)."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return "missing"
    return "dir" if stat.S_ISDIR(mode) else "file"


def _check_folder(flag: str, path, folder: Path, make_folder: bool) -> None:
    """``folder`` is a directory we may create files in; a missing one must have an existing ancestor that
    is one (the command makes the rest), and the command must be one that makes it."""
    folder = folder.resolve()
    existing = folder
    while _kind(existing) == "missing":
        existing = existing.parent
    if _kind(existing) != "dir":
        raise UsageError(f"{flag} {str(path)!r} is not valid: {str(existing)!r} is a file, not a folder; "
                         f"give a path in a folder")
    if existing != folder and not make_folder:
        raise UsageError(f"{flag} {str(path)!r} is not valid: the folder {str(folder)!r} does not exist "
                         f"(create it first)")
    if not _can_create_in(existing):
        raise UsageError(f"{flag} {str(path)!r} is not writable: files cannot be created in {str(existing)!r}; "
                         f"give a path in a folder you may write")


def _can_create_in(folder: Path) -> bool:
    """Whether a file can be created in ``folder``: an empty probe file made there and removed at once.

    NOTE: ``os.access`` answers yes to root for /proc, /sys and read-only mounts alike; only creating a
    file tells (mkstemp fails there). The probe's name is random, so it never replaces a file."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return False
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".faultlab-probe-")
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def check_report_paths(json_out, plot) -> tuple[Path | None, Path | None]:
    """``--json`` and ``--plot`` (default: the JSON's path with .png); the two must differ."""
    if plot is not None and json_out is None:
        raise UsageError(f"--plot {plot!r} needs --json: the plot is drawn from the JSON report")
    json_path = check_output_file("--json", json_out)
    if json_path is None:
        return None, None
    flag = "--plot" if plot is not None else "--plot (default: the --json path with .png)"
    plot_path = check_output_file(flag, plot or json_path.with_suffix(".png"), PLOT_SUFFIXES)
    if plot_path.resolve() == json_path.resolve():
        raise UsageError(f"--plot {str(plot_path)!r} is the --json path; give the plot its own file")
    return json_path, plot_path


# -- what a scenario needs from this machine -------------------------------------------------------
def check_device(where: str, device) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``, with a CUDA device present for the latter two."""
    import torch

    kind, _, index = str(device).partition(":")
    if kind not in ("cpu", "cuda") or (kind == "cpu" and index) or (index and not index.isdigit()):
        raise UsageError(f"{where} = {device!r} is not valid; choose one of {list(DEVICES)}")
    if kind == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if int(index or 0) >= count:
            raise UsageError(f"{where} = {device!r} is not available: this machine has {count} CUDA device(s)")
    return device


def check_model(where: str, name: str):
    """The ModelConfig of preset ``name`` (its package installed, for smollm2)."""
    from faultlab.engine.choices import check_choice
    from faultlab.engine.config import PRESETS, get_preset

    check_choice(where, name, sorted(PRESETS), UsageError)
    try:
        return get_preset(name)
    except ValueError as err:  # smollm2 without its GGUF package
        raise UsageError(f"{where} = {name!r} is not available here: {err}") from None


def device_memory(device: str) -> int:
    """Bytes of memory of ``device`` (host RAM for cpu)."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_runnable(scenario: Scenario) -> None:
    """What a scenario needs from this machine: its device, its model, KV memory, and a context and a
    pool that every request of its workload fits. Raises UsageError."""
    from faultlab.engine.kvcache import PagedKVCache, ResidualLayout, token_bytes

    e, w = scenario.engine, scenario.workload
    check_device("[engine].device", e.device)
    mc = check_model("[engine].model", e.model)
    memory = device_memory(e.device)
    page_bytes = e.page_size * token_bytes(mc.n_layers, mc.n_kv_heads, mc.head_dim, e.kv_dtype)
    most = PagedKVCache.pages_for_budget(memory // MEMORY_SHARE, mc.n_layers, e.page_size, mc.n_kv_heads,
                                         mc.head_dim, e.kv_dtype)
    gib = f"{memory / 2**30:.1f} GiB"
    if e.num_pages > most:
        raise UsageError(f"[engine].num_pages = {e.num_pages} is too large for this machine: {e.page_size}-token "
                         f"pages of {page_bytes} bytes; its {e.device} memory ({gib}) holds at most {most} "
                         f"(1/{MEMORY_SHARE} of it)")
    if e.kv_budget_mb * 2**20 > memory // MEMORY_SHARE:
        raise UsageError(f"[engine].kv_budget_mb = {e.kv_budget_mb} is too large for this machine: at most "
                         f"{memory // MEMORY_SHARE // 2**20} MiB (1/{MEMORY_SHARE} of its {e.device} memory, {gib})")
    # NOTE: the same sizing as Engine.__init__ (pool pages from the budget, less the residual's share).
    pages = e.num_pages
    if not pages:
        residual = None
        if e.kv_residual:
            residual = ResidualLayout.of(w.concurrency, e.page_size, e.kv_residual_sink, e.kv_residual_window)
        budget = int(e.kv_budget_mb * 2**20) - PagedKVCache.residual_bytes(residual, mc.n_layers, mc.n_kv_heads,
                                                                          mc.head_dim)
        try:
            pages = PagedKVCache.pages_for_budget(budget, mc.n_layers, e.page_size, mc.n_kv_heads, mc.head_dim,
                                                  e.kv_dtype)
        except ValueError as err:
            raise UsageError(f"[engine].kv_budget_mb = {e.kv_budget_mb} is too small: {err}") from None
    context = min(e.max_context, mc.max_context)
    longest = (w.shared_prefix_len if w.shared_prefix_fraction > 0 else 0) + w.prompt_len[1] + w.output_len[1]
    fit = min(-(-context // e.page_size), pages) * e.page_size
    if longest > fit:
        raise UsageError(f"[workload] requests of up to {longest} tokens (shared_prefix_len + prompt_len[1] + "
                         f"output_len[1]) do not fit: at most {fit} tokens (context {context} tokens of model "
                         f"{e.model!r} and [engine].max_context, pool {pages} pages of {e.page_size})")
