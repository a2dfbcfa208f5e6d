"""engine/memory/pool_table.py: the pool's slot table says what every pool entry holds, in step
with the index, so the pool's contents can be found without the engine's memory."""

from __future__ import annotations

import logging

import numpy as np

from engine.blocks.index import BlockIndex
from engine.memory.pool import PagePool
from engine.memory.pool_table import PoolTable, read_ready, records_per_slab, table_bytes
from pegaflow.platform import shm
from pegaflow.platform.pool_layout import POOL_RECORD, POOL_TABLE_HEADER, EntryState
from pegaflow.platform.wire import MAGIC, encode_hashes, hash_keys
from tests.engine.conftest import KVClient, random_hashes

SLAB = 1 << 20
NUM_LAYERS = 4
ENTRY = NUM_LAYERS * 4096  # 64 entries per slab
ALL = (1 << NUM_LAYERS) - 1


def _index(num_slabs: int = 4) -> BlockIndex:
    pool_bytes = num_slabs * SLAB
    table = PoolTable.private(pool_bytes, SLAB)
    return BlockIndex(PagePool(pool_bytes, SLAB, table.records_per_slab), 60.0, table)


def _keys(rng, count: int, namespace: int = 7) -> list[tuple[int, bytes]]:
    return [(namespace, k) for k in hash_keys(encode_hashes(random_hashes(rng, count)))]


def _ready_in_index(index: BlockIndex) -> dict:
    return {k: (e.offset, e.entry_bytes, e.all_layers_mask.bit_length())
            for k, e in index.entries.items() if e.is_ready}


