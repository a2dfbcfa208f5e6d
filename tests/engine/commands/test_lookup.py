"""engine/commands/lookup.py on its own: a LOOKUP's leased prefix answered and counted, its wait
for a block being saved, answered through the dispatcher's ``answer_later`` once the save
lands.  (Through a real engine: test_dispatcher.py and test_lookup_waits.py.)"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np

from engine.blocks.index import BlockIndex
from engine.commands.lookup import Lookups
from engine.commands.received import LATER, Received
from engine.memory.pool import PagePool
from engine.stats import StatsWriter
from pegaflow.platform.protocol import Lookup, LookupAnswer, hash_records
from pegaflow.platform.wire import CLIENT_STATS, STATS, Opcode, Status

NUM_LAYERS, ENTRY_BYTES = 2, 512
LOOKUP = Lookup(7, hash_records([bytes([i]) * 32 for i in range(3)]))


def _parts(lookup_wait_s: float = 0.0):
    # A real index and stats; the dispatcher's answer path stands in as a list of answers.
    index = BlockIndex(PagePool(4 * ENTRY_BYTES, 4 * ENTRY_BYTES), lease_ttl_s=60.0)
    stats_row = np.zeros(1, STATS)
    answered: list[tuple] = []
    lookups = Lookups(index, StatsWriter(stats_row, np.zeros(2, CLIENT_STATS)),
                      lambda received, status, answer=(): answered.append((received.command_id, status, answer)),
                      lookup_wait_s, is_issuing_save=lambda client, namespace: False)
    client = SimpleNamespace(slot=1, uid=1, instance=0, is_attached=True, num_inflight=0)
    return index, lookups, answered, client, stats_row


def _store(index: BlockIndex, key, is_done: bool = True) -> None:
    index.reserve(key, ENTRY_BYTES, NUM_LAYERS, slot=0).pending_mask |= 0b11
    if is_done:
        index.mark_layers_done([key], 0b11)


def test_lookup_answers_the_ready_prefix_leased_and_counted():
    index, lookups, answered, client, stats_row = _parts()
    keys = LOOKUP.keys()
    _store(index, keys[0])
    _store(index, keys[1])
    answer = lookups.lookup(Received(client, 1, Opcode.LOOKUP, 3, 0.0), LOOKUP)
    assert answer == LookupAnswer(2, answer.lease_id, 0) and answer.lease_id in index.leases
    assert (stats_row["lookups"][0], stats_row["lookup_hit_blocks"][0]) == (1, 2) and answered == []


def test_lookup_stopped_by_a_block_being_saved_waits_and_is_answered_when_it_lands():
    # 1. Block 2 is still being written: the LOOKUP waits (no lease meanwhile).
    index, lookups, answered, client, stats_row = _parts(lookup_wait_s=30.0)
    keys = LOOKUP.keys()
    _store(index, keys[0])
    _store(index, keys[1])
    _store(index, keys[2], is_done=False)
    assert lookups.lookup(Received(client, 4, Opcode.LOOKUP, 3, 0.0), LOOKUP) is LATER
    assert index.leases == {} and client.num_inflight == 1 and answered == []
    # 2. Its save lands: the LOOKUP is answered with all three, through answer_later.
    index.mark_layers_done([keys[2]], 0b11)
    assert lookups.waiting.resume(time.monotonic()) == 1
    [(command_id, status, answer)] = answered
    assert (command_id, status, answer.num_hit_blocks) == (4, Status.OK, 3) and client.num_inflight == 0
    assert stats_row["lookup_waits"][0] == 1


def test_lookup_of_a_client_gone_while_it_waited_is_answered_without_a_lease():
    index, lookups, answered, client, _ = _parts(lookup_wait_s=30.0)
    keys = LOOKUP.keys()
    _store(index, keys[0], is_done=False)
    assert lookups.lookup(Received(client, 5, Opcode.LOOKUP, 3, 0.0), LOOKUP) is LATER
    client.is_attached = False
    index.mark_layers_done([keys[0]], 0b11)
    lookups.waiting.resume(time.monotonic())
    assert answered == [(5, Status.OK, ())] and index.leases == {}


def test_lookup_past_the_parked_bounds_is_answered_wait_refused_with_its_ready_prefix(monkeypatch):
    # 1. One LOOKUP of a client may be parked; block 2 is still being written.
    import engine.commands.lookup_waits as lookup_waits
    monkeypatch.setattr(lookup_waits, "MAX_WAITING_PER_CLIENT", 1)
    index, lookups, answered, client, stats_row = _parts(lookup_wait_s=30.0)
    keys = LOOKUP.keys()
    _store(index, keys[0])
    _store(index, keys[1])
    _store(index, keys[2], is_done=False)
    assert lookups.lookup(Received(client, 1, Opcode.LOOKUP, 3, 0.0), LOOKUP) is LATER
    # 2. The next one would wait too: it is answered now, under WAIT_REFUSED, with its READY
    #    prefix leased (as an OK answer's), and counted.
    assert lookups.lookup(Received(client, 2, Opcode.LOOKUP, 3, 0.0), LOOKUP) is LATER
    [(command_id, status, answer)] = answered
    assert (command_id, status) == (2, Status.WAIT_REFUSED)
    assert answer == LookupAnswer(2, answer.lease_id, 0) and answer.lease_id in index.leases
    assert (stats_row["lookup_waits_refused"][0], stats_row["lookups"][0]) == (1, 1)
    assert client.num_inflight == 1 and len(lookups.waiting.items) == 1  # the first one still waits
