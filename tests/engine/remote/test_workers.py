"""engine/remote/workers.py: blocks put from their pool pages with their headers, then found
by a query (the run the store holds, its block size from the first header) and fetched into
other pages, each checked: a damaged object is CORRUPT, a missing one FAILED; a DROP's blocks
leave the store.  Over the in-process store of fake_store.py."""

from __future__ import annotations

import time

import numpy as np
import pytest

from engine.remote.header import data_name, header_name
from engine.remote.workers import FetchStatus, Kind, RemoteJob, RemoteWorkers
from tests.engine.remote.fake_store import FakeStore

PAGE, NUM_LAYERS, WAIT_S = 4096, 2, 30.0
KEYS = [(3, bytes([i]) * 33) for i in range(3)]


@pytest.fixture
def workers():
    store, pool = FakeStore(), np.zeros(16 * PAGE, np.uint8)
    pool[:3 * PAGE] = np.random.default_rng(0).integers(0, 256, 3 * PAGE, dtype=np.uint8)
    workers = RemoteWorkers(store, pool)
    yield workers
    assert workers.close(WAIT_S)


def _done(workers: RemoteWorkers, kind: Kind):
    deadline = time.monotonic() + WAIT_S
    while True:
        for done in workers.take_results():
            assert done.kind is kind
            return done
        assert time.monotonic() < deadline, f"no {kind.name} result"
        time.sleep(0.001)


def _publish(workers: RemoteWorkers, keys) -> None:
    for i, key in enumerate(keys):
        assert workers.try_publish(RemoteJob(Kind.PUT, i, [key], [i * PAGE], [PAGE], NUM_LAYERS))
    stored = 0
    while stored < len(keys):
        done = _done(workers, Kind.PUT)
        assert all(done.results)
        stored += len(done.tokens)


def test_remote_workers_query_finds_the_run_the_store_holds_with_its_block_size(workers):
    _publish(workers, KEYS[:2])
    workers.submit(RemoteJob(Kind.QUERY, 7, [KEYS[0], KEYS[1], KEYS[2], KEYS[0]]))
    done = _done(workers, Kind.QUERY)
    # The run stops at the first key the store lacks, whatever follows it.
    assert done.tokens == [7] and done.results == [(PAGE, NUM_LAYERS)] * 2 + [None, None]
    assert done.num_errors == 0


def test_remote_workers_fetch_checks_each_block(workers):
    _publish(workers, KEYS[:2])
    store, pool = workers.store, workers.pool
    # 1. Block 1's data damaged in the store; block 2 never put.
    damaged = bytearray(store.objects[data_name(KEYS[1])])
    damaged[10] ^= 0xFF
    store.objects[data_name(KEYS[1])] = bytes(damaged)
    # 2. Fetched into pages 8..10: 0 OK and its bytes exact, 1 CORRUPT, 2 FAILED.
    offsets = [8 * PAGE, 9 * PAGE, 10 * PAGE]
    workers.submit(RemoteJob(Kind.FETCH, 1, KEYS, offsets, [PAGE] * 3))
    done = _done(workers, Kind.FETCH)
    assert done.results == [FetchStatus.OK, FetchStatus.CORRUPT, FetchStatus.FAILED]
    assert np.array_equal(pool[8 * PAGE:9 * PAGE], pool[:PAGE]) and done.num_bytes == PAGE
    assert done.num_errors == 0  # a missing object is a miss, not the store's error


def test_remote_workers_store_down_is_counted_as_errors_not_raised(workers):
    workers.store.is_down = True
    workers.submit(RemoteJob(Kind.QUERY, 1, KEYS))
    done = _done(workers, Kind.QUERY)
    assert done.results == [None] * 3 and done.num_errors == 3


def test_remote_workers_remove_takes_both_objects_of_a_dropped_block(workers):
    _publish(workers, KEYS[:2])
    assert workers.try_publish(RemoteJob(Kind.REMOVE, 0, [KEYS[0]]))
    deadline = time.monotonic() + WAIT_S
    while data_name(KEYS[0]) in workers.store.objects or header_name(KEYS[0]) in workers.store.objects:
        assert time.monotonic() < deadline, "the dropped block's objects stayed"
        time.sleep(0.001)
    assert data_name(KEYS[1]) in workers.store.objects and header_name(KEYS[1]) in workers.store.objects
