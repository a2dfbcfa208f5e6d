"""``pegaflow-engine --clean NAME`` (engine.cleanup): a dead engine's shared memory removed, a
live engine's refused and left alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pegaflow.platform import shm
from pegaflow.platform.locks import lock_dir
from pegaflow.platform.wire import CONTROL_HEADER
from tests.conftest import shm_leftovers, wait_engine_ready
from tests.cpu_workers import killed_worker_cache, running_worker_cache
from tests.engine.test_foreign import OTHER_UID, needs_root

ROOT = Path(__file__).resolve().parents[2]


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
    from engine import cleanup
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


def _record_engine_pid(name: str, pid: int) -> None:
    """Make a dead engine's control segment name ``pid`` (as if the kernel had given its pid
    to another process since)."""
    control = shm.attach_segment(shm.ipc_name(name, "control"))
    try:
        control.array(CONTROL_HEADER, 1)["engine_pid"] = pid
    finally:
        control.close()


def _kill(engine) -> None:
    engine.is_clean_exit_expected = False
    engine.stop(signal.SIGKILL)


def test_clean_dead_engine_whose_pid_another_process_has_now_is_cleaned(engine_factory):
    # 1. A killed engine's control segment names a pid another live process has now.
    engine = engine_factory()
    _kill(engine)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _record_engine_pid(engine.name, other.pid)
        # 2. The name's lock is free, so no engine of that name runs: --clean removes it all.
        done = _clean(engine.name)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"removed what the engine named {engine.name!r} (pid {other.pid}) left" in done.stdout, done.stdout
        assert shm_leftovers(engine.name) == [], done.stdout
    finally:
        other.kill()
        other.wait()


def test_clean_holding_the_name_makes_an_engine_started_meanwhile_wait_and_serve(engine_factory, monkeypatch):
    # 1. A --clean of a killed engine's leftovers, paused while it holds the name.
    from engine import cleanup
    crashed = engine_factory()
    _kill(crashed)
    holding, resume = threading.Event(), threading.Event()
    unlink = shm.unlink_segment

    def paused(name: str) -> bool:
        holding.set()
        assert resume.wait(60)
        return unlink(name)

    monkeypatch.setattr(shm, "unlink_segment", paused)
    cleaning = threading.Thread(target=cleanup.clean, args=(crashed.name,))
    cleaning.start()
    try:
        assert holding.wait(60)
        # 2. An engine of that name starts meanwhile: it waits for the --clean (and says so)...
        engine = engine_factory(crashed.name, wait=False)
        deadline = time.monotonic() + 60
        while "held by `pegaflow-engine --clean`" not in engine.stderr_text():
            assert engine.proc.poll() is None, engine.stderr_text()
            assert time.monotonic() < deadline, engine.stderr_text()
            time.sleep(0.05)
    finally:
        resume.set()
        cleaning.join(60)
    # 3. ...then serves once the --clean is done.
    wait_engine_ready(engine)
    assert engine.connect().ping() == 0


@pytest.mark.slow
def test_clean_racing_engine_starts_never_makes_one_exit(engine_factory):
    # Each round: a killed engine's leftovers, then --clean and a new engine started together.
    engine = engine_factory()
    for _ in range(10):
        _kill(engine)
        environ = {k: v for k, v in os.environ.items() if not k.startswith("PEGAFLOW_")}
        clean = subprocess.Popen([sys.executable, "-m", "engine", "--clean", engine.name], cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ)
        engine = engine_factory(engine.name, wait=False)
        out, err = clean.communicate(timeout=120)
        # The engine always starts; --clean either went first (0) or found it running (1).
        wait_engine_ready(engine)
        assert clean.returncode == 0 or f"is running (pid {engine.proc.pid})" in err, (clean.returncode, out, err)


@needs_root
def test_clean_as_root_names_another_users_segments_leaves_them_and_exits_1(engine_factory):
    # 1. A killed engine's leftovers, two of which another user made (chown stands in), and
    #    another user's in-place KV cache planted under the name.
    engine = engine_factory()
    _kill(engine)
    stats, doorbell = shm.ipc_name(engine.name, "stats"), shm.ipc_name(engine.name, "doorbell")
    planted = shm.create_segment(f"/pegaflow.{os.getuid()}.{engine.name}.cpukv.{2**22}.0000abcd", 4096)
    planted.close()
    foreign = [shm.segment_path(stats), shm.segment_path(doorbell, is_semaphore=True), shm.segment_path(planted.name)]
    for path in foreign:
        os.chown(path, OTHER_UID, OTHER_UID)
    try:
        # 2. --clean (as root, who could unlink them) names them, leaves them, and exits 1.
        done = _clean(engine.name)
        assert done.returncode == 1, done.stdout + done.stderr
        assert "3 not removed, not this user's" in done.stdout and stats in done.stdout
        assert sorted(shm_leftovers(engine.name)) == sorted(os.path.basename(p) for p in foreign)
    finally:
        shm.unlink_segment(stats)
        shm.unlink_semaphore(doorbell)
        shm.unlink_segment(planted.name)


def test_clean_removes_killed_cpu_workers_kv_caches_and_keeps_running_ones():
    # 1. Two CPU workers of an engine: one killed (its KV cache left), this process running.
    with running_worker_cache() as (name, running):
        left = killed_worker_cache(name)
        # 2. --clean removes the killed one's, keeps the running one's and says whose.
        done = _clean(name)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"pegaflow-engine: nothing of an engine named {name!r} was left")
        assert "; removed 1 KV cache of its CPU workers that are gone, holding 1.0 MiB" in done.stdout
        assert f"; kept 1 KV cache of CPU workers still running (pids {os.getpid()})" in done.stdout
        assert shm_leftovers(name) == [running.name.lstrip("/")]
        assert not shm.unlink_segment(left)
