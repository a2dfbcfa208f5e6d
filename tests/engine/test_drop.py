"""DROP: a client has the engine forget blocks it stored from data it found bad since; a
block in use (leased, loading, being written) is never served again and goes when freed."""

from __future__ import annotations

import numpy as np

from pegaflow.platform.wire import Opcode, Status
from tests.engine.conftest import random_hashes


def _stored(kv, rng, ids, namespace: int = 3):
    return kv.store(rng, namespace, ids)[0]


def test_drop_forgets_stored_blocks_and_leaves_others(engine, kv_client, rng):
    kv = kv_client(engine)
    kept, dropped = _stored(kv, rng, [1, 2]), _stored(kv, rng, [3, 4])
    # 1. DROP two stored blocks and one never stored: two were held.
    done = kv.client.wait(kv.client.submit_drop(3, dropped + random_hashes(rng, 1)))
    assert done.is_ok and done.value == 2
    # 2. They miss; the others still hit; a LOAD of a dropped one fails and changes nothing.
    assert kv.num_hits(3, dropped) == 0 and kv.num_hits(3, kept) == 2
    before = kv.pages[:, [9]].copy()
    assert not kv.load(3, [9], dropped[:1]).is_ok
    assert np.array_equal(kv.pages[:, [9]], before)
    # 3. Their pool space is free again: the pool's gauge counts only the kept ones.
    engine.wait_stats(lambda s: s["pool_blocks_used"] == 2)


def test_drop_of_a_leased_block_hides_it_now_and_frees_it_at_release(engine, kv_client, rng):
    kv = kv_client(engine)
    hashes = _stored(kv, rng, [5, 6])
    # 1. A lease pins both; then they are dropped.
    lease = kv.client.lookup(3, hashes)
    assert lease.num_hit_blocks == 2
    assert kv.client.wait(kv.client.submit_drop(3, hashes)).value == 2
    # 2. Never served again, though still pinned...
    assert kv.num_hits(3, hashes) == 0
    engine.wait_stats(lambda s: s["pool_blocks_used"] == 2)
    # 3. A save of them meanwhile stores nothing, and says so (dropped, not deduplicated)...
    kv.fill(rng, [5, 6])
    answer = kv.save(3, [5, 6], hashes)
    assert (answer.value2, answer.value3) == (0, 2)
    # 4. ...and they are gone once the lease ends; saving them again stores them afresh.
    assert kv.release(lease.lease_id).is_ok
    engine.wait_stats(lambda s: s["pool_blocks_used"] == 0)
    kv.fill(rng, [5, 6])
    assert kv.save(3, [5, 6], hashes).is_ok and kv.num_hits(3, hashes) == 2


def test_drop_of_other_namespace_or_bad_payload(engine, kv_client, rng):
    kv = kv_client(engine)
    hashes = _stored(kv, rng, [7])
    # 1. Another namespace holds nothing of them.
    assert kv.client.wait(kv.client.submit_drop(4, hashes)).value == 0
    assert kv.num_hits(3, hashes) == 1
    # 2. A payload that is not num_items hash records is refused, changing nothing.
    command_id = kv.submit_raw(opcode=Opcode.DROP, num_items=2, namespace=3)
    assert int(kv.take_raw(command_id)["status"]) == Status.BAD_PAYLOAD
    assert kv.num_hits(3, hashes) == 1


def test_drop_leaves_blocks_another_client_stored_or_saved_before_since(engine, kv_client, rng):
    first, second = kv_client(engine), kv_client(engine)
    theirs = _stored(first, rng, [1, 2])
    # 1. The second client saves the same blocks (deduplicated: the first client's stay),
    #    then a block of its own.
    second.fill(rng, [1, 2])
    assert second.save(3, [1, 2], theirs).value2 == 2  # both deduplicated
    own = random_hashes(rng, 1)
    second.fill(rng, [5])
    command_id = second.client.submit_save(3, [5], own)
    assert second.client.wait(command_id).is_ok
    # 2. Its DROP of everything it sent takes only its own block.
    done = second.client.wait(second.client.submit_drop(3, theirs + own))
    assert done.value == 1
    assert second.num_hits(3, theirs) == 2 and second.num_hits(3, own) == 0
    # 3. A DROP from a request after the SAVE that stored a block leaves it.
    kept = _stored(first, rng, [6])
    assert first.client.wait(first.client.submit_drop(3, kept, since_command=1 << 40)).value == 0
    assert first.num_hits(3, kept) == 1
