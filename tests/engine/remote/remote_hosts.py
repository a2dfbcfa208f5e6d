"""Engines of the remote tier's tests (test_tier.py, test_store_lookups.py): each its index,
pool and remote tier over one in-process store (fake_store.py), its answers collected."""

from __future__ import annotations

import time
from contextlib import contextmanager

import numpy as np

from engine.blocks.entries import Key
from engine.blocks.index import BlockIndex
from engine.commands.received import Received
from engine.memory.pool import PagePool
from engine.remote.tier import RemoteTier
from engine.remote.workers import RemoteWorkers
from engine.stats import StatsWriter
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


def block_keys(n: int, start: int = 0) -> list[Key]:
    return [(5, bytes([i % 256, i // 256]) * 16 + b"\x20") for i in range(start, start + n)]


def published(hosts, rng, num_blocks: int):
    """Two engines on one store; the first's ``num_blocks`` saved blocks published:
    (store, first, second, keys, their bytes)."""
    store = FakeStore()
    first, second = hosts(store), hosts(store)
    keys = block_keys(num_blocks)
    data = first.save(keys, rng)
    first.pump(lambda: first.counter("remote_blocks_put") == num_blocks)
    return store, first, second, keys, data


@contextmanager
def remote_hosts():
    """A ``make(store, **kwargs)`` of Hosts, each closed at the end."""
    made = []

    def make(store, **kwargs) -> Host:
        made.append(Host(store, **kwargs))
        return made[-1]
    try:
        yield make
    finally:
        for host in made:
            host.close()