def test_pool_table_records_follow_an_entry_from_reserve_to_ready_to_free():
    rng = np.random.default_rng(0)
    index = _index()
    keys = _keys(rng, 3)
    # 1. Reserved: WRITING, with its key, namespace, offset and size.
    entries = index.reserve_many(keys, ENTRY, NUM_LAYERS, slot=0)
    records = index.table.records
    at = [e.offset // SLAB * index.table.records_per_slab + e.offset % SLAB // ENTRY for e in entries]
    assert (records["state"][at] == EntryState.WRITING).all()
    assert [bytes(k) for k in records["key"][at]] == [k for _, k in keys]
    assert list(records["namespace"][at]) == [7, 7, 7]
    assert list(records["offset"][at]) == [e.offset for e in entries]
    assert (records["entry_bytes"][at] == ENTRY).all()
    # 2. Some layers copied: still WRITING; every layer: READY.
    index.mark_layers_done(keys, 0b0011)
    assert read_ready(records) == {}
    index.mark_layers_done(keys, ALL)
    assert read_ready(records) == _ready_in_index(index)
    assert len(read_ready(records)) == 3
    # 3. Dropped (a failed save abandons a WRITING one; eviction drops READY ones): FREE.
    index.drop_entry(keys[0])
    assert read_ready(records) == _ready_in_index(index) and len(read_ready(records)) == 2


def test_pool_table_matches_the_index_through_saves_evictions_and_stale_writes():
    # 1. Far more blocks than the pool holds, saved in chunks; some chunks never complete.
    rng = np.random.default_rng(1)
    index = _index(num_slabs=2)  # 128 entries
    for step in range(40):
        keys = _keys(rng, int(rng.integers(1, 30)), namespace=int(rng.integers(0, 3)))
        entries = index.reserve_many(keys, ENTRY, NUM_LAYERS, slot=0)
        kept = [k for k, e in zip(keys, entries) if e is not None]
        if step % 5 == 4:
            index.mark_layers_done(kept, 0b0001)   # left half written
        else:
            index.mark_layers_done(kept, ALL)
        if step % 10 == 9:
            index.drop_stale_writes(older_than=float("inf"))
        # 2. After every step the table's READY records are exactly the index's READY entries,
        #    and no two records claim one pool place.
        assert read_ready(index.table.records) == _ready_in_index(index)
    assert index.counters.evictions > 0
    live = index.table.records[index.table.records["state"] != EntryState.FREE]
    assert len(set(live["offset"].tolist())) == len(live) == len(index.entries)


def test_pool_table_caps_a_slab_of_small_entries_at_its_records(caplog):
    # 1. A pool whose table has 256 records per slab, and 1 KiB entries (1024 would fit).
    assert records_per_slab(4 * SLAB, SLAB) == 256
    table = PoolTable.private(4 * SLAB, SLAB)
    pool = PagePool(4 * SLAB, SLAB, table.records_per_slab)
    # 2. A slab takes 256 of them (and says so once); every offset has its own record.
    with caplog.at_level(logging.WARNING, logger="engine.memory.pool"):
        offsets = pool.alloc_many(1024, 300)
    assert len(offsets) == 300 and len({o // SLAB for o in offsets}) == 2
    assert sum(o // SLAB == offsets[0] // SLAB for o in offsets) == 256
    assert "holds 256 of them" in caplog.text


def test_pool_table_header_and_size():
    table = PoolTable.private(64 * SLAB, SLAB)
    header = table.header[0]
    assert (int(header["magic"]), int(header["pool_bytes"]), int(header["slab_bytes"])) == \
        (MAGIC, 64 * SLAB, SLAB)
    assert int(header["num_records"]) == 64 * 256 == len(table.records)
    assert table_bytes(64 * SLAB, SLAB) == POOL_TABLE_HEADER.itemsize + 64 * 256 * POOL_RECORD.itemsize
    assert table_bytes(64 << 30, 64 << 20) <= (64 << 30) // 56  # under 1/56 of the pool


def test_engine_pool_table_finds_saved_blocks_without_the_engine(engine_factory, kv_client, rng):
    # 1. A real engine (keeping its pool, so it keeps a table) stores 5 blocks of random bytes.
    engine = engine_factory(extra=("--keep-pool",))
    ids = [3, 9, 17, 40, 63]
    hashes, saved = kv_client(engine).store(rng, 11, ids)
    # 2. This process maps the pool and its table, as a restarted engine could.
    table_segment = shm.attach_segment(shm.ipc_name(engine.name, "pool.table"), readonly=True)
    pool_segment = shm.attach_segment(shm.ipc_name(engine.name, "pool"), readonly=True)
    try:
        header = table_segment.array(POOL_TABLE_HEADER, 1)[0]
        records = table_segment.array(POOL_RECORD, int(header["num_records"]), POOL_TABLE_HEADER.itemsize)
        found = read_ready(records)
        # 3. Every saved block is READY there, and its bytes are the saved ones, layer by layer.
        pool = pool_segment.array(np.uint8, pool_segment.size)
        for i, key in enumerate(hash_keys(encode_hashes(hashes))):
            offset, entry_bytes, num_layers = found[(11, key)]
            assert (entry_bytes, num_layers) == (KVClient.ENTRY_BYTES, KVClient.NUM_LAYERS)
            entry = pool[offset:offset + entry_bytes].reshape(KVClient.NUM_LAYERS, KVClient.PAGE_BYTES)
            assert np.array_equal(entry, saved[:, i])
        del header, records, pool, entry
    finally:
        table_segment.close()
        pool_segment.close()
    # 4. (teardown) an engine that does not keep pools removes the kept one.
    assert engine.stop() == 0
    engine_factory(engine.name)


def test_pool_table_kept_ready_entries_are_taken_in_and_nothing_else():
    # 1. An index stores 40 blocks and leaves 10 more half written.
    rng = np.random.default_rng(2)
    first = _index(num_slabs=2)
    ready, half = _keys(rng, 40), _keys(rng, 10)
    first.reserve_many(ready + half, ENTRY, NUM_LAYERS, slot=0)
    first.mark_layers_done(ready, ALL)
    first.mark_layers_done(half, 0b0001)
    buffer = first.table.records.base  # the table's memory, as a kept segment would hold it
    # 2. A new index over the same table takes in exactly the READY blocks, where they were.
    table = PoolTable(buffer, 2 * SLAB, SLAB, keep=True)
    second = BlockIndex(PagePool(2 * SLAB, SLAB, table.records_per_slab), 60.0, table)
    assert second.adopt_table() == 40
    assert {k: (e.offset, e.entry_bytes) for k, e in second.entries.items()} == \
        {k: (first.entries[k].offset, ENTRY) for k in ready}
    assert all(second.entries[k].is_ready for k in ready)
    assert read_ready(table.records) == _ready_in_index(second)
    assert (table.records["state"] == EntryState.WRITING).sum() == 0
    # 3. The pool hands out only the other places: the remaining 88 entries, none reused.
    fresh = second.pool.alloc_many(ENTRY, 200)
    assert len(fresh) == 2 * SLAB // ENTRY - 40
    assert not set(fresh) & {e.offset for e in second.entries.values()}


def test_pool_table_of_another_geometry_starts_empty():
    first = _index(num_slabs=2)
    first.reserve_many(_keys(np.random.default_rng(3), 5), ENTRY, NUM_LAYERS, slot=0)
    buffer = first.table.records.base
    assert PoolTable.mismatch(buffer, 2 * SLAB, SLAB) is None
    assert "slabs" in PoolTable.mismatch(buffer, 2 * SLAB, SLAB // 2)
    table = PoolTable(buffer, 2 * SLAB, SLAB // 2, keep=True)  # as many records, read anew
    assert (table.records["state"] == EntryState.FREE).all()


def test_pool_table_full_slab_taken_in_then_evicted_from():
    # 1. A kept pool whose one slab is full of blocks of one size; the other slab is free.
    rng = np.random.default_rng(4)
    first = _index(num_slabs=2)
    full = _keys(rng, SLAB // ENTRY)
    first.reserve_many(full, ENTRY, NUM_LAYERS, slot=0)
    first.mark_layers_done(full, ALL)
    table = PoolTable(first.table.records.base, 2 * SLAB, SLAB, keep=True)
    second = BlockIndex(PagePool(2 * SLAB, SLAB, table.records_per_slab), 60.0, table)
    assert second.adopt_table() == SLAB // ENTRY
    # 2. Blocks of another size fill the free slab, then evict the kept ones: no error, and
    #    the freed slab serves the new size.
    other = _keys(rng, SLAB // (2 * ENTRY) + 16, namespace=9)  # a slab and a half of them
    placed = [e for e in second.reserve_many(other, 2 * ENTRY, 2 * NUM_LAYERS, slot=0) if e]
    assert len(placed) == len(other) and second.counters.evictions == SLAB // ENTRY
    assert read_ready(table.records) == _ready_in_index(second)


def test_pool_table_records_out_of_place_or_empty_are_not_taken_in():
    rng = np.random.default_rng(5)
    first = _index(num_slabs=2)
    keys = _keys(rng, 6)
    entries = first.reserve_many(keys, ENTRY, NUM_LAYERS, slot=0)
    first.mark_layers_done(keys, ALL)
    records = first.table.records
    at = [e.offset // SLAB * first.table.records_per_slab + e.offset % SLAB // ENTRY for e in entries]
    records["offset"][at[0]] += ENTRY      # says it is somewhere else than its place
    records["num_layers"][at[1]] = 0       # a block of no layers
    records["entry_bytes"][at[2]] = 0      # no size
    table = PoolTable(records.base, 2 * SLAB, SLAB, keep=True)
    second = BlockIndex(PagePool(2 * SLAB, SLAB, table.records_per_slab), 60.0, table)
    # 1. Only the three sound records are taken in; the pool holds exactly those.
    assert second.adopt_table() == 3
    assert set(second.entries) == set(keys[3:])
    assert second.pool.num_entries == 3
    assert read_ready(table.records) == _ready_in_index(second)


def test_pool_table_kept_blocks_keep_their_eviction_order():
    # 1. Two chains saved, then the first one used again (a lookup): it is the more recent.
    rng = np.random.default_rng(6)
    first = _index()
    a, b = _keys(rng, 3), _keys(rng, 3)
    for chain in (a, b):
        first.reserve_many(chain, ENTRY, NUM_LAYERS, slot=0)
        first.mark_layers_done(chain, ALL)
        first.touch_chain(chain)
    first.touch_chain(a)
    # 2. A new index over the kept table evicts in the same order: b's tail first, a's head last.
    table = PoolTable(first.table.records.base, 4 * SLAB, SLAB, keep=True)
    second = BlockIndex(PagePool(4 * SLAB, SLAB, table.records_per_slab), 60.0, table)
    second.adopt_table()
    assert list(second.policy._order) == list(first.policy._order) == b[::-1] + a[::-1]
    # 3. Its own touches come after the kept ones.
    second.touch_chain(b[:1])
    assert list(second.policy._order)[-1] == b[0]
    assert read_ready(table.records).popitem()[0] == b[0]


def test_pool_table_a_dropped_block_still_in_use_is_not_listed():
    # 1. A stored block is leased, then dropped: still in the pool, never served.
    index = _index()
    keys = _keys(np.random.default_rng(7), 2)
    index.reserve_many(keys, ENTRY, NUM_LAYERS, slot=0)
    index.mark_layers_done(keys, ALL)
    _, lease = index.lookup(0, keys)
    assert index.drop(keys[:1], writer=0, since_command=0) == 1
    # 2. The table already lists only the other one (a kept pool would not bring it back).
    assert list(read_ready(index.table.records)) == keys[1:]
    index.release(lease)
    assert list(read_ready(index.table.records)) == keys[1:] and keys[0] not in index.entries


def test_pool_table_kept_entries_beyond_the_ready_part_are_served_once_it_grows():
    # 1. A kept pool: 40 blocks in slab 0, 20 in slab 1 (64 entries fill a slab).
    rng = np.random.default_rng(7)
    first = _index(num_slabs=2)
    near, far = _keys(rng, 64), _keys(rng, 20)
    first.reserve_many(near + far, ENTRY, NUM_LAYERS, slot=0)
    first.mark_layers_done(near + far, ALL)
    first.touch_chain(near)
    first.touch_chain(far)  # the more recently used of the two chains
    first.drop_entry(near[0])  # a free slot in slab 0
    table = PoolTable(first.table.records.base, 2 * SLAB, SLAB, keep=True)
    # 2. A new engine has pinned only slab 0: every block is taken in, those in slab 1 are
    #    not found (not looked up, not loaded) until it is pinned.
    second = BlockIndex(PagePool(2 * SLAB, SLAB, table.records_per_slab, ready_bytes=SLAB),
                        60.0, table)
    assert second.adopt_table() == 63 + 20
    assert second.lookup(0, near[1:4])[0] == 3
    assert second.lookup(0, far)[0] == 0 and second.get_ready(far[0]) is None
    # 3. Meanwhile one of them is saved again: it goes to slab 0 (the free slot), not slab 1.
    again = second.reserve_many(far[:1], ENTRY, NUM_LAYERS, slot=0)[0]
    assert again.offset < SLAB
    second.mark_layers_done(far[:1], ALL)
    # 4. Slab 1 pinned: the other 19 are served where they were; the one saved again keeps
    #    its new entry, and its old place is free (in the pool and the table).
    assert second.grow(2 * SLAB) == 19
    # 5. They rank below every block taken in before them, in their own order (a chain's
    #    tail first).
    assert list(second.policy._order)[:19] == far[1:][::-1]
    assert second.lookup(0, far)[0] == 20
    assert {k: second.entries[k].offset for k in far[1:]} == {k: first.entries[k].offset for k in far[1:]}
    assert second.entries[far[0]].offset == again.offset
    assert read_ready(table.records) == _ready_in_index(second)
    assert second.pool.num_entries == 63 + 20
