"""The test layout rule (docs/contributing.md): every module of pegaflow/ and engine/ has a test
file named after it in the mirrored folder (``engine/blocks/index.py`` ->
``tests/engine/blocks/test_index.py``, or ``test_index_<suffix>.py`` such as ``_engine``;
a package's ``__main__.py`` -> ``test_main.py``), or a line in ``ALLOWED`` below saying why not.
A file named after a longer module of the same folder is that one's (``test_store_lookups.py``
is not store.py's).  A new module needs one or the other; an entry whose module has gained its
file, or is gone, must leave the list."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COVERED = ("pegaflow", "engine")

# Modules without a test file of their own, each with its reason.
ALLOWED = {
    # No logic of its own: declarations, records, constants, a shim.
    "engine/threads.py": "one helper (join threads within one deadline); used by every close",
    "engine/commands/received.py": "a received command's record and the LATER marker; every handler's tests use them",
    "pegaflow/platform/records.py": "declares numpy record dtypes; every layout of test_wire.py uses it",
    "pegaflow/platform/env_vars.py": "constants: the connector's environment variable names",
    "pegaflow/platform/errors.py": "the error hierarchy; each error tested where it is raised",
    "pegaflow/platform/pool_layout.py": "the pool table's record layouts; tests/engine/memory/test_pool_table.py",
    "pegaflow/platform/stats_layout.py": "the stats segment's record layouts; tests/pegaflow/stats/test_cli.py",
    "pegaflow/connector/request_state.py": "a dataclass record of one request; its owners' tests use it",
    "pegaflow/proxy/__main__.py": "a `python -m` shim over pegaflow/proxy/cli.py",
    "pegaflow/proxy/config.py": "a frozen config record; its checks tested through tests/pegaflow/proxy/test_cli.py",
    "pegaflow/proxy/metrics.py": "declares the proxy's Prometheus series; read through its test_app.py",
    "pegaflow/platform/cuda/results.py": "one unwrap of a cuda-python result; GPU-only",
    # GPU-only: their tests need CUDA and live in the gpu-marked files named.
    "pegaflow/platform/cuda/driver.py": "GPU-only; tested through tests/pegaflow/platform/cuda/test_ipc.py",
    "pegaflow/platform/cuda/nvrtc.py": "GPU-only; tested through tests/engine/copy/test_kernel_cache.py",
    "pegaflow/platform/cuda/batch_copy.py": "GPU-only; tested through tests/engine/copy/test_cuda_*.py",
    "engine/copy/kernels.py": "GPU-only; tested through tests/engine/copy/test_cuda_*.py and test_staged.py",
    # Wiring and thin clients: tested through a whole engine process or a fake.
    "engine/process/shutdown.py": "the engine's stop; tested through tests/engine/process/test_server.py",
    "engine/stats.py": "counters in the stats segment; read through tests/pegaflow/stats/test_cli.py",
    "engine/disk/open.py": "the disk tier's wiring; tested through tests/engine/disk/test_disk_engine.py",
    "engine/remote/store.py": "a thin client of Mooncake Store; tests/engine/remote/test_remote_engine.py runs it",
    "pegaflow/client/host_memory.py": "the host backend's KV segment; every engine test uses it",
}


def _modules() -> list[Path]:
    return sorted(p.relative_to(ROOT) for package in COVERED for p in (ROOT / package).rglob("*.py")
                  if p.name != "__init__.py")


def owner(test_file: Path, modules: set[str]) -> str | None:
    """The module of ``modules`` (names in one folder) that ``test_file`` is named after: the
    longest M with ``test_M.py`` or ``test_M_<suffix>.py`` (``test_store_lookups.py`` is
    store_lookups.py's, not store.py's)."""
    stem = test_file.stem.removeprefix("test_")
    named = [m for m in modules if stem == m or stem.startswith(m + "_")]
    return max(named, key=len, default=None)


def has_own_test_file(module: Path) -> bool:
    """Whether ``tests/<module's folder>/`` has a test file named after ``module``."""
    source, folder = ROOT / module.parent, ROOT / "tests" / module.parent
    names = {"main" if p.stem == "__main__" else p.stem for p in source.glob("*.py")}
    name = "main" if module.stem == "__main__" else module.stem
    return any(owner(f, names) == name for f in folder.glob("test_*.py"))


def test_test_layout_every_module_has_its_test_file_or_a_reason():
    modules = _modules()
    assert {m.parts[0] for m in modules} == set(COVERED)  # (the walk found the tree)
    assert [str(m) for m in modules if not has_own_test_file(m) and str(m) not in ALLOWED] == []


def test_test_layout_allowed_names_only_modules_still_without_their_file():
    modules = {str(m): m for m in _modules()}
    stale = [path for path in ALLOWED if path not in modules or has_own_test_file(modules[path])]
    assert stale == []

