"""Entries being written: the layers a SAVE's copies land (or fail) and the votes that make
a block READY (``votes.py``), on a ``BlockIndex``; the pool table and the tiers are told
of each block that becomes READY."""

from __future__ import annotations

from .entries import ORPHAN, Entry, Key, is_unused


def mark_layers_done(index, keys: list[Key], mask: int) -> int:
    """Those layers of ``keys`` are in the pool; returns how many entries became READY."""
    entries, policy, ready = index.entries, index.policy, []
    ready_keys = [] if index.on_ready is not None else None
    for key in keys:
        entry = entries[key]
        was_ready = entry.is_complete
        entry.pending_mask &= ~mask
        entry.done_mask |= mask
        if entry.is_doomed:  # dropped by a client meanwhile: never served
            if is_unused(entry):
                index.drop_entry(key)
            continue
        if not was_ready and entry.is_complete:
            policy.insert(key)
            index.writing.pop(key, None)
            ready.append(entry)
            if ready_keys is not None:
                ready_keys.append(key)
        elif entry.owner_slot == ORPHAN and not entry.pending_mask:
            index.drop_entry(key)
    _announce_ready(index, ready, ready_keys)
    return len(ready)


def mark_voted(index, keys: list[Key]) -> int:
    """A vote came for ``keys`` (their data in or on its way): those now complete become
    READY; returns how many."""
    ready, ready_keys = [], [] if index.on_ready is not None else None
    for key in keys:
        entry = index.entries[key]
        if entry.is_doomed or not entry.is_complete or key not in index.writing:
            continue
        index.policy.insert(key)
        del index.writing[key]
        ready.append(entry)
        if ready_keys is not None:
            ready_keys.append(key)
    _announce_ready(index, ready, ready_keys)
    return len(ready)


def _announce_ready(index, ready: list[Entry], ready_keys: list[Key] | None) -> None:
    if ready:  # one block size: reserve_many gives no other
        index.table.ready([e.offset for e in ready], ready[0].entry_bytes)
        if ready_keys is not None:
            index.on_ready(ready_keys)


def abandon_layers(index, key: Key, mask: int) -> None:
    """A save's copy failed: forget those layers; drop the entry if nothing else is coming."""
    entry = index.entries[key]
    entry.pending_mask &= ~mask
    if not is_unused(entry):  # a block being written is not served: only doomed ones have refs
        return
    if entry.is_doomed or not entry.is_ready and (entry.done_mask == 0 or
                                                  entry.owner_slot == ORPHAN):
        index.drop_entry(key)
