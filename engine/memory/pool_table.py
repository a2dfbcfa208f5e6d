"""The pool's slot table: what every pool entry holds, kept in shared memory beside the pool.

The index lives in the engine's memory; this table records the same facts in the
``pool.table`` segment (``pegaflow/platform/pool_layout.py``): for each
place an entry can take, its offset, size, key, layers, state (FREE, WRITING, READY) and,
with --keep-pool, when it was last used.  A process that maps the pool and the table can
find every READY block without the engine (a test does), and an engine started over a
kept pool takes them in (``BlockIndex.adopt_table``).

Record ``slab * records_per_slab + i`` describes entry ``i`` of slab ``slab`` (entry ``i``
starts ``i * entry_bytes`` into its slab), so a slab holds at most ``records_per_slab``
entries: one per 4 KiB of slab, and at most ``MAX_RECORDS`` in all (entries of 32 KiB or
more fill a 64 GiB pool; a slab of smaller entries holds ``records_per_slab`` of them).
The index updates the table as it changes, a chunk of entries at a time.
"""

from __future__ import annotations

import numpy as np

from pegaflow.platform.pool_layout import POOL_RECORD, POOL_TABLE_HEADER, POOL_TABLE_VERSION, EntryState
from pegaflow.platform.wire import MAGIC

MAX_RECORDS = 1 << 21      # 144 MiB of records at most
MIN_ENTRY_BYTES = 4096     # a record per 4 KiB of slab at most: the table stays under 1/56 of the pool


