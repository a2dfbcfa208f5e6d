"""engine/memory/pinning.py and the engine around it: the pool pinned a chunk at a time, the engine
serving from the first chunk on and growing its usable pool as the rest is pinned.

The pinner is slowed by a backend whose ``pin_range`` of a background chunk waits for the
test's go-ahead (a semaphore, never a sleep), or, for a real engine process, by
``--pin-rate``.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import signal
import threading
import time

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.copy.host import HostBackend
from engine.memory import fault_in
from engine.memory.pinning import PoolPinner
from engine.process.server import EngineServer
from pegaflow.platform import shm
from pegaflow.stats.cli import format_once
from pegaflow.stats.engine_stats import read_stats
from tests.engine.conftest import KVClient

MIB = 1 << 20
WAIT_S = 10.0
NAMESPACE = 0x917
_names = itertools.count()


class GatedBackend(HostBackend):
    """The host backend; each background chunk is pinned only once the test allows it."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Semaphore(0)
        self.is_waiting = threading.Event()  # a background chunk waits for its go-ahead
        self.pinned: list[tuple[int, int]] = []
        self.is_closed = False
        self.pinned_after_close = False

    def allow(self, num_chunks: int = 1) -> None:
        for _ in range(num_chunks):
            self.gate.release()

    def pin_range(self, start: int, num_bytes: int) -> None:
        if start:
            self.is_waiting.set()
            if not self.gate.acquire(timeout=WAIT_S):
                raise AssertionError(f"chunk at {start} never allowed")
            self.is_waiting.clear()
        self.pinned_after_close |= self.is_closed
        self.pinned.append((start, num_bytes))

    def close(self) -> None:
        self.is_closed = True
        super().close()


