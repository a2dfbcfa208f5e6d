"""engine/blocks/entries.py: an entry is complete with every layer in and every voter's vote,
ready unless a DROP doomed it, and unused with no pin and no copy in flight."""

from __future__ import annotations

from engine.blocks.entries import Entry, is_unused


def test_entry_is_ready_only_with_every_layer_and_every_vote_and_not_doomed():
    entry = Entry(offset=0, entry_bytes=4096, all_layers_mask=0b11, owner_slot=0, all_votes_mask=0b101)
    assert not entry.is_complete and not entry.is_ready
    entry.done_mask = 0b11  # every layer in, one vote of two
    entry.votes = 0b001
    assert not entry.is_complete and not entry.is_ready
    entry.votes = 0b101
    assert entry.is_complete and entry.is_ready
    entry.is_doomed = True  # complete still, never served
    assert entry.is_complete and not entry.is_ready


def test_entry_is_unused_without_pins_or_layers_in_flight():
    entry = Entry(offset=0, entry_bytes=4096, all_layers_mask=0b1, owner_slot=0)
    assert is_unused(entry)
    entry.refs = 1
    assert not is_unused(entry)
    entry.refs, entry.pending_mask = 0, 0b1
    assert not is_unused(entry)
