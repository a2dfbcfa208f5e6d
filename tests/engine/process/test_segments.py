"""engine/process/segments.py: room for the segments, a pool of whole slabs, and what a crash or a
clean stop leaves behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from engine.process import name_lock, segments
from pegaflow.platform import in_place_segments, shm
from pegaflow.platform.wire import CONTROL_HEADER
from tests.cpu_workers import killed_worker_cache, running_worker_cache


def test_engine_with_a_pool_larger_than_the_host_exits_1_and_says_why(engine_factory):
    # 1. A 64 TiB pool: the engine refuses at start (exit 1) instead of dying of SIGBUS later.
    engine = engine_factory(pool_size="64TiB", wait=False)
    engine.is_clean_exit_expected = False
    assert engine.proc.wait(30) == 1
    text = engine.stderr_text()
    assert "cannot start" in text and "--pool-size" in text and "Traceback" not in text
    # 2. (teardown) nothing named after it is left in /dev/shm.


def test_engine_pool_is_whole_slabs(engine_factory):
    # 1. 100 MiB in slabs of 64 MiB: one slab is allocated, and the engine says so.
    engine = engine_factory(pool_size="100MiB", slab_size="64MiB")
    assert engine.stats()["pool_bytes_capacity"] == 64 << 20
    pool = shm.attach_segment(shm.ipc_name(engine.name, "pool"), readonly=True)
    try:
        assert pool.size == 64 << 20
    finally:
        pool.close()
    assert "not a whole number of 64.0 MiB slabs" in engine.stderr_text()


def test_restart_after_a_crash_removes_the_rings_of_more_slots_than_its_own(engine_factory):
    # 1. An engine with 8 client slots dies by SIGKILL, leaving 8 rings behind.
    crashed = engine_factory(max_clients=8)
    crashed.is_clean_exit_expected = False
    crashed.stop(signal.SIGKILL)
    # 2. Its successor has 4 slots: it removes all 8 of the dead engine's rings anyway.
    restarted = engine_factory(crashed.name, max_clients=4)
    left = [e for e in os.listdir("/dev/shm") if f".{crashed.name}." in e and ("ring." in e or "cq." in e)]
    assert sorted(e.rsplit(".", 1)[1] for e in left) == ["0", "0", "1", "1", "2", "2", "3", "3"]
    assert restarted.connect().ping() == 0
    # 3. (teardown) nothing of either engine is left in /dev/shm.


def test_clean_stop_removes_the_name_lock_and_the_name_can_be_taken_again(engine_factory):
    # 1. A running engine holds a lock file on its name; a clean stop removes it.
    engine = engine_factory()
    lock = name_lock.name_lock_path(engine.name)
    assert os.path.exists(lock)
    assert engine.stop() == 0
    assert not os.path.exists(lock)
    # 2. Another engine takes the name at once.
    again = engine_factory(engine.name)
    assert again.connect().ping() == 0


@pytest.mark.parametrize("release_pool", [True, False])
def test_unlink_all_gives_the_pool_memory_back_only_when_no_copy_can_touch_it(release_pool):
    # 1. An engine's segments; the pool holds bytes, and a view of it outlives the names.
    from engine.config import EngineConfig
    from engine.process.segments import EngineSegments
    name = f"t{os.getpid()}_discard{int(release_pool)}"
    segs = EngineSegments(EngineConfig(name=name, pool_bytes=4 << 20, slab_bytes=1 << 20, num_slots=2))
    view = segs.pool.array(np.uint8, 4 << 20)
    view[:] = 0xAB
    # 2. Unlinked with release_pool (the stop found no copy in flight): the memory is given
    #    back at once, before the name is free; without it (copies may still run) it stays.
    segs.unlink_all(release_pool=release_pool)
    assert (view == (0 if release_pool else 0xAB)).all()
    assert not [e for e in os.listdir("/dev/shm") if f".{name}." in e]


def test_unlink_all_removes_the_pool_name_before_giving_its_memory_back(monkeypatch):
    # 1. An engine's segments; how /dev/shm looks when the pool's memory is given back.
    from engine.config import EngineConfig
    from engine.process.segments import EngineSegments
    from pegaflow.platform import shm as shm_module
    name = f"t{os.getpid()}_order"
    segs = EngineSegments(EngineConfig(name=name, pool_bytes=4 << 20, slab_bytes=1 << 20, num_slots=2))
    pool_file = segs.pool.name.lstrip("/")
    seen = []
    real_discard = shm_module.Segment.discard

    def discard(self):
        seen.append((self.name, os.path.exists(f"/dev/shm/{pool_file}"), bool(segs._name_lock)))
        real_discard(self)
    monkeypatch.setattr(shm_module.Segment, "discard", discard)
    # 2. A stop killed while the memory goes leaves no pool file behind: the name is gone
    #    first, while the engine's name lock still keeps the next engine out.
    segs.unlink_all()
    assert seen == [(segs.pool.name, False, True)]
    assert not [e for e in os.listdir("/dev/shm") if f".{name}." in e]


def test_segments_kept_pool_is_not_counted_against_room_again(monkeypatch):
    # 1. Segments of an engine that keeps its pool, released at its stop: pool and table stay.
    from engine.config import EngineConfig
    from engine.memory.pool_table import PoolTable
    from tests.conftest import shm_leftovers, unique_engine_name
    name = unique_engine_name("room")
    config = EngineConfig(name=name, pool_bytes=8 << 20, slab_bytes=1 << 20, keep_pool=True,
                          num_slots=2, arena_bytes=64 << 10, ring_slots=8)
    first = segments.EngineSegments(config)
    PoolTable(first.pool_table.array(np.uint8, first.pool_table.size), config.usable_pool_bytes,
              config.slab_bytes)  # the table's header, as the server writes it
    first.mark_started()  # as the server marks it once the pool is open
    first.unlink_all()
    assert len(shm_leftovers(name)) == 2
    # 2. The next engine takes them over; its room check asks only for what it creates.
    asked = []
    monkeypatch.setattr(segments, "check_room", lambda need, pool: asked.append((need, pool)))
    second = segments.EngineSegments(config)
    try:
        assert second.is_pool_kept and second.pool.size == 8 << 20
        [(need, pool)] = asked
        assert pool == 0 and need < 1 << 20
    finally:
        second.unlink_all()
        for what in segments.KEPT:
            shm.unlink_segment(shm.ipc_name(name, what))
    assert shm_leftovers(name) == []


def test_segments_keep_pool_start_that_fails_leaves_nothing():
    # 1. Segments of a keeping engine that never started serving (its start failed later).
    from engine.config import EngineConfig
    from tests.conftest import shm_leftovers, unique_engine_name
    name = unique_engine_name("fail")
    config = EngineConfig(name=name, pool_bytes=8 << 20, slab_bytes=1 << 20, keep_pool=True,
                          num_slots=2, arena_bytes=64 << 10, ring_slots=8)
    segments.EngineSegments(config).unlink_all()
    # 2. Its new pool is not kept: nothing of it is left.
    assert shm_leftovers(name) == []


def test_restart_after_a_crash_whose_pid_another_process_has_now_starts(engine_factory):
    # 1. A killed engine's control segment names a pid another live process has now.
    crashed = engine_factory()
    crashed.is_clean_exit_expected = False
    crashed.stop(signal.SIGKILL)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        control = shm.attach_segment(shm.ipc_name(crashed.name, "control"))
        control.array(CONTROL_HEADER, 1)["engine_pid"] = other.pid
        control.close()
        # 2. The name's lock is free: the next engine removes the leftovers and serves.
        restarted = engine_factory(crashed.name)
        assert restarted.connect().ping() == 0
        assert f"removing segments left by a dead engine named {crashed.name!r} (pid {other.pid})" \
            in restarted.stderr_text()
    finally:
        other.kill()
        other.wait()


def test_engine_start_removes_killed_cpu_workers_kv_caches_and_keeps_running_ones(engine_factory):
    # 1. Two CPU workers of engine NAME: one killed (its KV cache left), this process running.
    with running_worker_cache() as (name, running):
        left = killed_worker_cache(name)
        # 2. An engine of that name starts: the killed worker's cache goes, the running one's stays.
        engine = engine_factory(name)
        assert "removed 1 KV cache segment(s)" in engine.stderr_text()
        assert not shm.unlink_segment(left)
        assert [s.name for s in in_place_segments.find(name)] == [running.name]


def _segments_with_private_locks(tmp_path, monkeypatch, tag: str):
    """An engine's segments whose lock files live under ``tmp_path`` (a stand-in /dev/shm for
    the locks only: no other engine of this host shares the directory)."""
    from engine.config import EngineConfig
    from engine.process.segments import EngineSegments
    from pegaflow.platform import locks
    monkeypatch.setattr(locks, "SHM_BASE", str(tmp_path))
    name = f"t{os.getpid()}_{tag}"
    segs = EngineSegments(EngineConfig(name=name, pool_bytes=4 << 20, slab_bytes=1 << 20, num_slots=2))
    return segs, tmp_path / f"pegaflow-{os.geteuid()}", name


def test_segments_unlink_all_removes_the_lock_files_and_their_directory_once_empty(tmp_path, monkeypatch):
    # 1. Two engines' lock files in one directory: the first to stop leaves the other's.
    first, lock_dir, name = _segments_with_private_locks(tmp_path, monkeypatch, "lockdir1")
    second, _, other = _segments_with_private_locks(tmp_path, monkeypatch, "lockdir2")
    assert sorted(os.listdir(lock_dir)) == [f"{name}.claims", f"{name}.lock", f"{other}.claims", f"{other}.lock"]
    first.unlink_all()
    assert sorted(os.listdir(lock_dir)) == [f"{other}.claims", f"{other}.lock"]
    # 2. The last one removes its files and the directory.
    second.unlink_all()
    assert not lock_dir.exists()


def test_segments_unlink_all_removes_the_lock_files_even_when_a_segment_unlink_fails(tmp_path, monkeypatch):
    # An unlink that fails midway (here: the first segment's) still frees the name: its lock
    # files go, the error is raised.
    segs, lock_dir, name = _segments_with_private_locks(tmp_path, monkeypatch, "lockfail")
    real_unlink, failed = shm.unlink_segment, []

    def unlink_once_failing(segment_name):
        if not failed:
            failed.append(segment_name)
            raise OSError("unlink refused")
        return real_unlink(segment_name)

    monkeypatch.setattr(shm, "unlink_segment", unlink_once_failing)
    try:
        with pytest.raises(OSError, match="unlink refused"):
            segs.unlink_all()
        assert not lock_dir.exists()
    finally:  # what the failed unlink left, removed for the next test
        monkeypatch.setattr(shm, "unlink_segment", real_unlink)
        for leftover in [e for e in os.listdir("/dev/shm") if f".{name}." in e]:
            (shm.unlink_semaphore if leftover.startswith("sem.") else shm.unlink_segment)(
                "/" + leftover.removeprefix("sem."))
