"""The remote tier's policy with an in-process store (no package, no network): what is
published and when, a lookup continued through the store, its deadline, a fetched block
checked before it is READY."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest

from engine.blocks.entries import Key
from engine.blocks.index import BlockIndex
from engine.commands.received import Received
from engine.config import EngineConfig
from engine.memory.pool import PagePool
from engine.remote.header import data_name, header_name
from engine.remote.tier import RemoteTier
from engine.remote.workers import RemoteWorkers
from engine.stats import StatsWriter
from pegaflow.platform.errors import RemoteTierError
from pegaflow.platform.wire import STATS
from tests.engine.remote.fake_store import FakeStore

ENTRY_BYTES, NUM_LAYERS = 4096, 2
MASK = (1 << NUM_LAYERS) - 1


class FakeClient:
    slot, instance, is_attached, num_inflight, pending_detach = 0, 0, True, 0, None


def _received() -> Received:
    return Received(FakeClient(), 1, 0, 0, 0.0)


class Host:
    """One engine's index, pool and remote tier over ``store``; answers collected."""

    def __init__(self, store: FakeStore, publish: str = "all", timeout_s: float = 0.5):
        self.pool = np.zeros(1 << 20, np.uint8)
        self.index = BlockIndex(PagePool(self.pool.nbytes, 1 << 18), lease_ttl_s=60.0)
        self.stats_row = np.zeros(1, STATS)
        self.stats = StatsWriter(self.stats_row)
        self.workers = RemoteWorkers(store, self.pool)
        self.answers: list[tuple[int, int]] = []
        self.tier = RemoteTier(store, self.workers, self.index, self.stats,
                               lambda received, num_hits, lease_id: self.answers.append((num_hits, lease_id)),
                               publish, timeout_s)

    def counter(self, name: str) -> int:
        return int(self.stats_row[0][name])

    def save(self, keys: list[Key], rng) -> list[bytes]:
        """Blocks of random bytes made READY in the pool, as a SAVE's copy would."""
        entries, data = self.index.reserve_many(keys, ENTRY_BYTES, NUM_LAYERS, 0), []
        for entry in entries:
            page = rng.integers(0, 256, ENTRY_BYTES, dtype=np.uint8)
            self.pool[entry.offset:entry.offset + ENTRY_BYTES] = page
            data.append(page.tobytes())
        self.index.mark_layers_done(keys, MASK)
        return data

    def pump(self, until, timeout_s: float = 30.0) -> None:
        """The engine loop's remote part until ``until()`` holds."""
        deadline = time.monotonic() + timeout_s
        while not until():
            self.tier.publish()
            self.tier.poll(time.monotonic())
            assert time.monotonic() < deadline, "the remote tier never got there"
            time.sleep(1e-3)

    def lookup(self, keys: list[Key]) -> tuple[int, int]:
        """A LOOKUP as the dispatcher makes it: local first, then the store; its answer."""
        num_hits, lease_id = self.index.lookup(0, keys)
        if not self.tier.try_lookup(_received(), keys, num_hits, lease_id):
            return num_hits, lease_id
        self.pump(lambda: self.answers)
        return self.answers.pop()

    def page(self, key: Key) -> bytes:
        entry = self.index.entries[key]
        return self.pool[entry.offset:entry.offset + entry.entry_bytes].tobytes()

    def close(self) -> None:
        self.tier.close()


@pytest.fixture
def hosts():
    made = []

    def make(store, **kwargs) -> Host:
        made.append(Host(store, **kwargs))
        return made[-1]
    yield make
    for host in made:
        host.close()