def records_per_slab(pool_bytes: int, slab_bytes: int) -> int:
    num_slabs = max(1, pool_bytes // slab_bytes)
    return max(1, min(slab_bytes // MIN_ENTRY_BYTES, MAX_RECORDS // num_slabs))


def table_bytes(pool_bytes: int, slab_bytes: int) -> int:
    num_slabs = pool_bytes // slab_bytes
    return POOL_TABLE_HEADER.itemsize + num_slabs * records_per_slab(pool_bytes, slab_bytes) * \
        POOL_RECORD.itemsize


class PoolTable:
    """The records of one pool, over a buffer of ``table_bytes`` (a shared-memory segment's,
    or a private one).  A new table starts empty; ``keep=True`` keeps the records of a table
    written for the same pool geometry (``mismatch`` says whether it was)."""

    def __init__(self, buffer, pool_bytes: int, slab_bytes: int, keep: bool = False):
        self.slab_bytes = slab_bytes
        self.records_per_slab = records_per_slab(pool_bytes, slab_bytes)
        num_records = (pool_bytes // slab_bytes) * self.records_per_slab
        self.header = np.frombuffer(buffer, POOL_TABLE_HEADER, 1)
        self.records = np.frombuffer(buffer, POOL_RECORD, num_records, POOL_TABLE_HEADER.itemsize)
        expected = np.array((MAGIC, POOL_TABLE_VERSION, pool_bytes, slab_bytes,
                             self.records_per_slab, num_records), POOL_TABLE_HEADER)[()]
        self._state = self.records["state"]  # a view: one entry's state is set without fancy indexing
        if keep and self.header[0] == expected:
            self._touches = int(self.records["last_used"].max(initial=0)) + 1
            return
        if int(self.header[0]["magic"]):  # a fresh segment or buffer is all zeros already
            self.records[:] = np.zeros(1, POOL_RECORD)
        self.header[0] = expected
        self._touches = 1

    @staticmethod
    def mismatch(buffer, pool_bytes: int, slab_bytes: int) -> str | None:
        """Why a kept table does not describe a pool of this geometry (None if it does)."""
        header = np.frombuffer(buffer, POOL_TABLE_HEADER, 1)[0]
        if int(header["magic"]) != MAGIC or int(header["version"]) != POOL_TABLE_VERSION:
            return "its table is not one this version writes"
        kept = (int(header["pool_bytes"]), int(header["slab_bytes"]))
        if kept != (pool_bytes, slab_bytes):
            return (f"it was a {kept[0]}-byte pool of {kept[1]}-byte slabs, this one is "
                    f"{pool_bytes} bytes of {slab_bytes}-byte slabs")
        return None

    @classmethod
    def private(cls, pool_bytes: int, slab_bytes: int) -> "PoolTable":
        return cls(bytearray(table_bytes(pool_bytes, slab_bytes)), pool_bytes, slab_bytes)

    def _where(self, offsets, entry_bytes) -> np.ndarray:
        """Record positions of entries at ``offsets`` of ``entry_bytes`` (one size, or one each)."""
        offsets = np.asarray(offsets, np.int64)
        slab, within = np.divmod(offsets, self.slab_bytes)
        return slab * self.records_per_slab + within // np.asarray(entry_bytes, np.int64)

    def touched(self, offsets: list[int], sizes: list[int]) -> None:
        """These entries were used, in this order (the last most recently): the order a
        kept pool's blocks enter the eviction order again."""
        if offsets:
            at = self._where(offsets, sizes)
            self.records["last_used"][at] = np.arange(self._touches, self._touches + len(at))
            self._touches += len(at)

    def writing(self, offsets: list[int], entry_bytes: int, keys: list[tuple[int, bytes]],
                num_layers: int) -> None:
        """These entries were just reserved for ``keys`` (the index's (namespace, hash))."""
        if not offsets:
            return
        records = self.records
        at = self._where(offsets, entry_bytes)
        records["offset"][at] = offsets
        records["entry_bytes"][at] = entry_bytes
        records["num_layers"][at] = num_layers
        records["namespace"][at] = [namespace for namespace, _ in keys]
        records["key"][at] = [key for _, key in keys]
        records["state"][at] = EntryState.WRITING

    def ready(self, offsets: list[int], entry_bytes: int) -> None:
        if offsets:
            self.records["state"][self._where(offsets, entry_bytes)] = EntryState.READY

    def free(self, offset: int, entry_bytes: int) -> None:
        """One entry, on every eviction: plain integer arithmetic."""
        slab, within = divmod(offset, self.slab_bytes)
        self._state[slab * self.records_per_slab + within // entry_bytes] = EntryState.FREE


    is_kept = True  # a table that records (NoTable: one that does nothing)

    def ready_places(self) -> dict[tuple[int, bytes], tuple[int, int, int]]:
        """``read_ready`` of this table, less any record that is not where its offset and
        size put it (a record no engine wrote)."""
        records = self.records
        where = np.flatnonzero(records["state"] == EntryState.READY)
        ready = records[where]
        sizes = ready["entry_bytes"].astype(np.int64)
        ok = sizes > 0
        expected = np.full(len(where), -1, np.int64)
        expected[ok] = self._where(ready["offset"][ok].astype(np.int64), sizes[ok])
        return read_ready(ready[expected == where])

    def clear_except(self, entries: list[tuple[int, int]]) -> None:
        """Every record FREE but those of these ``(offset, entry_bytes)`` entries."""
        keep = np.zeros(len(self.records), bool)
        for size in {size for _, size in entries}:
            keep[self._where([o for o, s in entries if s == size], size)] = True
        self.records["state"][~keep] = EntryState.FREE


def read_ready(records: np.ndarray) -> dict[tuple[int, bytes], tuple[int, int, int]]:
    """(namespace, key) -> (offset, entry_bytes, num_layers) of every READY record, least
    recently used first."""
    ready = records[records["state"] == EntryState.READY]
    ready = ready[np.argsort(ready["last_used"], kind="stable")]
    return {(int(r["namespace"]), bytes(r["key"])):
            (int(r["offset"]), int(r["entry_bytes"]), int(r["num_layers"])) for r in ready}


class NoTable:
    """The pool table of an engine without --keep-pool (and of unit tests): records nothing,
    so the index calls it unconditionally."""

    is_kept = False

    def touched(self, offsets, sizes) -> None:
        pass

    def writing(self, offsets, entry_bytes, keys, num_layers) -> None:
        pass

    def ready(self, offsets, entry_bytes) -> None:
        pass

    def free(self, offset, entry_bytes) -> None:
        pass

    def ready_places(self) -> dict:
        return {}
