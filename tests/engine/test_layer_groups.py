"""KV cache groups (hybrid models): layers that share memory, and a SAVE or LOAD of one
group's layers with that group's own block ids (CommandFlag.LAYER_GROUP)."""

from __future__ import annotations

import numpy as np
import pytest

from pegaflow.client.connection import EngineClient
from pegaflow.client.host_memory import HostKVBuffer, layer_records
from pegaflow.platform.wire import Opcode, Status

NAMESPACE = 0x6A0
NUM_BLOCKS, PAGE = 32, 4096
# Two groups of two layers, laid out as vLLM does: group 1's layers overlay group 0's
# (the i-th layer of every group in the i-th tensor), since a block id belongs to one
# group at a time.  Engine layers 0, 1 are group 0 (tensors 0, 1); 2, 3 are group 1.
LAYERS, GROUPS, TENSORS = [0, 1, 2, 3], [0, 0, 1, 1], [0, 1, 0, 1]


class GroupedClient:
    def __init__(self, engine_name: str):
        self.kv = HostKVBuffer(2 * NUM_BLOCKS * PAGE, "tgrp")
        self.client = EngineClient.connect(engine_name)
        self.register()
        self.tensors = self.kv.data.reshape(2, NUM_BLOCKS, PAGE)  # [tensor, block, page]

    def register(self):
        offsets = [t * NUM_BLOCKS * PAGE for t in TENSORS]
        self.client.register_region(0, self.kv.region_record(NUM_BLOCKS, PAGE, len(LAYERS)),
                                    layer_records(LAYERS, offsets, [PAGE] * len(LAYERS), GROUPS))

    def wait_save(self, block_ids, hashes, group):
        return self.client.wait(self.client.submit_save(NAMESPACE, block_ids, hashes, group=group))

    def wait_load(self, block_ids, hashes, group):
        return self.client.wait(self.client.submit_load(NAMESPACE, block_ids, hashes, group=group))

    def close(self):
        self.client.close()
        self.tensors = None
        self.kv.close()


@pytest.fixture
def grouped(shared_engine):
    clients = []

    def connect():
        connect.engine = shared_engine
        clients.append(GroupedClient(shared_engine.name))
        return clients[-1]

    yield connect
    for c in clients:
        c.close()


def test_layer_groups_each_group_saves_and_loads_its_own_block_ids_exactly(grouped, rng, make_hashes):
    # 1. Two blocks: group 0 holds them in blocks 1, 2; group 1 (same tensors) in 5, 6.
    first = grouped()
    hashes = make_hashes(2)
    first.tensors[:] = rng.integers(0, 256, first.tensors.shape, dtype=np.uint8)
    group0, group1 = first.tensors[:, [1, 2]].copy(), first.tensors[:, [5, 6]].copy()
    # 2. Group 0 saved alone: the blocks are not whole yet, so a lookup finds nothing.
    assert first.wait_save([1, 2], hashes, group=0).is_ok
    assert first.client.lookup(NAMESPACE, hashes).num_hit_blocks == 0
    # 3. Group 1 saved from its own block ids: both blocks are whole and found.
    assert first.wait_save([5, 6], hashes, group=1).is_ok
    found = first.client.lookup(NAMESPACE, hashes)
    assert found.num_hit_blocks == 2
    first.client.wait(first.client.release(found.lease_id))
    # 4. Another client loads each group into other block ids: each gets its own bytes
    #    (a load that mixed the groups up, or copied every layer, would not).
    second = grouped()
    second.tensors[:] = 0
    assert second.wait_load([10, 11], hashes, group=0).is_ok
    assert second.wait_load([20, 21], hashes, group=1).is_ok
    np.testing.assert_array_equal(second.tensors[:, [10, 11]], group0)
    np.testing.assert_array_equal(second.tensors[:, [20, 21]], group1)
    assert not second.tensors[:, 12:20].any()  # nothing else written


def test_layer_groups_a_group_nobody_registered_is_refused(grouped, make_hashes):
    # A SAVE or LOAD of a group with no registered layer: BAD_ARGUMENT, nothing stored.
    client = grouped()
    hashes = make_hashes(1)
    assert client.wait_save([1], hashes, group=7).status == Status.BAD_ARGUMENT
    assert client.wait_load([1], hashes, group=7).status == Status.BAD_ARGUMENT
    assert client.client.lookup(NAMESPACE, hashes).num_hit_blocks == 0


def test_layer_groups_are_registered_anew_after_unregister(grouped, rng, make_hashes):
    # 1. A client unregisters its memory and registers it again, the same groups.
    client = grouped()
    client.client.call(Opcode.UNREGISTER)
    client.register()
    # 2. Each group is its two layers again (not the old ones twice): blocks saved by both
    #    groups are whole and load back exactly.
    hashes = make_hashes(1)
    client.tensors[:] = rng.integers(0, 256, client.tensors.shape, dtype=np.uint8)
    group0, group1 = client.tensors[:, [3]].copy(), client.tensors[:, [4]].copy()
    assert client.wait_save([3], hashes, group=0).is_ok and client.wait_save([4], hashes, group=1).is_ok
    client.tensors[:] = 0
    assert client.wait_load([8], hashes, group=0).is_ok and client.wait_load([9], hashes, group=1).is_ok
    np.testing.assert_array_equal(client.tensors[:, [8]], group0)
    np.testing.assert_array_equal(client.tensors[:, [9]], group1)


def test_layer_groups_one_lease_serves_every_group_load_and_ends_with_the_last(grouped, rng, make_hashes):
    # 1. Three blocks saved by both groups; a lookup leases them.
    client = grouped()
    hashes = make_hashes(3)
    client.tensors[:] = rng.integers(0, 256, client.tensors.shape, dtype=np.uint8)
    group0, group1 = client.tensors[:, [1, 2, 3]].copy(), client.tensors[:, [6, 7]].copy()
    assert client.wait_save([1, 2, 3], hashes, group=0).is_ok
    assert client.wait_save([5, 6, 7], hashes, group=1).is_ok
    found = client.client.lookup(NAMESPACE, hashes)
    assert found.num_hit_blocks == 3
    client.tensors[:] = 0
    # 2. Group 1 (a sliding window: only the last two blocks) loads under the lease without
    #    ending it; the lease still stands, so group 0's LOAD may end it.
    c, engine = client.client, grouped.engine
    leases = engine.stats()["leases_active"]
    held = c.wait(c.submit_load(NAMESPACE, [20, 21], hashes[1:], lease_id=found.lease_id,
                                group=1, ends_lease=False))
    assert held.is_ok and engine.stats()["leases_active"] == leases
    assert c.wait(c.submit_load(NAMESPACE, [10, 11, 12], hashes, lease_id=found.lease_id, group=0)).is_ok
    np.testing.assert_array_equal(client.tensors[:, [10, 11, 12]], group0)
    np.testing.assert_array_equal(client.tensors[:, [20, 21]], group1)
    # 3. The last LOAD ended the lease.
    assert engine.stats()["leases_active"] == leases - 1
    assert c.wait(c.release(found.lease_id)).status == Status.UNKNOWN_LEASE
