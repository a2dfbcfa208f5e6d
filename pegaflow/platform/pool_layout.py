"""The layout of the pool's slot table (``pool.table``, beside the pool): the engine writes
it (``engine/memory/pool_table.py``), ``pegaflow-stat`` and a kept pool's next engine read it.
Versioned on its own (``POOL_TABLE_VERSION``), apart from the client wire."""

from __future__ import annotations

from enum import IntEnum

from pegaflow.platform.wire import struct_dtype


class EntryState(IntEnum):
    """A pool table record's state: FREE records describe nothing."""

    FREE = 0
    WRITING = 1  # reserved for a key, not every layer copied yet
    READY = 2    # every layer of the key's block is in the pool at ``offset``


POOL_TABLE_VERSION = 1

# The pool's slot table, beside the pool: one record per place an entry can take, so that
# what the pool holds (and where) can be read without the engine's memory.  Record
# ``slab * records_per_slab + i`` describes entry ``i`` of slab ``slab``.
POOL_TABLE_HEADER = struct_dtype([
    ("magic", "<u8", 0),
    ("version", "<u4", 8),
    ("pool_bytes", "<u8", 16),
    ("slab_bytes", "<u8", 24),
    ("records_per_slab", "<u8", 32),
    ("num_records", "<u8", 40),
], 64)

POOL_RECORD = struct_dtype([
    ("offset", "<u8", 0),        # byte offset of the entry in the pool segment
    ("entry_bytes", "<u8", 8),   # every layer of one block: num_layers * page_bytes
    ("namespace", "<u8", 16),
    ("state", "u1", 24),         # EntryState
    ("key", "S33", 25),          # the block hash as the index keys it: digest, then length
    ("num_layers", "<u2", 58),   # layers of the block (all of them are in the pool when READY)
    ("last_used", "<u8", 64),    # the table's touch count when it was last used (lookups, saves)
], 72)

assert POOL_TABLE_HEADER.itemsize == 64
assert POOL_RECORD.itemsize == 72
