"""The block index's policies through a real engine: LRU eviction, leases, expiry, a full pool.

The engine runs with a 256 KiB pool of one slab, so it holds exactly 16 blocks of the
test client's geometry (4 layers x 4 KiB pages = 16 KiB a block).
"""

from __future__ import annotations

import numpy as np

from pegaflow.platform.wire import Status
from tests.conftest import STATS_TIMEOUT_S

NAMESPACE = 0x1DE7
POOL_SIZE = "256KiB"
POOL_BYTES = 256 << 10


def small_engine(engine_factory, **flags):
    return engine_factory(pool_size=POOL_SIZE, slab_size=POOL_SIZE, **flags)


def test_index_full_pool_evicts_least_recently_used_first(engine_factory, kv_client, rng, make_hashes):
    engine = small_engine(engine_factory)
    kv = kv_client(engine)
    capacity = POOL_BYTES // kv.ENTRY_BYTES
    old = make_hashes(capacity)
    # 1. Fill the pool with one chain: a finished SAVE touches its blocks tail to head, so
    #    old[0] is the most recently used and old[-1] the least (a chain goes from its tail).
    kv.fill(rng, range(capacity))
    assert kv.save(NAMESPACE, range(capacity), old).value == capacity
    # 2. Use old[8..11] (lookup, then release): they become the most recently used.
    assert kv.num_hits(NAMESPACE, old[8:12]) == 4
    # 3. Store 4 new blocks: the 4 least recently used go, i.e. old[12..15].
    new = make_hashes(4)
    saved = kv.save(NAMESPACE, range(capacity, capacity + 4), new)
    assert (saved.value, saved.value3) == (4, 0)
    survivors = [h for h in old + new if kv.num_hits(NAMESPACE, [h]) == 1]
    assert survivors == old[:12] + new
    # 4. The engine counted exactly those 4 evictions, and the pool is still full.
    stats = engine.wait_stats(lambda s: s["evictions"] == 4)
    assert stats["pool_blocks_used"] == capacity


def test_index_leased_blocks_survive_pool_pressure(engine_factory, kv_client, rng, make_hashes):
    engine = small_engine(engine_factory)
    kv = kv_client(engine)
    capacity = POOL_BYTES // kv.ENTRY_BYTES
    old = make_hashes(capacity)
    # 1. Fill the pool and take a lease on the first half.
    expected = kv.fill(rng, range(capacity))
    assert kv.save(NAMESPACE, range(capacity), old).value == capacity
    found = kv.client.lookup(NAMESPACE, old[:8])
    assert found.num_hit_blocks == 8
    # 2. Offer a pool's worth of new blocks: only the 8 unleased entries can make room.
    kv.fill(rng, range(capacity, 2 * capacity))
    saved = kv.save(NAMESPACE, range(capacity, 2 * capacity), make_hashes(capacity))
    assert (saved.status, saved.value, saved.value3) == (Status.OK, 8, 8)
    # 3. The leased blocks load byte-exact into poisoned blocks.
    kv.pages[:, 48:56] = 0x5A
    assert kv.load(NAMESPACE, range(48, 56), old[:8], lease_id=found.lease_id).is_ok
    np.testing.assert_array_equal(kv.pages[:, 48:56], expected[:, :8])
    # 4. The unleased half was evicted.
    assert kv.num_hits(NAMESPACE, old[8:9]) == 0


def test_index_lease_expiry_makes_blocks_evictable(engine_factory, kv_client, rng, make_hashes):
    lease_ttl_s = 2.0
    engine = small_engine(engine_factory, lease_ttl=lease_ttl_s)
    kv = kv_client(engine)
    capacity = POOL_BYTES // kv.ENTRY_BYTES
    old = make_hashes(capacity)
    # 1. Fill the pool and lease all of it, never releasing.
    kv.fill(rng, range(capacity + 4))
    assert kv.save(NAMESPACE, range(capacity), old).value == capacity
    found = kv.client.lookup(NAMESPACE, old)
    assert found.num_hit_blocks == capacity
    # 2. While the lease lives, nothing can be evicted: a new block is dropped.
    dropped = kv.save(NAMESPACE, [capacity], make_hashes(1))
    assert (dropped.value, dropped.value3) == (0, 1)
    engine.wait_stats(lambda s: s["leases_active"] == 1)
    # 3. After the TTL the engine expires the lease on its own.
    stats = engine.wait_stats(lambda s: s["leases_active"] == 0, timeout_s=lease_ttl_s + STATS_TIMEOUT_S)
    assert stats["lease_expiries"] == 1
    # 4. Now new blocks evict the formerly leased ones (the chain's tail first).
    saved = kv.save(NAMESPACE, range(capacity, capacity + 4), make_hashes(4))
    assert (saved.value, saved.value3) == (4, 0)
    assert kv.num_hits(NAMESPACE, old[-1:]) == 0 and kv.num_hits(NAMESPACE, old) == capacity - 4
    # 5. The expired lease is gone: releasing it is an error.
    assert kv.release(found.lease_id).status == Status.UNKNOWN_LEASE


def test_index_full_pool_with_nothing_evictable_drops_saves_and_stays_up(
        engine_factory, kv_client, rng, make_hashes):
    engine = small_engine(engine_factory)
    kv = kv_client(engine)
    capacity = POOL_BYTES // kv.ENTRY_BYTES
    old = make_hashes(capacity)
    kv.fill(rng, range(capacity + 5))
    # 1. Fill the pool and lease every block.
    assert kv.save(NAMESPACE, range(capacity), old).value == capacity
    assert kv.client.lookup(NAMESPACE, old).num_hit_blocks == capacity
    # 2. Five more blocks: OK, but all five dropped (value3), nothing stored.
    new = make_hashes(5)
    saved = kv.save(NAMESPACE, range(capacity, capacity + 5), new)
    assert (saved.status, saved.value, saved.value2, saved.value3) == (Status.OK, 0, 0, 5)
    assert kv.num_hits(NAMESPACE, new[:1]) == 0
    # 3. The engine counted the drops and still serves.
    stats = engine.wait_stats(lambda s: s["save_dropped_blocks"] == 5)
    assert stats["evictions"] == 0
    assert kv.client.ping() == 0
