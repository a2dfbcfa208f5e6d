"""engine.commands.transfers through a real engine process: SAVE and LOAD byte for byte, stored
once, visible once every layer is in, leases handed over or refused, a full pool."""

from __future__ import annotations

import numpy as np

from pegaflow.platform.wire import Status

NAMESPACE = 0x7E57


def test_transfers_save_then_load_is_byte_exact(shared_engine, kv_client, rng, make_hashes):
    kv = kv_client(shared_engine)
    hashes = make_hashes(16)
    src = np.arange(16)
    dst = np.arange(32, 48)
    # 1. Save 16 blocks of random bytes: all 16 are stored, none deduped or dropped.
    expected = kv.fill(rng, src)
    saved = kv.save(NAMESPACE, src, hashes)
    assert (saved.status, saved.value, saved.value2, saved.value3) == (Status.OK, 16, 0, 0)
    # 2. Look them up: the whole prefix hits and a lease is handed out.
    found = kv.client.lookup(NAMESPACE, hashes)
    assert found.num_hit_blocks == 16 and found.lease_id != 0
    # 3. Poison other blocks, load into them, and compare every byte of every layer.
    kv.pages[:, dst] = 0xA5
    loaded = kv.load(NAMESPACE, dst, hashes, lease_id=found.lease_id)
    assert loaded.is_ok and loaded.value == 16
    np.testing.assert_array_equal(kv.pages[:, dst], expected)
    # 4. The source blocks were not touched by the load.
    np.testing.assert_array_equal(kv.pages[:, src], expected)


def test_transfers_save_same_hashes_twice_stores_once(engine, kv_client, rng, make_hashes):
    kv = kv_client(engine)
    hashes = make_hashes(8)
    # 1. Save 8 blocks; the pool now holds 8 entries.
    first = kv.fill(rng, range(8))
    assert kv.save(NAMESPACE, range(8), hashes).value == 8
    engine.wait_stats(lambda s: s["pool_blocks_used"] == 8 and s["blocks_saved"] == 8)
    # 2. Save the same hashes again from other blocks with other bytes: all 8 are dedup.
    kv.fill(rng, range(8, 16))
    again = kv.save(NAMESPACE, range(8, 16), hashes)
    assert (again.status, again.value, again.value2, again.value3) == (Status.OK, 0, 8, 0)
    # 3. Nothing new was stored or counted as saved (gauges from a later housekeeping pass);
    #    the dedup counter moved by 8.
    after = engine.fresh_stats()
    assert after["pool_blocks_used"] == 8 and after["blocks_saved"] == 8
    assert after["save_dedup_blocks"] == 8
    # 4. The first copy is the one that stays.
    assert kv.load(NAMESPACE, range(16, 24), hashes).is_ok
    np.testing.assert_array_equal(kv.pages[:, 16:24], first)


def test_transfers_save_duplicate_hash_within_one_command_stores_once(engine, kv_client, rng, make_hashes):
    kv = kv_client(engine)
    [h] = make_hashes(1)
    # 1. One SAVE names the same hash for two blocks: one is stored, one is dedup.
    kv.fill(rng, range(2))
    saved = kv.save(NAMESPACE, [0, 1], [h, h])
    assert (saved.value, saved.value2) == (1, 1)
    engine.wait_stats(lambda s: s["pool_blocks_used"] == 1 and s["blocks_saved"] == 1)


def test_transfers_block_visible_only_when_every_layer_saved(shared_engine, kv_client, rng, make_hashes):
    kv = kv_client(shared_engine)
    hashes = make_hashes(2)
    expected = kv.fill(rng, [0, 1])
    # 1. Save layer by layer; until the last layer is in, lookups do not see the blocks.
    for layer in range(kv.NUM_LAYERS - 1):
        assert kv.save(NAMESPACE, [0, 1], hashes, layer=layer).is_ok
        assert kv.num_hits(NAMESPACE, hashes) == 0
        assert kv.load(NAMESPACE, [8, 9], hashes).status == Status.MISSING_BLOCK
    # 2. The last layer makes both visible, with every layer's bytes.
    assert kv.save(NAMESPACE, [0, 1], hashes, layer=kv.NUM_LAYERS - 1).is_ok
    assert kv.num_hits(NAMESPACE, hashes) == 2
    assert kv.load(NAMESPACE, [8, 9], hashes).is_ok
    np.testing.assert_array_equal(kv.pages[:, [8, 9]], expected)


