"""The remote tier's policy with an in-process store (no package, no network): what is
published and when, a lookup served from the store, a fetched block checked before it is
READY (a lookup's deadline and misses: test_store_lookups.py)."""

from __future__ import annotations

import sys

import pytest

from engine.config import EngineConfig
from engine.remote.header import data_name, header_name
from pegaflow.platform.errors import RemoteTierError
from tests.engine.remote.fake_store import FakeStore
from tests.engine.remote.remote_hosts import ENTRY_BYTES, NUM_LAYERS, block_keys, published, remote_hosts


@pytest.fixture
def hosts():
    with remote_hosts() as make:
        yield make


def test_tier_ready_blocks_published_then_served_to_another_engine(hosts, rng):
    # 1. Engine A's READY blocks are published (data, then header), their pins let go.
    store, first, second, keys, data = published(hosts, rng, 6)
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
    store, first, second, keys, _ = published(hosts, rng, 3)
    name = data_name(keys[1])
    store.objects[name] = bytes([store.objects[name][0] ^ 1]) + store.objects[name][1:]
    num_hits, lease_id = second.lookup(keys)
    assert num_hits == 3
    second.pump(lambda: not second.index.is_promoting(lease_id))
    assert second.counter("remote_checksum_failures") == 1
    assert second.index.entries[keys[1]].is_doomed and not second.index.entries[keys[1]].is_ready
    assert second.index.get_ready(keys[0]) is not None and second.index.get_ready(keys[2]) is not None


def test_tier_reused_publishes_only_blocks_a_lookup_hit(hosts, rng):
    store = FakeStore()
    first = hosts(store, publish="reused")
    keys = block_keys(4)
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
    keys = block_keys(100)
    first.save(keys, rng)
    assert first.tier.publish() == 32
    first.pump(lambda: first.counter("remote_blocks_put") == 100)
    assert first.counter("remote_puts_dropped") == 0
    assert all(first.index.entries[k].refs == 0 for k in keys)


def test_tier_block_with_a_layer_missing_is_never_published(hosts, rng):
    # 1. One layer of two saved: the block is not READY, nothing goes to the store.
    store = FakeStore()
    first = hosts(store)
    key = block_keys(1)[0]
    first.index.reserve_many([key], ENTRY_BYTES, NUM_LAYERS, 0)
    first.index.mark_layers_done([key], 0b01)
    assert first.tier.publish() == 0 and not store.objects
    # 2. Its last layer in: READY, published.
    first.index.mark_layers_done([key], 0b10)
    first.pump(lambda: first.counter("remote_blocks_put") == 1)
    assert data_name(key) in store.objects
