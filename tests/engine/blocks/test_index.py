"""engine.blocks.index.BlockIndex on its own (no engine process): visibility, leases, eviction, dead clients.

The pool holds exactly CAPACITY entries of ENTRY_BYTES (one slab), so a reserve past that
must evict.  ``store`` plays a whole save: reserve, then every layer copied.
"""

from __future__ import annotations

import time

import pytest

from engine.blocks.index import BlockIndex
from engine.memory.pool import PagePool

NUM_LAYERS = 4
ALL_LAYERS = (1 << NUM_LAYERS) - 1
ENTRY_BYTES = NUM_LAYERS * 256
CAPACITY = 4
NAMESPACE = 7
SLOT, OTHER_SLOT = 1, 2
TTL_S = 60.0


def key(i: int) -> tuple[int, bytes]:
    return NAMESPACE, i.to_bytes(32, "little")


@pytest.fixture
def index() -> BlockIndex:
    return BlockIndex(PagePool(CAPACITY * ENTRY_BYTES, CAPACITY * ENTRY_BYTES), lease_ttl_s=TTL_S)


def begin(index: BlockIndex, i: int, slot: int = SLOT, pending: int = 0):
    """A save that has reserved its entry; ``pending`` layers have copies in flight."""
    entry = index.reserve(key(i), ENTRY_BYTES, NUM_LAYERS, slot)
    assert entry is not None
    entry.pending_mask |= pending
    return entry


def store(index: BlockIndex, i: int, slot: int = SLOT):
    """A whole save: reserve, start every layer's copy, finish them: the entry is READY."""
    begin(index, i, slot, pending=ALL_LAYERS)
    index.mark_layers_done([key(i)], ALL_LAYERS)
    assert index.get_ready(key(i)) is not None


def refs(index: BlockIndex, i: int) -> int:
    return index.entries[key(i)].refs


# -- visibility and lookup ------------------------------------------------------------------------


def test_index_lookup_pins_ready_prefix_only(index):
    # 1. Blocks 0, 1 and 3 stored; block 2 never was.
    for i in (0, 1, 3):
        store(index, i)
    # 2. A lookup of 0..3 hits the prefix 0, 1 and stops at the gap.
    num_hits, lease_id = index.lookup(SLOT, [key(i) for i in range(4)])
    assert num_hits == 2 and lease_id != 0
    # 3. Only the prefix is pinned, under that lease.
    assert [refs(index, i) for i in (0, 1, 3)] == [1, 1, 0]
    assert index.leases[lease_id].keys == [key(0), key(1)]


def test_index_lookup_writing_entries_invisible_until_every_layer_done(index):
    # 1. A save has reserved block 0 and copied three of four layers.
    begin(index, 0, pending=ALL_LAYERS)
    index.mark_layers_done([key(0)], 0b0111)
    # 2. Neither lookup nor get_ready sees it, and no lease is made.
    assert index.lookup(SLOT, [key(0)]) == (0, 0)
    assert index.get_ready(key(0)) is None and not index.leases
    # 3. The last layer lands: now it is visible.
    index.mark_layers_done([key(0)], 0b1000)
    assert index.lookup(SLOT, [key(0)])[0] == 1


def test_index_lookup_stops_at_writing_entry_in_the_middle(index):
    # 1. Block 0 and 2 stored, block 1 still being written.
    store(index, 0)
    begin(index, 1, pending=ALL_LAYERS)
    store(index, 2)
    # 2. The hit prefix ends before the WRITING block.
    assert index.lookup(SLOT, [key(0), key(1), key(2)])[0] == 1
    assert (refs(index, 1), refs(index, 2)) == (0, 0)


def test_index_lookup_miss_makes_no_lease(index):
    # 1. Nothing stored: no hits, lease id 0, nothing recorded.
    assert index.lookup(SLOT, [key(0), key(1)]) == (0, 0)
    assert not index.leases


# -- leases ---------------------------------------------------------------------------------------