def test_transfers_refused_load_releases_its_lease(engine, kv_client, rng, make_hashes):
    kv = kv_client(engine)
    hashes = make_hashes(3)
    kv.fill(rng, range(3))
    assert kv.save(NAMESPACE, range(3), hashes).value == 3
    # 1. A lookup leases the three blocks; the LOAD meant to use the lease is refused.
    found = kv.client.lookup(NAMESPACE, hashes)
    assert found.num_hit_blocks == 3 and engine.stats()["leases_active"] == 1
    bad = kv.client.submit_load(NAMESPACE, [0, 1, kv.NUM_BLOCKS], hashes, lease_id=found.lease_id)
    assert kv.client.wait(bad).status == Status.BLOCK_OUT_OF_RANGE
    # 2. The lease died with it: nothing stays pinned until the lease's expiry.
    assert engine.stats()["leases_active"] == 0
    assert kv.release(found.lease_id).status == Status.UNKNOWN_LEASE


def test_transfers_lease_of_one_vllm_instance_is_refused_to_another(engine, kv_client, rng, make_hashes):
    # 1. A scheduler of instance 7 looks up three stored blocks and holds their lease.
    saver = kv_client(engine)
    hashes = make_hashes(3)
    saver.fill(rng, range(3))
    assert saver.save(NAMESPACE, range(3), hashes).value == 3
    scheduler, other, worker = kv_client(engine, 7), kv_client(engine, 8), kv_client(engine, 7)
    lease = scheduler.client.lookup(NAMESPACE, hashes).lease_id
    # 2. A client of instance 8 (a buggy vLLM that kept a stale id) can neither release it
    #    nor load with it; the lease lives on.
    assert other.release(lease).status == Status.UNKNOWN_LEASE
    bad = other.client.submit_load(NAMESPACE, [0, 1, 2], hashes, lease_id=lease)
    assert other.client.wait(bad).status == Status.UNKNOWN_LEASE
    assert engine.stats()["leases_active"] == 1
    # 3. A worker of instance 7 loads with it (the scheduler-to-worker handoff), ending it.
    done = worker.client.wait(worker.client.submit_load(NAMESPACE, [3, 4, 5], hashes, lease_id=lease))
    assert done.is_ok and engine.stats()["leases_active"] == 0


def test_transfers_client_that_revoked_its_copies_gets_none_started(shared_engine, kv_client, rng,
                                                                   make_hashes):
    kv = kv_client(shared_engine)
    stored, hashes = make_hashes(1), make_hashes(2)
    kv.fill(rng, [0, 1, 2])
    assert kv.save(NAMESPACE, [2], stored).is_ok
    # 1. The client revokes its copies through its ring segment: a SAVE is refused...
    kv.client.revoke()
    assert kv.save(NAMESPACE, [0, 1], hashes).status == Status.BAD_ARGUMENT
    # 2. ...and so is a LOAD: it would overwrite blocks vLLM may have given to others.
    kv.pages[:, 3] = 0x77
    assert kv.load(NAMESPACE, [3], stored).status == Status.BAD_ARGUMENT
    assert (kv.pages[:, 3] == 0x77).all()
    # 3. Nothing new was stored; the client still answers pings (it is about to detach).
    assert kv.num_hits(NAMESPACE, hashes) == 0
    assert kv.client.ping() == 0


def test_transfers_full_pool_evicts_a_saved_chain_from_its_tail(engine_factory, kv_client, rng,
                                                                 make_hashes):
    # 1. A pool of 16 entries; a 16-block chain saved in one SAVE fills it.
    engine = engine_factory(pool_size="256KiB", slab_size="64KiB")
    kv = kv_client(engine)
    chain = make_hashes(16)
    kv.fill(rng, range(17))
    assert kv.save(NAMESPACE, range(16), chain).value == 16
    # 2. One more block evicts the chain's last block, not its first: 15 blocks still hit
    #    (a lookup stops at the first miss: without its head the chain would be lost whole).
    assert kv.save(NAMESPACE, [16], make_hashes(1)).value == 1
    assert kv.num_hits(NAMESPACE, chain) == 15
