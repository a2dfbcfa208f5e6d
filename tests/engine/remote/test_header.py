"""engine/remote/header.py: a block's header, written into a slot, reads back as written for
its own key only (not another key's, namespace's or version's, nor a damaged one); each
block's two objects are named by its namespace and key."""

from __future__ import annotations

import numpy as np
import pytest

from engine.remote.header import (
    HEADER_BYTES,
    checksum,
    data_name,
    header_name,
    read_header,
    write_header,
)

KEY = (7, bytes(range(33)))


def _written(key=KEY) -> np.ndarray:
    slot = np.zeros(HEADER_BYTES, np.uint8)
    write_header(slot, key, entry_bytes=4096, num_layers=3, data_checksum=checksum(b"block"))
    return slot


def test_header_reads_back_as_written_for_its_own_key():
    assert read_header(_written(), KEY) == (4096, 3, checksum(b"block"))
    # A namespace past 63 bits (the client's is a u64 on the wire) keys the same header.
    assert read_header(_written((-1, KEY[1])), ((1 << 64) - 1, KEY[1])) == (4096, 3, checksum(b"block"))


@pytest.mark.parametrize("other", [(8, KEY[1]), (7, bytes(33)), (7, KEY[1][:-1])],
                         ids=["namespace", "key", "length"])
def test_header_of_another_key_reads_as_none(other):
    assert read_header(_written(), other) is None


@pytest.mark.parametrize("byte,what", [(0, "magic"), (4, "version")])
def test_header_damaged_or_of_another_version_reads_as_none(byte, what):
    slot = _written()
    slot[byte] ^= 0xFF
    assert read_header(slot, KEY) is None, what


def test_header_names_carry_namespace_and_key_and_differ():
    assert data_name(KEY) == f"pegaflow/{7:016x}/{KEY[1].hex()}"
    assert header_name(KEY) == data_name(KEY) + "/h"
    assert data_name((8, KEY[1])) != data_name(KEY) and data_name((7, bytes(33))) != data_name(KEY)
    assert data_name((-1, KEY[1])) == data_name(((1 << 64) - 1, KEY[1]))
