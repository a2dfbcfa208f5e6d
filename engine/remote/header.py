"""What the remote store holds per block, under two names::

    pegaflow/<namespace:016x>/<key hex>        the entry's bytes, then HEADER (64 bytes)
    pegaflow/<namespace:016x>/<key hex>/h      HEADER alone

    offset  field        what
    0       magic        b"PFRB"
    4       version      HEADER_VERSION
    6       num_layers   the entry's layers (all of them are in: only READY blocks are put)
    8       entry_bytes  the entry's length (the data object is 64 bytes longer)
    16      checksum     xxh3_64 of the entry's bytes
    24      namespace    the key's namespace (checked on fetch, with key_digest)
    32      key_digest   xxh3_64 of the key's hash bytes
    40      (zero)

The data object is put from two places at once, the pool entry in place and the header
from the publish thread's registered slots, and fetched the same way (the entry straight
into a reserved pool entry): its header travels with the bytes it vouches for.  A lookup
asks the master which data objects exist (one RPC for all the keys after its local prefix)
and reads the header object of the first only, for the run's block size; each fetched
block's own header is checked (key, length, checksum) before the entry is READY.  The
header object is put after its data object.
"""

from __future__ import annotations

import numpy as np
import xxhash

from ..blocks.entries import Key

MAGIC = int.from_bytes(b"PFRB", "little")
HEADER_VERSION = 1
HEADER_BYTES = 64
HEADER = np.dtype({"names": ["magic", "version", "num_layers", "entry_bytes", "checksum", "namespace",
                             "key_digest"],
                   "formats": ["<u4", "<u2", "<u2", "<u8", "<u8", "<u8", "<u8"],
                   "offsets": [0, 4, 6, 8, 16, 24, 32], "itemsize": HEADER_BYTES})
PREFIX = "pegaflow"
_U64 = (1 << 64) - 1

assert HEADER.itemsize == HEADER_BYTES


def data_name(key: Key) -> str:
    return f"{PREFIX}/{key[0] & _U64:016x}/{key[1].hex()}"


def header_name(key: Key) -> str:
    return data_name(key) + "/h"


def checksum(data) -> int:
    return xxhash.xxh3_64_intdigest(data)


def write_header(slot: np.ndarray, key: Key, entry_bytes: int, num_layers: int, data_checksum: int) -> None:
    """Fill ``slot`` (HEADER_BYTES uint8) with the header of ``key``'s block."""
    record = slot.view(HEADER)
    record[0] = (MAGIC, HEADER_VERSION, num_layers, entry_bytes, data_checksum, key[0] & _U64,
                 xxhash.xxh3_64_intdigest(key[1]))


def read_header(slot: np.ndarray, key: Key) -> tuple[int, int, int] | None:
    """(entry_bytes, num_layers, checksum) from the header in ``slot``, or None if it is not
    a header of ``key``'s block (another key's, another version, damaged)."""
    record = slot.view(HEADER)[0]
    if int(record["magic"]) != MAGIC or int(record["version"]) != HEADER_VERSION \
            or int(record["namespace"]) != key[0] & _U64 \
            or int(record["key_digest"]) != xxhash.xxh3_64_intdigest(key[1]):
        return None
    return int(record["entry_bytes"]), int(record["num_layers"]), int(record["checksum"])