def test_index_release_unpins_and_second_release_is_false(index):
    # 1. Two leases on the same block: two pins, two distinct ids.
    store(index, 0)
    _, first = index.lookup(SLOT, [key(0)])
    _, second = index.lookup(SLOT, [key(0)])
    assert first != second and refs(index, 0) == 2
    # 2. Releasing one drops one pin; releasing it again (or an unknown id) does nothing.
    assert index.release(first) is True
    assert refs(index, 0) == 1
    assert index.release(first) is False and index.release(12345) is False
    assert refs(index, 0) == 1
    # 3. The other lease releases the last pin.
    assert index.release(second) is True and refs(index, 0) == 0


def test_index_expire_leases_releases_only_past_their_ttl(index):
    # 1. A lease taken now.
    store(index, 0)
    _, lease_id = index.lookup(SLOT, [key(0)])
    # 2. Before its TTL nothing expires.
    assert index.expire_leases(time.monotonic()) == 0
    assert lease_id in index.leases and refs(index, 0) == 1
    # 3. After its TTL it is released and counted.
    assert index.expire_leases(time.monotonic() + TTL_S + 1) == 1
    assert lease_id not in index.leases and refs(index, 0) == 0
    assert index.counters.lease_expiries == 1
    # 4. An expired lease can no longer be released.
    assert index.release(lease_id) is False


# -- eviction -------------------------------------------------------------------------------------


def fill(index: BlockIndex) -> None:
    """Store blocks 0..CAPACITY-1 in order: 0 is the least recently used."""
    for i in range(CAPACITY):
        store(index, i)
    assert index.pool.try_alloc(ENTRY_BYTES) is None


def test_index_reserve_full_pool_evicts_least_recently_used(index):
    fill(index)
    # 1. A lookup (then release) of block 0 makes it the most recently used.
    _, lease_id = index.lookup(SLOT, [key(0)])
    index.release(lease_id)
    # 2. A new block evicts block 1, the least recently used, and takes its place.
    evicted_offset = index.entries[key(1)].offset
    entry = index.reserve(key(100), ENTRY_BYTES, NUM_LAYERS, SLOT)
    assert entry is not None and entry.offset == evicted_offset
    assert key(1) not in index.entries
    assert all(key(i) in index.entries for i in (0, 2, 3))
    assert index.counters.evictions == 1
    # 3. The next one evicts block 2: LRU order.
    store(index, 101)
    assert key(2) not in index.entries and key(0) in index.entries


def test_index_reserve_full_pool_skips_leased_entries(index):
    fill(index)
    # 1. A lease pins blocks 0 and 1, the two least recently used (it also touches them).
    index.lookup(OTHER_SLOT, [key(0), key(1)])
    # 2. Two new blocks evict 2 and 3 instead.
    store(index, 100)
    store(index, 101)
    assert key(0) in index.entries and key(1) in index.entries
    assert key(2) not in index.entries and key(3) not in index.entries


def test_index_reserve_full_pool_skips_pinned_even_if_least_recently_used(index):
    fill(index)
    # 1. An in-flight load pins block 0 (pin does not change the LRU order).
    index.pin([key(0)])
    # 2. A new block evicts block 1, not the pinned block 0.
    store(index, 100)
    assert key(0) in index.entries and key(1) not in index.entries
    # 3. Once unpinned, block 0 is the first to go.
    index.unpin([key(0)])
    store(index, 101)
    assert key(0) not in index.entries


def test_index_reserve_full_pool_skips_writing_entries(index):
    # 1. Block 0 is reserved first but still being written; 1..3 are stored after it.
    begin(index, 0, pending=ALL_LAYERS)
    for i in range(1, CAPACITY):
        store(index, i)
    # 2. A new block evicts block 1; the half-written block 0 is not a candidate.
    store(index, 100)
    assert key(0) in index.entries and key(1) not in index.entries


