"""engine/remote/store_lookups.py: a LOOKUP continued through the remote store: answered at its
deadline with the local prefix when the store stalls, a counted miss when it is unreachable,
a block the lookup names twice fetched once."""

from __future__ import annotations

import time

import pytest

from tests.engine.remote.fake_store import FakeStore
from tests.engine.remote.remote_hosts import block_keys, published, remote_hosts


@pytest.fixture
def hosts():
    with remote_hosts() as make:
        yield make


def test_tier_stalled_store_answers_the_lookup_at_its_deadline_with_the_local_prefix(hosts, rng):
    # 1. B holds the first 2 blocks; the store stalls every call.
    store = FakeStore()
    second = hosts(store, timeout_s=0.05)
    keys = block_keys(4)
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
    assert second.lookup(block_keys(3)) == (0, 0)
    assert second.counter("remote_errors") == 3  # (one per key of the existence check)


def test_tier_lookup_naming_a_block_twice_fetches_it_once(hosts, rng):
    store, first, second, keys, data = published(hosts, rng, 2)
    num_hits, lease_id = second.lookup([keys[0], keys[1], keys[0]])
    assert num_hits == 2  # (the run stops where it repeats)
    second.pump(lambda: not second.index.is_promoting(lease_id))
    assert [second.page(k) for k in keys] == data and second.index.entries[keys[0]].refs == 1
