"""Test-wide settings and shared fixtures: Triton runs under its interpreter on CPU; torch uses one thread.

The SGLang fixtures (``sglang_loader``, ``check_hooks``, ``make_rig``, ``rig_ps``) drive SGLang 0.5.23's
real classes through ``faultlab.sglang_live.rig.Rig``; SGLang is imported only when a test asks for them.

NOTE: the CI machine has 2 cores and pytest runs tiny models; torch's default thread pool spends more
time synchronizing than computing on such shapes (measured ~10x slower under load). The processes the tests
start (SGLang engines and their schedulers, HTTP servers, TP ranks) inherit ``OMP_NUM_THREADS=1``: with two
test workers each running an engine on 2 cores, their default thread pools oversubscribed the cores (the
whole suite: 7.8 minutes with them, 5.9 with one thread each; measured December 5).
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")  # for the processes the tests start; this one: set_num_threads below

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

# faultlab's pytest plugin is opt-in (no pytest11 entry point: installing kvguard on a server must not
# register it in every pytest run there); this is how a project that uses it turns it on.
pytest_plugins = ["faultlab.testing.pytest_plugin"]

# Files that start live engines or servers (module-scoped fixtures; about a minute or more each on 2 cores).
ENGINE_FILES = ("test_sglang_live/", "test_http_server.py", "test_engine/test_tp")


def pytest_configure(config):
    # NOTE: pytest-xdist's --dist loadfile hands out whole files, by default the files with the most tests first:
    # the live-engine files, a few tests each, came last, where a long one leaves the other worker idle. In collection
    # order (pytest_collection_modifyitems below: engine files first) the short files fill the end instead.
    if getattr(config.option, "dist", "no") == "loadfile":
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    """The engine files first (a stable sort: each file's tests keep their order)."""
    items.sort(key=lambda item: not any(part in item.nodeid for part in ENGINE_FILES))


_LOADER_RESULT = None


@pytest.fixture(scope="session")
def sglang_loader():
    """Run SGLang's own ``load_plugins()`` twice in this process: KVGUARD_MODE=off, then =check.

    The entry point comes from kvguard's installed metadata (pyproject's ``sglang.srt.plugins``
    group); SGLang finds it through importlib.metadata. Returns what was observed; afterwards
    kvguard's hooks are applied for the whole session.
    """
    global _LOADER_RESULT
    if _LOADER_RESULT is not None:  # session fixture, but keep it idempotent
        return _LOADER_RESULT
    import os
    import pkgutil
    from importlib.metadata import entry_points

    import sglang.srt.managers.schedule_batch as schedule_batch
    import sglang.srt.managers.scheduler_components.batch_result_processor  # noqa: F401
    import sglang.srt.mem_cache.kv_cache_builder  # noqa: F401
    import sglang.srt.plugins as plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    from kvguard.sglang.plugin import TARGETS

    def current():
        return {name: pkgutil.resolve_name(t) for name, t in TARGETS.items()}

    saved = {k: os.environ.get(k) for k in ("KVGUARD_MODE", "SGLANG_PLUGINS")}
    out = {"entry_points": sorted(f"{e.name}={e.value}" for e in entry_points(group="sglang.srt.plugins"))}
    before = current()
    try:
        os.environ["SGLANG_PLUGINS"] = "kvguard"
        os.environ["KVGUARD_MODE"] = "off"
        plugins._plugins_loaded = False
        plugins.load_plugins()
        out["off_hooks"] = sorted(t for t in HookRegistry._hooks if t in TARGETS.values())
        out["off_untouched"] = all(current()[n] is before[n] for n in TARGETS)
        os.environ["KVGUARD_MODE"] = "check"  # the next process start, with the switch on
        plugins._plugins_loaded = False
        plugins.load_plugins()
        out["check_hooks"] = sorted(t for t in HookRegistry._hooks if t in TARGETS.values())
        now = current()
        out["check_wrapped"] = {n: getattr(now[n], "__wrapped__", None) is before[n] for n in TARGETS}
        out["schedule_batch_rebound"] = schedule_batch.alloc_for_decode is now["alloc_for_decode"]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    _LOADER_RESULT = out
    return out

@pytest.fixture(scope="session")
def check_hooks(sglang_loader):
    """kvguard's hooks, applied by SGLang's own plugin loader (see sglang_loader)."""
    return True


@pytest.fixture
def make_rig(check_hooks):
    from prometheus_client import CollectorRegistry

    from faultlab.sglang_live.rig import Rig

    def _make(page_size: int, **kwargs):
        rig = Rig(page_size, **kwargs)
        rig.registry = CollectorRegistry()
        return rig

    return _make


@pytest.fixture(params=["torch", "triton"])
def kvguard_backend(request, monkeypatch):
    """A test on both of kvguard's backends: the torch references and the Triton kernels (interpreted on the
    CPU) that a GPU server runs (the check with its write guard, the decode recorder). Use it with
    ``pytest.mark.usefixtures("kvguard_backend")``, so it is set before the rig installs kvguard."""
    monkeypatch.setenv("KVGUARD_BACKEND", request.param)
    return request.param


@pytest.fixture(params=[1, 16], ids=["ps1", "ps16"])
def rig_ps(request, make_rig):
    """An installed rig at page size 1 and 16 (PagedTokenToKVPoolAllocator, FP8 MHA pool)."""
    rig = make_rig(request.param)
    rig.install(registry=rig.registry)
    return rig


@pytest.fixture
def hicache_shims(monkeypatch):
    """SGLang's HiCache host pool on a CPU (tests/host_pool_shims.py: what its CUDA host registration and copies do)."""
    import host_pool_shims

    host_pool_shims.apply(monkeypatch)