def wait_for(predicate, what: str, timeout_s: float = WAIT_S):
    """Until ``predicate()`` is truthy (returned); fails the test at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() >= deadline:
            pytest.fail(f"never {what}")
        time.sleep(1e-3)
    return value


@pytest.fixture
def segment():
    seg = shm.create_segment(f"/pegaflow.{os.getuid()}.pintest{os.getpid()}", 8 * MIB)
    yield seg
    seg.close()
    seg.unlink()


# -- the pinner on its own --------------------------------------------------------------------


def test_pinner_pins_chunks_in_order_publishing_each_and_waking_the_engine(segment):
    backend, wakes = GatedBackend(), []
    pinner = PoolPinner(segment, backend, 2 * MIB, num_threads=2)
    # 1. The first chunk is pinned on the caller's thread: 2 of 8 MiB ready, not finished.
    pinner.pin_first()
    assert (pinner.progress.ready_bytes, pinner.progress.is_finished) == (2 * MIB, False)
    # 2. In the background, one chunk per go-ahead, each published and followed by a wake-up.
    pinner.start(wake=lambda: wakes.append(pinner.progress.ready_bytes))
    backend.allow()
    wait_for(lambda: pinner.progress.ready_bytes == 4 * MIB, "4 MiB ready")
    assert wait_for(lambda: wakes, "woken") == [4 * MIB]
    backend.allow(2)
    wait_for(lambda: pinner.progress.is_finished, "finished")
    assert pinner.stop() and not pinner.is_running
    # 3. Every chunk pinned once, in order, every page faulted in (allocated).
    assert backend.pinned == [(0, 2 * MIB), (2 * MIB, 2 * MIB), (4 * MIB, 2 * MIB), (6 * MIB, 2 * MIB)]
    assert (pinner.progress.ready_bytes, pinner.progress.error) == (8 * MIB, None)
    assert wakes == [4 * MIB, 6 * MIB, 8 * MIB]
    assert os.stat(f"/dev/shm/{segment.name.lstrip('/')}").st_blocks * 512 == 8 * MIB


def test_pinner_stop_ends_after_the_chunk_under_way(segment):
    backend = GatedBackend()
    pinner = PoolPinner(segment, backend, 2 * MIB, num_threads=1)
    pinner.pin_first()
    pinner.start()
    # 1. The thread waits inside its second chunk's pin_range when a stop comes in.
    wait_for(backend.is_waiting.is_set, "inside the second chunk")
    stopping = threading.Thread(target=pinner.stop)
    stopping.start()
    wait_for(lambda: pinner._stop.is_set(), "asked to stop")
    backend.allow(3)
    stopping.join(WAIT_S)
    # 2. It ended after that chunk: no other chunk was pinned.
    assert not pinner.is_running
    assert backend.pinned == [(0, 2 * MIB), (2 * MIB, 2 * MIB)]


def test_pinner_full_dev_shm_stops_it_with_the_pool_at_what_was_pinned(segment, monkeypatch, caplog):
    # 1. /dev/shm cannot back the pool past 5 MiB (MADV_POPULATE_WRITE says EFAULT there).
    base, madvise = segment.address(), fault_in._madvise

    def full_past_5_mib(address, num_bytes, advice):
        if advice == fault_in.MADV_POPULATE_WRITE and address + num_bytes > base + 5 * MIB:
            return errno.EFAULT
        return madvise(address, num_bytes, advice)

    monkeypatch.setitem(fault_in._state, "has_populate", True)
    monkeypatch.setattr(fault_in, "_madvise", full_past_5_mib)
    caplog.set_level(logging.INFO, logger="engine.memory.pinning")
    backend = GatedBackend()
    pinner = PoolPinner(segment, backend, 2 * MIB, num_threads=1)
    pinner.pin_first()
    backend.allow(3)
    pinner.start()
    # 2. The pinning ends at 4 MiB, saying why with the numbers; nothing past it is pinned.
    wait_for(lambda: pinner.progress.is_finished, "finished")
    progress = pinner.progress
    assert progress.ready_bytes == 4 * MIB and "/dev/shm cannot hold" in progress.error
    assert backend.pinned == [(0, 2 * MIB), (2 * MIB, 2 * MIB)]
    assert "pinning stopped at 4.0 MiB of 8.0 MiB: /dev/shm cannot hold" in caplog.text
    assert pinner.stop()


# -- an engine in this process, pinning through a gated backend ----------------------------------


def start_engine(backend: HostBackend, **fields) -> tuple[EngineServer, threading.Thread]:
    config = EngineConfig(**{"name": f"t{os.getpid()}_pin{next(_names)}", "backend": "host",
                             "pool_bytes": 8 * MIB, "slab_bytes": MIB, "pin_chunk_bytes": 2 * MIB,
                             "num_slots": 4, "ring_slots": 64, **fields})
    server = EngineServer(config, backend, serve_own_process=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread


def stop_engine(server: EngineServer, thread: threading.Thread) -> None:
    server.request_stop()
    thread.join(WAIT_S)
    assert not thread.is_alive()


def store_batches(kv: KVClient, rng, num_batches: int) -> list[tuple[list[bytes], np.ndarray]]:
    """``num_batches`` saves of all 64 blocks under new hashes: 1 MiB (a slab) each."""
    return [kv.store(rng, NAMESPACE, range(kv.NUM_BLOCKS)) for _ in range(num_batches)]


def test_engine_serves_from_the_first_chunk_and_grows_to_the_whole_pool(rng):
    backend = GatedBackend()
    server, thread = start_engine(backend)
    kv = None
    try:
        # 1. Only the first 2 MiB are pinned, and a client is served already.
        kv = KVClient(server.config.name)
        assert kv.client.ping() == 0
        assert read_stats(server.config.name)["pool_bytes_ready"] == 2 * MIB
        assert "pool    2.0 / 8.0 MiB ready" in format_once(read_stats(server.config.name))
        # 2. Three slabs' worth of blocks saved: never placed past the ready part (the
        #    oldest evicted to make room instead).
        store_batches(kv, rng, 3)
        offsets = [e.offset for e in list(server.index.entries.values())]
        assert max(offsets) < 2 * MIB and server.index.counters.evictions == 64
        # 3. The pinner goes on: the ready part grows chunk by chunk, and with it the stats.
        backend.allow()
        wait_for(lambda: read_stats(server.config.name)["pool_bytes_ready"] == 4 * MIB, "4 MiB ready")
        assert read_stats(server.config.name)["pool_pin_ns"] == 0
        backend.allow(2)
        stats = wait_for(lambda: (s := read_stats(server.config.name))["pool_pin_ns"] and s, "pinned")
        assert stats["pool_bytes_ready"] == stats["pool_bytes_capacity"] == 8 * MIB
        assert "ready" not in format_once(stats)
        # 4. The whole pool serves: five more slabs of blocks, no eviction, all of it used.
        store_batches(kv, rng, 5)
        offsets = [e.offset for e in list(server.index.entries.values())]
        assert max(offsets) >= 6 * MIB and server.index.counters.evictions == 64
    finally:
        if kv is not None:
            kv.close()
        stop_engine(server, thread)


def test_engine_stopped_while_pinning_ends_its_pinner_before_closing_the_backend():
    backend = GatedBackend()
    server, thread = start_engine(backend)
    # 1. Asked to stop while the pinner waits inside its second chunk.
    wait_for(lambda: backend.is_waiting.is_set() and backend.pinned, "inside the second chunk")
    server.request_stop()
    wait_for(lambda: server.pinner._stop.is_set(), "the pinner asked to stop")
    assert thread.is_alive()  # shutdown waits for the chunk under way
    backend.allow(3)
    thread.join(WAIT_S)
    # 2. It ended: the chunk under way was the last pinned, before the backend closed.
    assert not thread.is_alive() and backend.is_closed and not backend.pinned_after_close
    assert backend.pinned == [(0, 2 * MIB), (2 * MIB, 2 * MIB)]
    assert not any(e.startswith(f"pegaflow.{os.getuid()}.{server.config.name}.")
                   for e in os.listdir("/dev/shm"))


def test_engine_kept_blocks_past_the_first_chunk_are_served_once_pinned(rng):
    name = f"t{os.getpid()}_pinkeep{next(_names)}"
    # 1. An engine that keeps its pool stores three slabs of blocks (the third past 2 MiB).
    server, thread = start_engine(HostBackend(), name=name, keep_pool=True)
    kv = KVClient(name)
    try:
        wait_for(lambda: read_stats(name)["pool_pin_ns"], "pinned")  # else a batch may evict another
        batches = store_batches(kv, rng, 3)
    finally:
        kv.close()
        stop_engine(server, thread)
    # 2. The next one has pinned only its first chunk: the first two batches hit, the
    #    third (in the second chunk) is not found yet.
    backend = GatedBackend()
    server, thread = start_engine(backend, name=name, keep_pool=True)
    kv = None
    try:
        kv = KVClient(name)
        assert [kv.num_hits(NAMESPACE, hashes) for hashes, _ in batches] == [64, 64, 0]
        # 3. Its chunk pinned: the third batch hits, and loads byte for byte.
        backend.allow(3)
        wait_for(lambda: read_stats(name)["pool_pin_ns"], "pinned")
        hashes, saved = batches[2]
        found = kv.client.lookup(NAMESPACE, hashes)
        assert found.num_hit_blocks == 64
        kv.pages[:] = 0
        assert kv.load(NAMESPACE, range(64), hashes, lease_id=found.lease_id).is_ok
        assert np.array_equal(kv.pages, saved)
    finally:
        if kv is not None:
            kv.close()
        stop_engine(server, thread)
        for what in ("pool", "pool.table"):
            shm.unlink_segment(shm.ipc_name(name, what))


# -- a real engine process -----------------------------------------------------------------------


def test_engine_process_answers_before_its_pool_is_pinned_and_stops_mid_pinning(engine_factory):
    # 1. A 64 MiB pool pinned 4 MiB at a time, at most 1 MiB a second: the rest takes a minute.
    engine = engine_factory(extra=("--pin-chunk", "4MiB", "--pin-rate", "1MiB"))
    # 2. It answers a client (engine_factory waited for a PING) with most of the pool unpinned.
    stats = engine.stats()
    assert 4 * MIB <= stats["pool_bytes_ready"] < stats["pool_bytes_capacity"] == 64 * MIB
    assert stats["pool_pin_ns"] == 0
    assert "in the background" in engine.stderr_text()
    # 3. SIGTERM while it pins: a clean exit (the harness checks /dev/shm), waited for half
    #    as long as the pinning would take: an exit that waited for it would come too late.
    assert engine.stop(signal.SIGTERM, timeout_s=30.0) == 0