def _keys(n: int, start: int = 0) -> list[Key]:
    return [(5, bytes([i % 256, i // 256]) * 16 + b"\x20") for i in range(start, start + n)]


def _published(hosts, rng, num_blocks: int):
    """Two engines on one store; the first's ``num_blocks`` saved blocks published:
    (store, first, second, keys, their bytes)."""
    store = FakeStore()
    first, second = hosts(store), hosts(store)
    keys = _keys(num_blocks)
    data = first.save(keys, rng)
    first.pump(lambda: first.counter("remote_blocks_put") == num_blocks)
    return store, first, second, keys, data


def test_tier_ready_blocks_published_then_served_to_another_engine(hosts, rng):
    # 1. Engine A's READY blocks are published (data, then header), their pins let go.
    store, first, second, keys, data = _published(hosts, rng, 6)
    assert all(first.index.entries[k].refs == 0 for k in keys)
    assert store.objects[data_name(keys[0])][:ENTRY_BYTES] == data[0] and header_name(keys[0]) in store.objects
    # 2. Engine B's lookup goes on through the store: all 6, on their way (num_disk).
    num_hits, lease_id = second.lookup(keys)
    assert num_hits == 6 and second.index.leases[lease_id].num_disk == 6
    second.pump(lambda: not second.index.is_promoting(lease_id))
    # 3. Fetched, checked, READY, byte for byte; not published back.
    assert [second.page(k) for k in keys] == data
    assert second.counter("remote_blocks_fetched") == 6 and second.counter("remote_blocks_put") == 0


def test_tier_block_damaged_in_the_store_is_doomed_never_ready(hosts, rng):
    store, first, second, keys, _ = _published(hosts, rng, 3)
    name = data_name(keys[1])
    store.objects[name] = bytes([store.objects[name][0] ^ 1]) + store.objects[name][1:]
    num_hits, lease_id = second.lookup(keys)
    assert num_hits == 3
    second.pump(lambda: not second.index.is_promoting(lease_id))
    assert second.counter("remote_checksum_failures") == 1
    assert second.index.entries[keys[1]].is_doomed and not second.index.entries[keys[1]].is_ready
    assert second.index.get_ready(keys[0]) is not None and second.index.get_ready(keys[2]) is not None


def test_tier_stalled_store_answers_the_lookup_at_its_deadline_with_the_local_prefix(hosts, rng):
    # 1. B holds the first 2 blocks; the store stalls every call.
    store = FakeStore()
    second = hosts(store, timeout_s=0.05)
    keys = _keys(4)
    second.save(keys[:2], rng)
    store.stall.clear()
    # 2. The lookup is answered at its deadline with its local prefix, counted; a lookup
    #    meanwhile does not ask the stalled store at all.
    started = time.monotonic()
    assert second.lookup(keys)[0] == 2
    assert time.monotonic() - started > 0.04  # it waited for the store until its deadline
    num_gets = store.num_gets
    assert second.lookup(keys)[0] == 2 and second.counter("remote_lookup_timeouts") == 2
    # 3. Released, the store is asked again.
    store.stall.set()
    second.pump(lambda: not second.tier.lookups.num_inflight)
    assert second.lookup(keys)[0] == 2 and store.num_gets > num_gets


def test_tier_unreachable_store_is_a_counted_miss(hosts, rng):
    store = FakeStore()
    second = hosts(store)
    store.is_down = True
    assert second.lookup(_keys(3)) == (0, 0)
    assert second.counter("remote_errors") == 3  # (one per key of the existence check)


def test_tier_reused_publishes_only_blocks_a_lookup_hit(hosts, rng):
    store = FakeStore()
    first = hosts(store, publish="reused")
    keys = _keys(4)
    first.save(keys, rng)
    first.pump(lambda: True)
    assert first.counter("remote_blocks_put") == 0
    num_hits, lease_id = first.index.lookup(0, keys[:2])
    lease = first.index.leases[lease_id]
    first.tier.note_hits(lease.entries, lease.keys)
    first.pump(lambda: first.counter("remote_blocks_put") == 2)
    assert data_name(keys[0]) in store.objects and data_name(keys[2]) not in store.objects


def test_tier_without_the_package_refuses_to_start(monkeypatch):
    from engine.remote.store import MooncakeStore
    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(RemoteTierError, match="mooncake-transfer-engine"):
        MooncakeStore(EngineConfig(remote="mooncake"))


def test_tier_publishing_backlog_past_its_pinned_share_waits_not_dropped(hosts, rng):
    # 100 blocks of 4 KiB at once: more than the 1/8 of the 1 MiB pool that puts may pin;
    # the rest wait their turn and all are published, none dropped, no pin left behind.
    store = FakeStore()
    first = hosts(store)
    keys = _keys(100)
    first.save(keys, rng)
    assert first.tier.publish() == 32
    first.pump(lambda: first.counter("remote_blocks_put") == 100)
    assert first.counter("remote_puts_dropped") == 0
    assert all(first.index.entries[k].refs == 0 for k in keys)


def test_tier_block_with_a_layer_missing_is_never_published(hosts, rng):
    # 1. One layer of two saved: the block is not READY, nothing goes to the store.
    store = FakeStore()
    first = hosts(store)
    key = _keys(1)[0]
    first.index.reserve_many([key], ENTRY_BYTES, NUM_LAYERS, 0)
    first.index.mark_layers_done([key], 0b01)
    assert first.tier.publish() == 0 and not store.objects
    # 2. Its last layer in: READY, published.
    first.index.mark_layers_done([key], 0b10)
    first.pump(lambda: first.counter("remote_blocks_put") == 1)
    assert data_name(key) in store.objects


def test_tier_lookup_naming_a_block_twice_fetches_it_once(hosts, rng):
    store, first, second, keys, data = _published(hosts, rng, 2)
    num_hits, lease_id = second.lookup([keys[0], keys[1], keys[0]])
    assert num_hits == 2  # (the run stops where it repeats)
    second.pump(lambda: not second.index.is_promoting(lease_id))
    assert [second.page(k) for k in keys] == data and second.index.entries[keys[0]].refs == 1
