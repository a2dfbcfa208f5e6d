"""Fixtures shared by every test directory: the real engine, started as a subprocess.

``engine`` starts one engine per test (``engine_factory`` when a test wants flags of its
own, or more than one engine); ``shared_engine`` serves a whole module whose tests do not
care what the others stored.  Each engine gets a unique ``--name``, the host backend and
a small pool; teardown sends SIGTERM and asserts a clean exit and that nothing named
after the engine is left in /dev/shm.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from pegaflow.platform import shm
from pegaflow.platform.wire import STATS, STATS_COUNTER_NAMES
from tools.engine_process import EngineProcess, EngineStartError

REPO_ROOT = Path(__file__).resolve().parent.parent

START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0
STATS_TIMEOUT_S = 30.0  # a loaded 2-core machine may take seconds; a condition met returns at once
_names = itertools.count()


def unique_engine_name(tag: str = "") -> str:
    """A name no other test (or other pytest run on this host) uses."""
    return f"t{os.getpid()}_{tag}{next(_names)}"


def readline_within(proc: subprocess.Popen, timeout_s: float = 30.0) -> str:
    """``proc``'s next line of stdout; ``proc`` is killed if none comes within
    ``timeout_s`` (a child that never prints fails the test instead of hanging it)."""
    watchdog = threading.Timer(timeout_s, proc.kill)
    watchdog.start()
    try:
        return proc.stdout.readline()
    finally:
        watchdog.cancel()


def shm_leftovers(name: str) -> list[str]:
    """Entries in /dev/shm that belong to engine ``name`` (segments and semaphores)."""
    prefix = f"pegaflow.{os.getuid()}.{name}."
    return sorted(e for e in os.listdir("/dev/shm")
                  if e.startswith(prefix) or e.startswith(f"sem.{prefix}"))


def engine_flags(*, slab_size: str = "1MiB", lease_ttl: float | None = None, max_clients: int = 8,
                 arena_size: str | None = None, extra: tuple[str, ...] = ()) -> list[str]:
    """The test engines' flags (beside the host backend and pool size); ``extra`` last, so it wins."""
    argv = ["--slab-size", slab_size, "--max-clients", str(max_clients)]
    if lease_ttl is not None:
        argv += ["--lease-ttl", str(lease_ttl)]
    if arena_size is not None:
        argv += ["--arena-size", arena_size]
    return argv + list(extra)


class EngineUnderTest(EngineProcess):
    """A test's engine: its stats segment read directly, a stop that fails the test if the
    engine does not exit, and whether a non-zero exit is expected."""

    def __init__(self, name: str, stderr_path: Path, *, pool_size: str = "64MiB",
                 prefix: tuple[str, ...] = (), **flags):
        super().__init__(name, *engine_flags(**flags), backend="host", pool_size=pool_size,
                         log_level="INFO", stderr_path=stderr_path, wait=False, prefix=prefix)
        self.is_clean_exit_expected = True
        self._stats_segment: shm.Segment | None = None

    def stats(self) -> dict[str, int]:
        """A snapshot of every counter and gauge of the stats segment."""
        if self._stats_segment is None:
            self._stats_segment = shm.attach_segment(shm.ipc_name(self.name, "stats"), readonly=True)
        row = self._stats_segment.array(STATS, 1)[0].copy()
        snapshot = {n: int(row[n]) for n in STATS_COUNTER_NAMES}
        snapshot["commands_by_opcode"] = [int(v) for v in row["commands_by_opcode"]]
        snapshot["errors_by_status"] = [int(v) for v in row["errors_by_status"]]
        return snapshot

    def fresh_stats(self, timeout_s: float = STATS_TIMEOUT_S) -> dict[str, int]:
        """Stats written by a housekeeping pass that began after this call (gauges are current)."""
        since_ns = time.time_ns()
        return self.wait_stats(lambda s: s["heartbeat_ns"] > since_ns, timeout_s)

    def wait_stats(self, predicate, timeout_s: float = STATS_TIMEOUT_S) -> dict[str, int]:
        """The first snapshot for which ``predicate`` holds; fails the test at the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            snapshot = self.stats()
            if predicate(snapshot):
                return snapshot
            if time.monotonic() >= deadline:
                pytest.fail(f"engine {self.name}: stats never satisfied the condition; last {snapshot}")
            time.sleep(0.005)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """Send ``sig`` (if still running) and reap; returns the exit code."""
        if self._stats_segment is not None:
            self._stats_segment.close()
            self._stats_segment = None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"engine {self.name} did not exit within {timeout_s}s of signal {sig}")


def wait_engine_ready(engine: EngineUnderTest, timeout_s: float = START_TIMEOUT_S) -> None:
    """Until a client can attach and PING; fails the test if the engine exits or is late."""
    try:
        engine.wait_ready(timeout_s)
    except EngineStartError as exc:
        pytest.fail(str(exc))


class EngineHarness:
    """Starts engines and, at the end, stops each one and checks it left nothing behind."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.engines: list[EngineUnderTest] = []

    def start(self, name: str | None = None, *, wait: bool = True, **flags) -> EngineUnderTest:
        name = name or unique_engine_name()
        stderr_path = self.log_dir / f"engine-{name}-{len(self.engines)}.log"
        engine = EngineUnderTest(name, stderr_path, **flags)
        self.engines.append(engine)
        if wait:
            wait_engine_ready(engine)
        return engine

    def stop_all(self) -> None:
        problems = []
        for engine in reversed(self.engines):
            returncode = engine.stop()
            if engine.is_clean_exit_expected and returncode != 0:
                problems.append(f"engine {engine.name} exited with {returncode}:\n{engine.stderr_text()}")
        for name in dict.fromkeys(e.name for e in self.engines):
            if left := shm_leftovers(name):
                problems.append(f"engine {name} left {left} in /dev/shm")
                for entry in left:  # keep the host clean for the next test, then fail
                    _remove_leftover(entry)
        assert not problems, "\n".join(problems)


def _remove_leftover(entry: str) -> None:
    if entry.startswith("sem."):
        shm.unlink_semaphore("/" + entry[len("sem."):])
    else:
        shm.unlink_segment("/" + entry)


@pytest.fixture
def engine_factory(tmp_path):
    """``engine_factory(pool_size=..., slab_size=..., lease_ttl=..., arena_size=...)``."""
    harness = EngineHarness(tmp_path)
    yield harness.start
    harness.stop_all()


@pytest.fixture
def engine(engine_factory) -> EngineUnderTest:
    """A fresh engine with the host backend and a 64 MiB pool of 1 MiB slabs."""
    return engine_factory()


@pytest.fixture(scope="module")
def shared_engine(tmp_path_factory) -> EngineUnderTest:
    """One engine for a whole module; tests must use hashes no other test uses."""
    harness = EngineHarness(tmp_path_factory.mktemp("engine"))
    # A detached client's slot is freed at the engine's next housekeeping pass (about a
    # second after a DETACH), so a module of quick tests needs more slots than are ever
    # attached at once.
    yield harness.start(max_clients=64)
    harness.stop_all()


@pytest.fixture
def rng(request) -> np.random.Generator:
    """Random bytes that differ per test but repeat between runs of the same test."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
