"""--keep-pool: the pool and its table outlive the engine, and the next engine of the same
name and pool geometry takes in the blocks they hold (a clean stop or a crash); any other
engine of that name removes them."""

from __future__ import annotations

import os
import signal

import numpy as np

from tests.conftest import shm_leftovers, unique_engine_name

KEEP = ("--keep-pool",)


def _save(kv_client, engine, rng, namespace: int = 5):
    return kv_client(engine).store(rng, namespace, [2, 7, 11, 30])


def _load_back(kv_client, engine, hashes, namespace: int = 5) -> np.ndarray:
    client = kv_client(engine)
    found = client.client.lookup(namespace, hashes)
    assert found.num_hit_blocks == len(hashes)
    dst = [40, 41, 42, 43]
    client.pages[:, dst] = 0
    assert client.load(namespace, dst, hashes, lease_id=found.lease_id).is_ok
    return client.pages[:, dst].copy()


def test_keep_pool_blocks_outlive_a_clean_stop(engine_factory, kv_client, rng):
    # 1. An engine that keeps its pool stores 4 blocks, then stops cleanly.
    name = unique_engine_name("keep")
    first = engine_factory(name, extra=KEEP)
    hashes, saved = _save(kv_client, first, rng)
    assert first.stop() == 0
    # 2. Only the pool and its table are left.
    assert shm_leftovers(name) == [f"pegaflow.{os.getuid()}.{name}.{what}" for what in ("pool", "pool.table")]
    # 3. The next engine of that name takes them in: the blocks hit and load byte for byte.
    second = engine_factory(name, extra=KEEP)
    assert "took in 4 blocks" in second.stderr_text()
    assert np.array_equal(_load_back(kv_client, second, hashes), saved)
    assert second.stop() == 0
    # 4. An engine that does not keep pools removes what was kept, and leaves nothing.
    third = engine_factory(name)
    assert "removing the pool an earlier engine" in third.stderr_text()
    assert kv_client(third).num_hits(5, hashes) == 0


def test_keep_pool_blocks_outlive_a_crash(engine_factory, kv_client, rng):
    # 1. A keeping engine stores blocks and is killed.
    name = unique_engine_name("keepk")
    first = engine_factory(name, extra=KEEP)
    first.is_clean_exit_expected = False
    hashes, saved = _save(kv_client, first, rng)
    first.stop(signal.SIGKILL)
    # 2. The next keeping engine removes the dead one's rings but takes in its blocks.
    second = engine_factory(name, extra=KEEP)
    assert "took in 4 blocks" in second.stderr_text()
    assert np.array_equal(_load_back(kv_client, second, hashes), saved)
    # 3. It gives the pool up when stopped by an engine that does not keep it.
    assert second.stop() == 0
    engine_factory(name)


def test_keep_pool_of_another_size_is_removed_not_taken_in(engine_factory, kv_client, rng):
    name = unique_engine_name("keeps")
    first = engine_factory(name, extra=KEEP)
    hashes, _ = _save(kv_client, first, rng)
    assert first.stop() == 0
    # 1. A keeping engine with another pool size: the kept pool does not fit, and goes.
    second = engine_factory(name, pool_size="32MiB", extra=KEEP)
    assert "removing the pool an earlier engine" in second.stderr_text()
    assert kv_client(second).num_hits(5, hashes) == 0
    assert second.stop() == 0
    engine_factory(name)  # removes the 32 MiB pool this one kept
