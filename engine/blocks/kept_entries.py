"""A kept pool's entries taken into a new engine's index (``--keep-pool``).

``adopt_table`` reads the READY records the kept pool table lists into the empty index;
those beyond the pool's ready (pinned) part wait in ``beyond_ready``, never looked up or
copied, until ``grow`` reaches them as the pinning thread extends the pool.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from ..memory.pool import PagePool
from ..memory.pool_table import PoolTable
from .entries import ORPHAN, Entry, Key
from .eviction import LruPolicy

logger = logging.getLogger(__name__)


class KeptEntries:
    """The index's part that takes in a kept pool: it fills the index's ``entries`` and
    eviction ``policy``, from its pool ``table``, as the ``pool`` becomes ready."""

    def __init__(self, entries: dict[Key, Entry], table: PoolTable, pool: PagePool, policy: LruPolicy) -> None:
        self.entries, self.table, self.pool, self.policy = entries, table, pool, policy
        # READY entries beyond the pool's ready part, by offset: (offset, LRU rank, key, entry)
        self.beyond_ready: deque = deque()

    def adopt_table(self) -> int:
        """Take in the READY entries a kept pool table lists (into an empty index); every
        other record, and any the pool cannot place, is cleared.  Returns how many.  Those
        beyond the pool's ready part wait until ``grow`` reaches them."""
        assert not self.entries and self.table.is_kept
        ready = [(key, place) for key, place in self.table.ready_places().items()
                 if place[2] > 0]  # a block of no layers: a record no engine writes
        taken = self.pool.adopt([(offset, size) for _, (offset, size, _) in ready])
        now, kept, beyond = time.monotonic(), [], []
        ready_bytes = self.pool.bytes_ready
        for rank, ((key, (offset, size, num_layers)), ok) in enumerate(zip(ready, taken)):
            if ok:
                mask = (1 << num_layers) - 1
                entry = Entry(offset, size, mask, ORPHAN, now, done_mask=mask)
                if offset < ready_bytes:
                    self.entries[key] = entry
                    self.policy.insert(key)
                else:
                    beyond.append((offset, rank, key, entry))
                kept.append((offset, size))
        if len(kept) < len(ready):
            logger.warning("kept pool: %d of its %d READY records do not fit this pool's slabs: "
                           "not taken in", len(ready) - len(kept), len(ready))
        self.table.clear_except(kept)
        self.beyond_ready = deque(sorted(beyond, key=lambda p: p[0]))
        return len(kept)

    def grow(self, ready_bytes: int) -> int:
        """The pool's first ``ready_bytes`` are pinned: their slabs may be allocated and the
        kept entries there served (a key saved again meanwhile keeps its new entry).
        Returns how many kept entries it took in; they rank below every entry in the
        eviction order, in their own order."""
        self.pool.grow(ready_bytes)
        limit, beyond, batch = self.pool.bytes_ready, self.beyond_ready, []
        while beyond and beyond[0][0] < limit:  # an entry never crosses a slab's end
            batch.append(beyond.popleft())
        batch.sort(key=lambda p: p[1])
        taken = []
        for _, _, key, entry in batch:
            if key in self.entries or entry.is_doomed:  # saved again meanwhile, or reset
                self.table.free(entry.offset, entry.entry_bytes)
                self.pool.free(entry.offset)
            else:
                self.entries[key] = entry
                taken.append(key)
        self.policy.insert_oldest(taken)
        return len(taken)

    def drop_namespace(self, namespace: int) -> int:
        """A RESET of ``namespace``: its entries not taken in yet never will be (their pages
        are freed once ``grow`` reaches them); returns how many."""
        num_dropped = 0
        for _, _, key, entry in self.beyond_ready:
            if key[0] == namespace and not entry.is_doomed:
                entry.is_doomed = True
                self.table.free(entry.offset, entry.entry_bytes)  # nor taken in by a next engine
                num_dropped += 1
        return num_dropped