def test_index_reserve_nothing_evictable_returns_none_and_keeps_everything(index):
    fill(index)
    # 1. Every stored block is leased.
    index.lookup(OTHER_SLOT, [key(i) for i in range(CAPACITY)])
    # 2. A new block cannot be placed: None, nothing evicted, nothing recorded for it.
    assert index.reserve(key(100), ENTRY_BYTES, NUM_LAYERS, SLOT) is None
    assert key(100) not in index.entries
    assert all(key(i) in index.entries for i in range(CAPACITY))
    assert index.counters.evictions == 0


def test_index_reserve_existing_key_same_entry_other_size_none(index):
    # 1. A block being written is reserved again (a second save of the same hash).
    entry = begin(index, 0)
    assert index.reserve(key(0), ENTRY_BYTES, NUM_LAYERS, OTHER_SLOT) is entry
    # 2. The same hash with another geometry gets nothing (no second entry).
    assert index.reserve(key(0), 2 * ENTRY_BYTES, 2 * NUM_LAYERS, OTHER_SLOT) is None
    assert index.pool.num_entries == 1


# -- failed copies and dead clients ---------------------------------------------------------------


def test_index_abandon_layers_nothing_done_drops_entry_and_frees_page(index):
    # 1. A save's only copy failed before any layer landed.
    begin(index, 0, pending=ALL_LAYERS)
    index.abandon_layers(key(0), ALL_LAYERS)
    # 2. The entry is gone and its memory is back in the pool.
    assert key(0) not in index.entries and index.pool.num_entries == 0


def test_index_abandon_layers_some_done_keeps_entry_writing(index):
    # 1. Layer 0 landed, the copy of layers 1..3 failed.
    begin(index, 0, pending=ALL_LAYERS)
    index.mark_layers_done([key(0)], 0b0001)
    index.abandon_layers(key(0), 0b1110)
    # 2. The entry stays, WRITING, waiting for the missing layers.
    assert key(0) in index.entries and index.get_ready(key(0)) is None
    assert index.entries[key(0)].pending_mask == 0


def test_index_release_slot_drops_leases_and_half_written_entries_of_that_slot_only(index):
    store(index, 0)
    store(index, 1)
    # 1. SLOT leases block 0 and has block 2 half written; OTHER_SLOT leases block 1 and has
    #    block 3 half written.
    _, dead_lease = index.lookup(SLOT, [key(0)])
    _, live_lease = index.lookup(OTHER_SLOT, [key(1)])
    begin(index, 2, slot=SLOT)
    index.mark_layers_done([key(2)], 0b0001)
    begin(index, 3, slot=OTHER_SLOT)
    # 2. SLOT's client goes away.
    index.release_slot(SLOT)
    # 3. Its lease is over and its half-written block is gone, memory freed.
    assert dead_lease not in index.leases and refs(index, 0) == 0
    assert key(2) not in index.entries
    assert index.pool.num_entries == 3
    # 4. The other client's lease and half-written block, and every READY block, stay.
    assert live_lease in index.leases and refs(index, 1) == 1
    assert key(3) in index.entries
    assert index.get_ready(key(0)) is not None and index.get_ready(key(1)) is not None


def test_index_release_slot_keeps_entry_whose_copy_is_in_flight(index):
    # 1. SLOT's save of block 0 still has a copy in flight (into pool memory).
    begin(index, 0, slot=SLOT, pending=ALL_LAYERS)
    # 2. The client goes away: the entry must not be freed under the running copy.
    index.release_slot(SLOT)
    assert key(0) in index.entries
    # 3. The copy finishes every layer: a complete, usable block.
    index.mark_layers_done([key(0)], ALL_LAYERS)
    assert index.get_ready(key(0)) is not None


