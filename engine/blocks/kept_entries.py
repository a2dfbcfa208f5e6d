"""A kept pool's entries taken into a new engine's index (``--keep-pool``).

``adopt_table`` reads the READY records the kept pool table lists into the empty index;
those beyond the pool's ready (pinned) part wait in ``index.parked``, never looked up or
copied, until ``grow`` reaches them as the pinning thread extends the pool.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Protocol

from ..memory.pool import PagePool
from ..memory.pool_table import PoolTable
from .entries import ORPHAN, Entry, Key
from .eviction import LruPolicy


class KeptIndex(Protocol):
    """What of ``engine.blocks.index.BlockIndex`` a kept pool's adoption reads and fills."""

    entries: dict[Key, Entry]
    table: PoolTable
    pool: PagePool
    policy: LruPolicy
    parked: deque

logger = logging.getLogger(__name__)


def adopt_table(index: KeptIndex) -> int:
    """Take in the READY entries a kept pool table lists (into an empty index); every
    other record, and any the pool cannot place, is cleared.  Returns how many.  Those
    beyond the pool's ready part are parked until ``grow`` reaches them."""
    assert not index.entries and index.table.is_kept
    ready = [(key, place) for key, place in index.table.ready_places().items()
             if place[2] > 0]  # a block of no layers: a record no engine writes
    taken = index.pool.adopt([(offset, size) for _, (offset, size, _) in ready])
    now, kept, parked = time.monotonic(), [], []
    ready_bytes = index.pool.bytes_ready
    for rank, ((key, (offset, size, num_layers)), ok) in enumerate(zip(ready, taken)):
        if ok:
            mask = (1 << num_layers) - 1
            entry = Entry(offset, size, mask, ORPHAN, now, done_mask=mask)
            if offset < ready_bytes:
                index.entries[key] = entry
                index.policy.insert(key)
            else:
                parked.append((offset, rank, key, entry))
            kept.append((offset, size))
    if len(kept) < len(ready):
        logger.warning("kept pool: %d of its %d READY records do not fit this pool's slabs: "
                       "not taken in", len(ready) - len(kept), len(ready))
    index.table.clear_except(kept)
    index.parked = deque(sorted(parked, key=lambda p: p[0]))
    return len(kept)


def grow(index: KeptIndex, ready_bytes: int) -> int:
    """The pool's first ``ready_bytes`` are pinned: their slabs may be allocated and the
    kept entries there served (a key saved again meanwhile keeps its new entry).
    Returns how many kept entries it took in; they rank below every entry in the
    eviction order, in their own order."""
    index.pool.grow(ready_bytes)
    limit, parked, batch = index.pool.bytes_ready, index.parked, []
    while parked and parked[0][0] < limit:  # an entry never crosses a slab's end
        batch.append(parked.popleft())
    batch.sort(key=lambda p: p[1])
    taken = []
    for _, _, key, entry in batch:
        if key in index.entries:
            index.table.free(entry.offset, entry.entry_bytes)
            index.pool.free(entry.offset)
        else:
            index.entries[key] = entry
            taken.append(key)
    index.policy.insert_oldest(taken)
    return len(taken)
