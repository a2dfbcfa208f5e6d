"""pegaflow.platform.in_place_segments: CPU workers' KV caches found by their engine's name, and
whether the worker that made each is still there (decided by its mapping, not its pid)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from pegaflow.platform import in_place_segments, shm
from tests.conftest import unique_engine_name
from tests.cpu_workers import CACHE_BYTES, killed_worker_cache, running_worker_cache


@pytest.fixture
def live_cache():
    with running_worker_cache() as cache:
        yield cache


def test_in_place_segments_name_the_engine_and_the_worker(live_cache):
    name, buffer = live_cache
    assert buffer.name.startswith(f"/pegaflow.{os.getuid()}.{name}.cpukv.{os.getpid()}.")
    # The engine still takes it as a buffer of this process (REGISTER's check).
    assert shm.is_private_buffer_of(buffer.name, os.getpid())
    assert not shm.is_private_buffer_of(buffer.name, os.getpid() + 1)


def test_in_place_segments_killed_worker_is_gone_and_a_live_one_alive(live_cache):
    # 1. This process's cache (it maps it) and a killed worker's, under one engine name.
    name, buffer = live_cache
    left = killed_worker_cache(name)
    found = {s.name: s for s in in_place_segments.find(name)}
    assert set(found) == {buffer.name, left}
    assert found[buffer.name].is_owner_alive and not found[buffer.name].is_orphan
    assert found[left].is_orphan and found[left].num_bytes >= CACHE_BYTES
    # 2. Another engine's name finds neither.
    assert in_place_segments.find(unique_engine_name("other")) == []
    # 3. Removing orphans takes the killed worker's only.
    assert [s.name for s in in_place_segments.remove_orphans(name)] == [left]
    assert [s.name for s in in_place_segments.find(name)] == [buffer.name]


def test_in_place_segments_pid_reused_by_a_process_that_does_not_map_it_is_an_orphan():
    # 1. A segment named for a live process (this one's child) that never mapped it, made
    #    long enough ago that its maker would have mapped it by now.
    name = unique_engine_name("reused")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    segment_name = f"/pegaflow.{os.getuid()}.{name}.cpukv.{other.pid}.0000abcd"
    segment = shm.create_segment(segment_name, 4096)
    segment.close()
    old = time.time() - 2 * in_place_segments.YOUNG_S
    os.utime(shm.segment_path(segment_name), (old, old))
    try:
        # 2. Its pid runs, but the process does not map it: its maker is gone.
        (found,) = in_place_segments.find(name)
        assert found.pid == other.pid and found.is_orphan
        # 3. Made a moment ago, it is presumed its maker's (about to map it).
        os.utime(shm.segment_path(segment_name))
        (young,) = in_place_segments.find(name)
        assert young.is_owner_alive
    finally:
        other.kill()
        other.wait()
        shm.unlink_segment(segment_name)
