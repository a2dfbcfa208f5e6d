"""``pegaflow-engine --clean NAME`` (engine.process.cleanup): a dead engine's shared memory removed, a
live engine's refused and left alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from pegaflow.platform.locks import lock_dir
from tests.conftest import shm_leftovers

ROOT = Path(__file__).resolve().parents[3]


def _clean(name: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PEGAFLOW_")}
    return subprocess.run([sys.executable, "-m", "engine", "--clean", name], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=environ)


def _lock_files(name: str) -> list[str]:
    return sorted(e for e in os.listdir(lock_dir()) if e.startswith(f"{name}."))


def test_clean_removes_everything_a_killed_engine_left(engine_factory):
    # 1. An engine killed with SIGKILL leaves its pool, segments, semaphores and locks.
    engine = engine_factory(extra=("--keep-pool",))
    pid = engine.proc.pid
    engine.is_clean_exit_expected = False
    engine.stop(signal.SIGKILL)
    left = shm_leftovers(engine.name)
    segments = [e for e in left if not e.startswith("sem.")]
    assert f"pegaflow.{os.getuid()}.{engine.name}.pool" in segments and len(left) > len(segments)
    assert _lock_files(engine.name)
    # 2. --clean removes each of them, says how many and whose, and exits 0.
    done = _clean(engine.name)
    assert done.returncode == 0, done.stderr
    assert (f"removed what the engine named {engine.name!r} (pid {pid}) left: {len(segments)} segments "
            f"holding") in done.stdout
    assert f"and {len(left) - len(segments)} semaphores" in done.stdout
    assert shm_leftovers(engine.name) == [] and _lock_files(engine.name) == []
    # 3. A second run finds nothing, and says so.
    again = _clean(engine.name)
    assert again.returncode == 0 and "nothing of an engine named" in again.stdout


def test_clean_refuses_a_running_engine_and_leaves_it_serving(engine):
    before = shm_leftovers(engine.name)
    # 1. Running: refused with exit 1, naming its pid; nothing removed, it still answers.
    done = _clean(engine.name)
    assert done.returncode == 1 and f"is running (pid {engine.proc.pid})" in done.stderr, done.stderr
    assert shm_leftovers(engine.name) == before
    client = engine.connect()
    try:
        client.ping()
    finally:
        client.close()
    # 2. Stopped with SIGSTOP (alive, not answering): still refused.
    os.kill(engine.proc.pid, signal.SIGSTOP)
    try:
        stopped = _clean(engine.name)
    finally:
        os.kill(engine.proc.pid, signal.SIGCONT)
    assert stopped.returncode == 1 and "is running" in stopped.stderr
    assert shm_leftovers(engine.name) == before


def test_clean_an_engine_that_never_ran_finds_nothing():
    done = _clean(f"t{os.getpid()}_never")
    assert done.returncode == 0 and "nothing of an engine named" in done.stdout
    assert _lock_files(f"t{os.getpid()}_never") == []


def test_clean_a_segment_it_may_not_remove_is_listed_and_the_rest_still_go(engine_factory, monkeypatch):
    # 1. A killed engine's leftovers, one of which (its pool) this user may not remove.
    from engine.process import cleanup
    from pegaflow.platform import shm
    from pegaflow.platform.errors import ForeignSegmentError
    engine = engine_factory(extra=("--keep-pool",))
    engine.is_clean_exit_expected = False
    engine.stop(signal.SIGKILL)
    pool = f"/pegaflow.{os.getuid()}.{engine.name}.pool"
    unlink = shm.unlink_segment

    def refusing(name: str) -> bool:
        if name == pool:
            raise ForeignSegmentError(f"{name} is owned by another user")
        return unlink(name)

    monkeypatch.setattr(shm, "unlink_segment", refusing)
    # 2. clean() names it, removes every other segment, semaphore and lock file.
    cleaned = cleanup.clean(engine.name)
    assert cleaned.not_removed == (pool,)
    assert cleaned.num_segments > 0 and cleaned.num_semaphores > 0
    assert shm_leftovers(engine.name) == [pool.lstrip("/")] and _lock_files(engine.name) == []
    unlink(pool)
