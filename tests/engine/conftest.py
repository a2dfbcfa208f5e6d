"""Clients for the engine integration tests: a registered host KV cache and raw ring access.

``kv_client(engine)`` attaches to a running engine (see ``tests/conftest.py``) and
registers a 4-layer KV cache of 64 blocks of 4 KiB pages in host shared memory, so one
stored block is a 16 KiB pool entry.  ``pages[layer, block]`` is one page.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from pegaflow.client.connection import EngineClient
from pegaflow.client.host_memory import HostKVBuffer, layer_major_records
from pegaflow.platform.protocol import Completion
from pegaflow.platform.wire import ALL_LAYERS, NO_EVENT, SUBMISSION, WIRE_VERSION


class KVClient:
    NUM_LAYERS = 4
    NUM_BLOCKS = 64
    PAGE_BYTES = 4096
    ENTRY_BYTES = NUM_LAYERS * PAGE_BYTES

    def __init__(self, engine_name: str, timeout_s: float = 5.0, instance: int = 0):
        layer_bytes = self.NUM_BLOCKS * self.PAGE_BYTES
        self.kv = HostKVBuffer(self.NUM_LAYERS * layer_bytes, "tkv")
        try:
            self.client = EngineClient.connect(engine_name, timeout_s=timeout_s, instance=instance)
            region = self.kv.region_record(self.NUM_BLOCKS, self.PAGE_BYTES, self.NUM_LAYERS)
            self.client.register_region(0, region, layer_major_records(self.NUM_LAYERS, self.NUM_BLOCKS,
                                                                       self.PAGE_BYTES))
        except BaseException:
            self.kv.close()
            raise
        self.pages = self.kv.data.reshape(self.NUM_LAYERS, self.NUM_BLOCKS, self.PAGE_BYTES)

    def fill(self, rng: np.random.Generator, block_ids) -> np.ndarray:
        """Random bytes into every layer of ``block_ids``; returns a copy of them."""
        ids = np.asarray(block_ids)
        self.pages[:, ids] = rng.integers(0, 256, self.pages[:, ids].shape, dtype=np.uint8)
        return self.pages[:, ids].copy()

    def store(self, rng: np.random.Generator, namespace: int, block_ids) -> tuple[list[bytes], np.ndarray]:
        """Random bytes into ``block_ids`` saved under new random hashes (asserted OK):
        (the hashes, the bytes)."""
        hashes = random_hashes(rng, len(block_ids))
        saved = self.fill(rng, block_ids)
        assert self.save(namespace, block_ids, hashes).is_ok
        return hashes, saved

    def save(self, namespace: int, block_ids, hashes: list[bytes], layer: int = ALL_LAYERS) -> Completion:
        return self.client.wait(self.client.submit_save(namespace, block_ids, hashes, layer=layer))

    def load(self, namespace: int, block_ids, hashes: list[bytes], lease_id: int = 0) -> Completion:
        return self.client.wait(self.client.submit_load(namespace, block_ids, hashes, lease_id=lease_id))

    def release(self, lease_id: int) -> Completion:
        return self.client.wait(self.client.release(lease_id))

    def look_up_and_load(self, namespace: int, hashes: list[bytes]):
        """LOOKUP, then LOAD by its lease into blocks 0..: (lookup, load answer or None where
        nothing hit, the bytes loaded)."""
        found = self.client.lookup(namespace, hashes)
        dst = list(range(found.num_hit_blocks))
        self.pages[:, dst] = 0
        done = self.load(namespace, dst, hashes[:len(dst)], lease_id=found.lease_id) if dst else None
        return found, done, self.pages[:, dst].copy()

    def num_hits(self, namespace: int, hashes: list[bytes]) -> int:
        """The cached prefix length of ``hashes``; the lease it took is released again."""
        found = self.client.lookup(namespace, hashes)
        if found.lease_id:
            assert self.release(found.lease_id).is_ok
        return found.num_hit_blocks

    def submit_raw(self, **fields) -> int:
        """Publish a SUBMISSION whose fields are exactly ``fields`` (plus a command id)."""
        rec = np.zeros(1, dtype=SUBMISSION)[0]
        rec["version"], rec["layer"], rec["event_index"] = WIRE_VERSION, ALL_LAYERS, NO_EVENT
        for name, value in fields.items():
            rec[name] = value
        command_id = self.client._new_command_id()
        rec["command_id"] = command_id
        position = self.client._producer.position
        self.client._producer.put_fields(rec.item()[1:], 5.0)
        self.client._arena.mark_sent(position)
        return command_id

    def take_raw(self, command_id: int, timeout_s: float = 5.0) -> np.void:
        """The COMPLETION record of ``command_id`` as the engine wrote it (no decoding)."""
        deadline = time.monotonic() + timeout_s
        while True:
            record = self.client._consumer.try_get()
            if record is not None and int(record["command_id"]) == command_id:
                return record
            if record is None and time.monotonic() >= deadline:
                pytest.fail(f"no completion for command {command_id} within {timeout_s}s")
            if record is None:
                time.sleep(1e-4)

    def close(self) -> None:
        self.client.close()
        self.pages = None
        self.kv.close()


@pytest.fixture
def kv_client(engine_factory):
    """``kv_client(engine)``: a KVClient attached to ``engine``, closed at teardown."""
    clients: list[KVClient] = []

    def connect(engine, instance: int = 0) -> KVClient:
        clients.append(KVClient(engine.name, instance=instance))
        return clients[-1]

    yield connect
    for client in reversed(clients):
        client.close()


def random_hashes(rng: np.random.Generator, count: int, num_bytes: int = 32) -> list[bytes]:
    return [rng.bytes(num_bytes) for _ in range(count)]


@pytest.fixture
def make_hashes(rng):
    """``make_hashes(count, num_bytes=32)``: fresh random block hashes."""
    return lambda count, num_bytes=32: random_hashes(rng, count, num_bytes)
