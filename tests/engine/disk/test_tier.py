"""engine.disk.tier.DiskTier with a real DiskStore and BlockIndex (no engine process):
blocks being written to disk are never evicted from the pool, evicted blocks come back from
disk into the pool byte for byte, and a block read back bad is never served."""

from __future__ import annotations

import time

import numpy as np
import pytest

from engine.blocks.index import BlockIndex
from engine.disk.store import DiskStore
from engine.disk.tier import DiskTier
from engine.memory.pool import PagePool
from engine.stats import StatsWriter
from pegaflow.platform.wire import STATS

NUM_LAYERS = 4
ENTRY_BYTES = 4 * 4096
CAPACITY = 4
SLOT = 1


def key(i: int) -> tuple[int, bytes]:
    return 7, i.to_bytes(32, "little") + bytes([32])


@pytest.fixture
def tier(tmp_path):
    pool_bytes = CAPACITY * ENTRY_BYTES
    index = BlockIndex(PagePool(pool_bytes, pool_bytes), lease_ttl_s=60.0)
    store = DiskStore([tmp_path], 1 << 20, num_threads=2)
    memory = np.zeros(pool_bytes, np.uint8)
    tier = DiskTier(store, index, memory, StatsWriter(np.zeros(1, STATS)))
    yield tier
    tier.close()


def _store(tier: DiskTier, i: int) -> np.ndarray:
    """A saved block: reserved, its bytes written into the pool, every layer done."""
    entry = tier.index.reserve(key(i), ENTRY_BYTES, NUM_LAYERS, SLOT)
    page = tier.pool[entry.offset:entry.offset + ENTRY_BYTES]
    page[:] = np.random.default_rng(i).integers(0, 256, ENTRY_BYTES, dtype=np.uint8)
    tier.index.mark_layers_done([key(i)], (1 << NUM_LAYERS) - 1)
    return page.copy()


def _on_disk_only(tier: DiskTier, i: int) -> np.ndarray:
    """Block ``i`` saved, written to disk, then pushed out of the pool by CAPACITY others."""
    saved = _store(tier, i)
    tier.spill()
    _settle(tier)
    for j in range(10, 10 + CAPACITY):
        _store(tier, j)
    assert key(i) not in tier.index.entries and tier.store.contains(key(i))
    return saved


def _settle(tier: DiskTier) -> None:
    deadline = time.monotonic() + 10
    while tier.num_inflight:
        tier.poll()
        assert time.monotonic() < deadline, "disk I/O did not finish"
        time.sleep(1e-3)


def test_tier_block_being_written_is_never_evicted_from_the_pool(tier):
    # 1. A full pool of READY blocks; a spill pass starts writing all of them (pinned).
    for i in range(CAPACITY):
        _store(tier, i)
    assert tier.spill() == CAPACITY
    # 2. A new block finds no room: every block is in use by a write, none is evicted.
    assert tier.index.reserve(key(99), ENTRY_BYTES, NUM_LAYERS, SLOT) is None
    assert all(key(i) in tier.index.entries for i in range(CAPACITY))
    # 3. Once the writes are over, the disk holds them and the pool may evict again.
    _settle(tier)
    assert all(tier.store.contains(key(i)) for i in range(CAPACITY))
    assert tier.index.reserve(key(99), ENTRY_BYTES, NUM_LAYERS, SLOT) is not None


def test_tier_evicted_block_comes_back_from_disk_exact_and_is_pinned_while_read(tier):
    # 1. Four blocks written to disk, then evicted from the pool by four others.
    saved = [_store(tier, i) for i in range(CAPACITY)]
    tier.spill()
    _settle(tier)
    for i in range(10, 10 + CAPACITY):
        _store(tier, i)
    assert not any(key(i) in tier.index.entries for i in range(CAPACITY))
    # 2. A lookup's prefix goes on through the disk: entries reserved, reads started, pinned.
    num_hits, lease_id = tier.index.lookup(SLOT, [key(i) for i in range(CAPACITY)])
    lease = tier.index.leases[lease_id]
    assert num_hits == CAPACITY and lease.num_disk == CAPACITY
    assert tier.index.is_promoting(lease_id) and all(e.refs == 1 for e in lease.entries)
    # 3. Read back, they are READY with the bytes saved.
    _settle(tier)
    assert not tier.index.is_promoting(lease_id)
    for i, entry in enumerate(lease.entries):
        assert entry.is_ready
        assert np.array_equal(tier.pool[entry.offset:entry.offset + ENTRY_BYTES], saved[i])


def test_tier_block_read_back_corrupt_is_never_ready(tier, tmp_path):
    # 1. One block on disk, evicted from the pool, one byte of its file flipped.
    _on_disk_only(tier, 0)
    path = next(tmp_path.rglob("*.blk"))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    # 2. The lookup leases it (the header is fine); the read finds the damage.
    num_hits, lease_id = tier.index.lookup(SLOT, [key(0)])
    entry = tier.index.leases[lease_id].entries[0]
    _settle(tier)
    assert num_hits == 1 and not entry.is_ready and entry.is_doomed
    assert tier.store.counters.checksum_failures == 1 and not tier.store.contains(key(0))
    # 3. Its lease gone, the doomed entry leaves the pool; asked again it is a miss.
    tier.index.release(lease_id)
    assert key(0) not in tier.index.entries
    assert tier.index.lookup(SLOT, [key(0)]) == (0, 0)


