"""The page pool: where block entries live in the pinned host segment.

Mechanism only (no policy): the pool is cut into slabs of ``slab_bytes``; a slab serves
one entry size at a time (one entry = every layer of one block, ``num_layers *
page_bytes``), so engines serving several models do not fragment.  A slab whose
entries are all free goes back to the shared free list.  Entry ids are byte offsets
into the pool segment.  Which entry to give up when full is the index's and the
eviction policy's business, not the pool's.

Only the pool's first ``bytes_ready`` (whole slabs) are handed out: the engine pins the
pool a chunk at a time while it serves (``engine/memory/pinning.py``), and ``grow`` extends the
ready part as chunks are pinned.  A slab beyond it is never given out, nor a free place of
a kept slab there (``adopt``), until it is ready.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pegaflow.platform.errors import ConfigError

logger = logging.getLogger(__name__)


def slab_advice(num_slabs: int) -> str:
    """What to change for larger blocks: the slab, or the pool too where one slab is all of it."""
    return "raise --slab-size" if num_slabs > 1 else \
        "raise --pool-size (a slab is at most the pool), and --slab-size if it is set"


@dataclass(slots=True)
class _Slab:
    entry_bytes: int
    free_places: list[int] = field(default_factory=list)
    num_used: int = 0


class PagePool:
    def __init__(self, pool_bytes: int, slab_bytes: int, max_per_slab: int | None = None,
                 ready_bytes: int | None = None):
        """``max_per_slab``: the most entries a slab may hold (the pool table's records);
        ``ready_bytes``: how much of the pool may be handed out now (None: all of it)."""
        self.slab_bytes = slab_bytes
        self.max_per_slab = max_per_slab
        self.num_slabs = pool_bytes // slab_bytes
        self.num_ready_slabs = self.num_slabs if ready_bytes is None else \
            min(self.num_slabs, ready_bytes // slab_bytes)
        self._free_slabs = list(range(self.num_ready_slabs - 1, -1, -1))
        self._slabs: dict[int, _Slab] = {}
        self._partial: dict[int, set[int]] = {}  # entry_bytes -> slabs with a free place
        self.bytes_used = 0
        self.num_entries = 0
        self._capped: set[int] = set()  # entry sizes told about max_per_slab

    @property
    def bytes_total(self) -> int:
        return self.num_slabs * self.slab_bytes

    @property
    def bytes_ready(self) -> int:
        """The pool's first bytes that may be handed out (whole slabs)."""
        return self.num_ready_slabs * self.slab_bytes

    def grow(self, ready_bytes: int) -> None:
        """The pool's first ``ready_bytes`` (whole slabs) may be handed out from now on."""
        old, new = self.num_ready_slabs, min(self.num_slabs, ready_bytes // self.slab_bytes)
        if new <= old:
            return
        fresh = []
        for slab_id in range(old, new):
            slab = self._slabs.get(slab_id)
            if slab is None:
                fresh.append(slab_id)
            elif slab.free_places:  # a kept slab: its free places may be taken now
                self._partial[slab.entry_bytes].add(slab_id)
        self._free_slabs[:0] = fresh[::-1]  # taken after the slabs free already, lowest first
        self.num_ready_slabs = new

    def check_entry_bytes(self, entry_bytes: int) -> None:
        if not 0 < entry_bytes <= self.slab_bytes:
            raise ConfigError(f"a block of {entry_bytes} bytes does not fit a "
                              f"{self.slab_bytes}-byte slab: {slab_advice(self.num_slabs)}")

    def try_alloc(self, entry_bytes: int) -> int | None:
        """Offset of a free entry of ``entry_bytes``, or None when the pool is full."""
        offsets = self.alloc_many(entry_bytes, 1)
        return offsets[0] if offsets else None

    def alloc_many(self, entry_bytes: int, count: int) -> list[int]:
        """Offsets of up to ``count`` free entries (fewer when the pool runs out)."""
        self.check_entry_bytes(entry_bytes)
        partial = self._partial.setdefault(entry_bytes, set())
        offsets: list[int] = []
        while len(offsets) < count:
            if not partial:
                if not self._free_slabs:
                    break
                slab_id = self._free_slabs.pop()
                per_slab = self._per_slab(entry_bytes)
                self._slabs[slab_id] = _Slab(entry_bytes, list(range(per_slab - 1, -1, -1)))
                partial.add(slab_id)
            slab_id = next(iter(partial))
            slab = self._slabs[slab_id]
            take = min(count - len(offsets), len(slab.free_places))
            base = slab_id * self.slab_bytes
            offsets.extend(base + i * entry_bytes for i in slab.free_places[-take:][::-1])
            del slab.free_places[-take:]
            slab.num_used += take
            if not slab.free_places:
                partial.discard(slab_id)
        self.bytes_used += len(offsets) * entry_bytes
        self.num_entries += len(offsets)
        return offsets

    def adopt(self, entries: list[tuple[int, int]]) -> list[bool]:
        """Mark ``(offset, entry_bytes)`` entries in use, as a kept pool holds them (only into
        a pool that has allocated nothing yet); returns which were taken.  An entry is refused
        where it could not have been allocated: off an entry boundary, past its slab's
        entries, a second size in one slab, or twice.  The free places of a slab beyond the
        ready part are handed out once ``grow`` reaches it."""
        assert self.num_entries == 0, "adopt into an empty pool only"
        taken, used = [], {}  # slab id -> (entry_bytes, set of indices)
        for offset, entry_bytes in entries:
            slab_id, within = divmod(offset, self.slab_bytes)
            index, rest = divmod(within, entry_bytes) if 0 < entry_bytes <= self.slab_bytes \
                else (0, 1)
            size, indices = used.get(slab_id, (entry_bytes, set()))
            ok = (0 <= slab_id < self.num_slabs and rest == 0 and size == entry_bytes
                  and index < self._per_slab(entry_bytes) and index not in indices)
            if ok:
                indices.add(index)
                used[slab_id] = (size, indices)
            taken.append(ok)
        for slab_id, (entry_bytes, indices) in used.items():
            free = [i for i in range(self._per_slab(entry_bytes) - 1, -1, -1) if i not in indices]
            self._slabs[slab_id] = _Slab(entry_bytes, free, len(indices))
            partial = self._partial.setdefault(entry_bytes, set())  # free() expects the size
            if free and slab_id < self.num_ready_slabs:
                partial.add(slab_id)
            self.bytes_used += len(indices) * entry_bytes
            self.num_entries += len(indices)
        self._free_slabs = [i for i in self._free_slabs if i not in self._slabs]
        return taken

    def _per_slab(self, entry_bytes: int) -> int:
        per_slab = self.slab_bytes // entry_bytes
        if self.max_per_slab is not None and per_slab > self.max_per_slab:
            if entry_bytes not in self._capped:
                self._capped.add(entry_bytes)
                logger.warning("%d-byte blocks: a %d-byte slab holds %d of them (its pool "
                               "table's records), not %d", entry_bytes, self.slab_bytes,
                               self.max_per_slab, per_slab)
            return self.max_per_slab
        return per_slab

    def free(self, offset: int) -> None:
        slab_id, within = divmod(offset, self.slab_bytes)
        slab = self._slabs[slab_id]
        index, rest = divmod(within, slab.entry_bytes)
        assert rest == 0, f"entry offset {offset} is not on an entry boundary"
        slab.free_places.append(index)
        slab.num_used -= 1
        self.bytes_used -= slab.entry_bytes
        self.num_entries -= 1
        partial = self._partial[slab.entry_bytes]
        if slab.num_used == 0:
            partial.discard(slab_id)
            del self._slabs[slab_id]
            self._free_slabs.append(slab_id)
        else:
            partial.add(slab_id)
