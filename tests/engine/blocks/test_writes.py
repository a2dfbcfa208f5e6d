"""engine/blocks/writes.py: an entry being written becomes READY once its last layer (and
vote) is in, goes into the eviction order and is announced to the tiers once; one no one
will finish (doomed, orphaned, its copies failed) is dropped."""

from __future__ import annotations

from engine.blocks.entries import ORPHAN, Entry
from engine.blocks.eviction import LruPolicy
from engine.blocks.writes import Writes
from engine.memory.pool_table import NoTable

ALL_LAYERS = 0b11


class Written:
    """A Writes over entries being written (both layers pending), what it drops and announces."""

    def __init__(self, num_keys: int, **fields):
        self.keys = [(1, bytes([i]) * 33) for i in range(num_keys)]
        self.entries = {k: Entry(offset=i * 4096, entry_bytes=4096, all_layers_mask=ALL_LAYERS, owner_slot=0,
                                 pending_mask=ALL_LAYERS, **fields) for i, k in enumerate(self.keys)}
        self.writing = dict(self.entries)
        self.policy, self.dropped, self.announced = LruPolicy(), [], []
        self.writes = Writes(self.entries, self.writing, self.policy, NoTable(), self.dropped.append,
                             [self.announced.append])


def test_writes_entry_is_ready_once_its_last_layer_lands_and_announced_once():
    w = Written(2)
    # 1. One layer of each: nothing READY, nothing announced.
    assert w.writes.mark_layers_done(w.keys, 0b01) == 0 and w.announced == []
    # 2. The other layer: both READY, in the eviction order, no longer being written, told once.
    assert w.writes.mark_layers_done(w.keys, 0b10) == 2
    assert list(w.policy.oldest()) == w.keys and w.writing == {} and w.announced == [w.keys]
    # 3. A layer landing again (a second SAVE's copy) makes nothing READY a second time.
    assert w.writes.mark_layers_done(w.keys[:1], 0b01) == 0 and w.announced == [w.keys]


def test_writes_voted_entry_is_ready_only_with_every_vote():
    w = Written(1, all_votes_mask=0b11)
    assert w.writes.mark_layers_done(w.keys, ALL_LAYERS) == 0  # layers in, one vote missing
    w.entries[w.keys[0]].votes = 0b01
    assert w.writes.mark_voted(w.keys) == 0 and w.announced == []
    w.entries[w.keys[0]].votes = 0b11
    assert w.writes.mark_voted(w.keys) == 1 and w.announced == [w.keys] and w.writing == {}
    assert w.writes.mark_voted(w.keys) == 0  # (READY already)


def test_writes_doomed_or_orphaned_entry_is_dropped_when_its_copies_end():
    w = Written(2)
    w.entries[w.keys[0]].is_doomed = True
    w.entries[w.keys[1]].owner_slot = ORPHAN
    w.entries[w.keys[1]].all_layers_mask = 0b111  # a layer that will never come
    w.writes.mark_layers_done(w.keys, 0b01)
    assert w.dropped == []  # a copy of each still in flight
    w.writes.mark_layers_done(w.keys, 0b10)
    assert w.dropped == w.keys and w.announced == [] and list(w.policy.oldest()) == []


def test_writes_abandon_layers_drops_an_entry_with_nothing_written_and_keeps_a_partial_one():
    w = Written(2)
    w.writes.mark_layers_done(w.keys[1:], 0b01)
    w.writes.abandon_layers(w.keys[0], ALL_LAYERS)  # its copies failed, nothing of it in
    w.writes.abandon_layers(w.keys[1], 0b10)        # layer 0 in: its owner may save it again
    assert w.dropped == [w.keys[0]]
    w.entries[w.keys[1]].owner_slot = ORPHAN
    w.writes.abandon_layers(w.keys[1], 0)  # once its owner is gone, no one finishes it
    assert w.dropped == w.keys