def test_index_release_slot_then_partial_copy_lands_entry_not_leaked(index):
    # 1. A layerwise save: SLOT's copy of layer 0 of block 0 is in flight; layers 1..3 were
    #    never sent.
    begin(index, 0, slot=SLOT, pending=0b0001)
    # 2. The client detaches before the copy is done; the entry stays for the copy.
    index.release_slot(SLOT)
    # 3. The copy lands.  Nobody will ever send layers 1..3: the half-written entry must go
    #    (it is invisible to lookups and no eviction candidate, so kept it would leak its page).
    index.mark_layers_done([key(0)], 0b0001)
    assert key(0) not in index.entries
    assert index.pool.num_entries == 0


def test_index_lease_ids_of_two_engines_do_not_collide():
    # 1. Two indexes (an engine and its restarted successor) hand out their first leases.
    first = BlockIndex(PagePool(CAPACITY * ENTRY_BYTES, CAPACITY * ENTRY_BYTES), lease_ttl_s=TTL_S)
    second = BlockIndex(PagePool(CAPACITY * ENTRY_BYTES, CAPACITY * ENTRY_BYTES), lease_ttl_s=TTL_S)
    for index in (first, second):
        store(index, 0)
    _, old_lease = first.lookup(SLOT, [key(0)])
    _, new_lease = second.lookup(SLOT, [key(0)])
    # 2. A lease id kept from the first names nothing in the second: releasing it there
    #    leaves the second's own lease (and its pin) alone.
    assert old_lease != new_lease
    assert second.release(old_lease) is False and refs(second, 0) == 1


def test_index_chain_looked_up_is_evicted_from_its_tail(index):
    # 1. A chain of 4 blocks stored head first (0 is then the least recently used), and
    #    looked up: the lookup makes its head the most recently used.
    fill(index)
    chain = [key(i) for i in range(CAPACITY)]
    _, lease_id = index.lookup(SLOT, chain)
    index.release(lease_id)
    # 2. A new block evicts the chain's tail, not its head: 3 of 4 blocks still hit.
    store(index, 100)
    assert key(CAPACITY - 1) not in index.entries
    assert index.lookup(SLOT, chain)[0] == CAPACITY - 1


def test_index_touch_chain_after_a_save_keeps_the_head_longest(index):
    # A SAVE's blocks become READY head first; once the whole SAVE is done it touches
    # its chain, so the next eviction takes the tail.
    fill(index)
    index.touch_chain([key(i) for i in range(CAPACITY)])
    store(index, 100)
    assert key(0) in index.entries and key(CAPACITY - 1) not in index.entries


def test_index_drop_of_a_block_being_written_goes_when_its_copy_ends(index):
    # 1. A block whose copy is in flight, and a stored one; both dropped.
    begin(index, 1, pending=ALL_LAYERS)
    begin(index, 2, pending=ALL_LAYERS)
    index.mark_layers_done([key(2)], ALL_LAYERS)
    assert index.drop([key(1), key(2)], writer=0, since_command=0) == 2
    # 2. The stored one is gone at once; the other stays until its copy ends, never READY.
    assert key(2) not in index.entries and index.entries[key(1)].is_doomed
    assert index.drop([key(1)], writer=0, since_command=0) == 0  # doomed already: not again
    assert index.mark_layers_done([key(1)], ALL_LAYERS) == 0
    assert key(1) not in index.entries and index.pool.num_entries == 0
    # 3. A copy that fails instead frees it too.
    begin(index, 3, pending=ALL_LAYERS)
    index.drop([key(3)], writer=0, since_command=0)
    index.abandon_layers(key(3), ALL_LAYERS)
    assert key(3) not in index.entries and index.pool.num_entries == 0


def test_index_drop_takes_only_what_that_client_wrote_since_that_request(index):
    # 1. Client 5's SAVEs 10 and 12 wrote blocks 1 and 2; client 6 wrote block 3.
    for i, writer in ((1, (5, 10)), (2, (5, 12)), (3, (6, 11))):
        index.reserve_many([key(i)], ENTRY_BYTES, NUM_LAYERS, SLOT, writer)
    index.mark_layers_done([key(1), key(2), key(3)], ALL_LAYERS)
    # 2. Client 5 drops all three from request 11 on: only block 2 goes (block 1 is older,
    #    block 3 is another client's, which client 5's save only deduplicated).
    assert index.drop([key(1), key(2), key(3)], writer=5, since_command=11) == 1
    assert set(index.entries) == {key(1), key(3)}