def test_tier_disk_block_that_cannot_be_a_pool_entry_is_removed_not_leased(tier):
    # A block file whose header names no layers (or a size no slab holds) is never read
    # into the pool: the lookup misses, nothing stays pinned, the file goes.
    src = np.zeros(ENTRY_BYTES, np.uint8)
    assert tier.store.try_write(key(5), src, 1, 0)
    while not tier.store.contains(key(5)):
        tier.store.poll()
        time.sleep(1e-3)
    assert tier.index.lookup(SLOT, [key(5)]) == (0, 0)
    assert not tier.store.contains(key(5)) and key(5) not in tier.index.entries


def test_index_stale_write_still_leased_is_not_dropped(tier, tmp_path):
    # A block read back from disk that failed stays in the index while a lease holds it,
    # however old: dropping it there would let the lease's release unpin another entry.
    _on_disk_only(tier, 0)
    next(tmp_path.rglob("*.blk")).unlink()  # the read will fail
    _, first = tier.index.lookup(SLOT, [key(0)])
    _, second = tier.index.lookup(SLOT, [key(0)])  # leases the promoting entry too
    _settle(tier)
    tier.index.release(first)
    assert tier.index.drop_stale_writes(time.monotonic() + 3600) == 0
    tier.index.release(second)  # would unpin a missing key (KeyError) had it been dropped
    assert key(0) not in tier.index.entries


def test_transfers_load_parked_on_disk_reads_is_late_past_its_deadline(tier):
    # 1. A block on disk only; a lookup starts its read (not polled: still promoting).
    from types import SimpleNamespace

    from engine.commands.load_waits import PARKED_LOAD_DEADLINE_S
    from engine.commands.received import Received
    from engine.commands.transfers import Transfers
    from pegaflow.platform.protocol import Load
    from pegaflow.platform.wire import Opcode
    _on_disk_only(tier, 0)
    _, lease_id = tier.index.lookup(SLOT, [key(0)])
    transfers = Transfers(tier.index, None, tier.stats, answer=None)
    client = SimpleNamespace(num_inflight=0)
    received, rec = Received(client, 1, Opcode.LOAD, 0, 0.0), Load(0, None, None, lease_id)
    # 2. Parked just now it waits (counted in flight); past the deadline it comes back late.
    now = time.monotonic()
    transfers.parked.park(received, rec, now)
    assert transfers.take_parked(now) == [] and client.num_inflight == 1
    assert transfers.take_parked(now + PARKED_LOAD_DEADLINE_S + 1) == [(received, rec, True)]
    assert client.num_inflight == 0 and len(transfers.parked) == 0
    _settle(tier)  # the read goes on into the pool
    assert tier.index.leases[lease_id].entries[0].is_ready


def test_tier_admission_all_writes_every_block_as_it_is_stored(tmp_path):
    # A pool far from full: under ``evicted`` nothing would be written yet; under ``all``
    # each block goes to disk as soon as it is READY, once.
    pool_bytes = 64 * ENTRY_BYTES
    index = BlockIndex(PagePool(pool_bytes, pool_bytes), lease_ttl_s=60.0)
    store = DiskStore([tmp_path], 1 << 22, num_threads=2)
    tier = DiskTier(store, index, np.zeros(pool_bytes, np.uint8), StatsWriter(np.zeros(1, STATS)), "all")
    try:
        saved = [_store(tier, i) for i in range(3)]
        assert tier.spill() == 3 and tier.spill() == 0
        _settle(tier)
        assert all(store.contains(key(i)) for i in range(3)) and store.counters.blocks_written == 3
        dst = np.zeros(ENTRY_BYTES, np.uint8)
        assert store.try_read(key(1), dst, 99)
        while not (done := store.poll()):
            time.sleep(1e-3)
        assert done[0].error is None and np.array_equal(dst, saved[1])
    finally:
        tier.close()


def test_tier_promotion_stops_at_a_block_the_pool_holds_and_gives_back_the_rest(tier):
    # 1. Blocks 0 and 2 on disk only; block 1 on disk and back in the pool (READY).
    for i in (0, 1, 2):
        _store(tier, i)
    tier.spill()
    _settle(tier)
    for j in range(10, 10 + CAPACITY):
        _store(tier, j)
    _store(tier, 1)
    # 2. The lookup's run through the disk stops at block 1: only block 0 is read, the entry
    #    reserved for block 2 goes back, block 1 keeps no pin of this lookup.
    num_hits, lease_id = tier.index.lookup(SLOT, [key(0), key(1), key(2)])
    assert num_hits == 1 and tier.index.leases[lease_id].num_disk == 1
    assert key(2) not in tier.index.entries and tier.index.entries[key(1)].refs == 0
    _settle(tier)
    assert tier.index.leases[lease_id].entries[0].is_ready


def test_transfers_group_load_holding_a_promoting_lease_is_parked_too(tier):
    # A hybrid model's LOAD of one KV cache group under a lease another group's LOAD ends
    # (LEASE_HELD) waits for the disk reads like the lease-ending one, not copying early.
    from types import SimpleNamespace

    from engine.commands.received import LATER as ANSWERED_LATER
    from engine.commands.received import Received
    from engine.commands.transfers import Transfers
    from pegaflow.platform.protocol import Load
    from pegaflow.platform.wire import Opcode
    _on_disk_only(tier, 0)
    _, lease_id = tier.index.lookup(SLOT, [key(0)])
    transfers = Transfers(tier.index, None, tier.stats, answer=None)
    client = SimpleNamespace(num_inflight=0, instance=0)
    held = Load(0, None, None, lease_id, ends_lease=False)
    assert transfers.load(Received(client, 1, Opcode.LOAD, 0, 0.0), held) is ANSWERED_LATER
    assert len(transfers.parked) == 1 and client.num_inflight == 1
    _settle(tier)  # the read ends: the LOAD goes on, and the lease is still there for the last LOAD
    assert [item[1] for item in transfers.take_parked(time.monotonic())] == [held]
    assert lease_id in tier.index.leases
