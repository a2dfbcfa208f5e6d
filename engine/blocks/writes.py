"""Entries being written: the layers a SAVE's copies land (or fail) and the votes that make
a block READY (``votes.py``); the pool table and the tiers are told of each block that
becomes READY."""

from __future__ import annotations

from collections.abc import Callable

from ..memory.pool_table import NoTable, PoolTable
from .entries import ORPHAN, Entry, Key, is_unused
from .eviction import LruPolicy


class Writes:
    """The index's part for entries not READY yet: it moves them from ``writing`` into the
    eviction ``policy`` once complete, and drops (``drop_entry``, the index's) the ones no
    one will finish.  ``on_ready``: the tiers told the keys that became READY, in order."""

    def __init__(self, entries: dict[Key, Entry], writing: dict[Key, Entry], policy: LruPolicy,
                 table: PoolTable | NoTable, drop_entry: Callable[[Key], None],
                 on_ready: list[Callable[[list[Key]], None]]) -> None:
        self.entries, self.writing, self.policy, self.table = entries, writing, policy, table
        self.drop_entry, self.on_ready = drop_entry, on_ready

    def mark_layers_done(self, keys: list[Key], mask: int) -> int:
        """Those layers of ``keys`` are in the pool; returns how many entries became READY."""
        entries, policy, ready = self.entries, self.policy, []
        ready_keys = [] if self.on_ready else None
        for key in keys:
            entry = entries[key]
            was_ready = entry.is_complete
            entry.pending_mask &= ~mask
            entry.done_mask |= mask
            if entry.is_doomed:  # dropped by a client meanwhile: never served
                if is_unused(entry):
                    self.drop_entry(key)
                continue
            if not was_ready and entry.is_complete:
                policy.insert(key)
                self.writing.pop(key, None)
                ready.append(entry)
                if ready_keys is not None:
                    ready_keys.append(key)
            elif entry.owner_slot == ORPHAN and not entry.pending_mask:
                self.drop_entry(key)
        self._announce_ready(ready, ready_keys)
        return len(ready)

    def mark_voted(self, keys: list[Key]) -> int:
        """A vote came for ``keys`` (their data in or on its way): those now complete become
        READY; returns how many."""
        ready, ready_keys = [], [] if self.on_ready else None
        for key in keys:
            entry = self.entries[key]
            if entry.is_doomed or not entry.is_complete or key not in self.writing:
                continue
            self.policy.insert(key)
            del self.writing[key]
            ready.append(entry)
            if ready_keys is not None:
                ready_keys.append(key)
        self._announce_ready(ready, ready_keys)
        return len(ready)

    def _announce_ready(self, ready: list[Entry], ready_keys: list[Key] | None) -> None:
        if ready:  # one block size: reserve_many gives no other
            self.table.ready([e.offset for e in ready], ready[0].entry_bytes)
            if ready_keys is not None:
                for tell in self.on_ready:
                    tell(ready_keys)

    def abandon_layers(self, key: Key, mask: int) -> None:
        """A save's copy failed: forget those layers; drop the entry if nothing else is coming."""
        entry = self.entries[key]
        entry.pending_mask &= ~mask
        if not is_unused(entry):  # a block being written is not served: only doomed ones have refs
            return
        if entry.is_doomed or not entry.is_ready and (entry.done_mask == 0 or
                                                      entry.owner_slot == ORPHAN):
            self.drop_entry(key)