# -- a LOAD taking over its lookup's lease ------------------------------------------------------------


def _leased(index: BlockIndex, n: int = CAPACITY) -> int:
    for i in range(n):
        store(index, i)
    num_hits, lease_id = index.lookup(SLOT, [key(i) for i in range(n)])
    assert num_hits == n and all(refs(index, i) == 1 for i in range(n))
    return lease_id


def test_index_take_lease_whole_passes_its_pins_and_offsets(index):
    lease_id = _leased(index)
    keys = [key(i) for i in range(CAPACITY)]
    offsets = index.take_lease(lease_id, keys, ENTRY_BYTES)
    # The offsets of exactly those entries; the lease is gone (no RELEASE or expiry can
    # touch it), its pins now the caller's: one ref each until the caller unpins.
    assert offsets.tolist() == [index.entries[k].offset for k in keys]
    assert lease_id not in index.leases and not index.release(lease_id)
    assert [refs(index, i) for i in range(CAPACITY)] == [1] * CAPACITY
    index.unpin(keys)
    assert [refs(index, i) for i in range(CAPACITY)] == [0] * CAPACITY


def test_index_take_lease_run_inside_it_unpins_the_rest(index):
    lease_id = _leased(index)
    offsets = index.take_lease(lease_id, [key(1), key(2)], ENTRY_BYTES)
    assert offsets.tolist() == [index.entries[key(i)].offset for i in (1, 2)]
    assert [refs(index, i) for i in range(CAPACITY)] == [0, 1, 1, 0]


@pytest.mark.parametrize("keys,entry_bytes", [
    ([1, 3], ENTRY_BYTES),            # not a run of its keys
    ([2, 1], ENTRY_BYTES),            # out of order
    ([3, 4], ENTRY_BYTES),            # runs past its end
    ([9], ENTRY_BYTES),               # not in it
    ([], ENTRY_BYTES),                # nothing
    ([0, 1], ENTRY_BYTES // 2),       # another geometry
], ids=["gap", "order", "past-end", "absent", "empty", "geometry"])
def test_index_take_lease_refuses_what_it_does_not_hold_and_keeps_it(index, keys, entry_bytes):
    lease_id = _leased(index)
    assert index.take_lease(lease_id, [key(i) for i in keys], entry_bytes) is None
    assert lease_id in index.leases and [refs(index, i) for i in range(CAPACITY)] == [1] * CAPACITY
    assert index.take_lease(lease_id + 1, [key(0)], ENTRY_BYTES) is None  # no such lease


def test_index_take_lease_refused_once_a_drop_doomed_a_block(index):
    # 1. Blocks leased, then one dropped while the lease holds it: doomed, not served again.
    lease_id = _leased(index)
    index.entries[key(2)].writer = (5, 1)
    assert index.drop([key(2)], 5, 0) == 1 and index.entries[key(2)].is_doomed
    # 2. The lease no longer vouches for its blocks: the LOAD must look them up (and miss).
    assert index.take_lease(lease_id, [key(i) for i in range(CAPACITY)], ENTRY_BYTES) is None
    assert index.get_ready(key(2)) is None


def test_index_lease_ids_cannot_be_guessed_from_one_another(index):
    # A client that saw its own lease id must not be able to name another's: 200 leases of
    # one block, ids all distinct, none the successor or predecessor of another.
    store(index, 0)
    ids = [index.lookup(SLOT, [key(0)])[1] for _ in range(200)]
    assert len(set(ids)) == 200 and 0 not in ids
    taken = set(ids)
    assert not any(i + 1 in taken or i - 1 in taken for i in ids)
