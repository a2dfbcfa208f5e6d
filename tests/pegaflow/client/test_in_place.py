"""Private memory moved into shared memory where it lies: same address, same bytes, shared."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys

import numpy as np
import pytest

from pegaflow.client.host_memory import find_buffer
from pegaflow.client.in_place import page_span, remove_orphans, share_in_place
from pegaflow.platform import shm
from pegaflow.platform.errors import LayoutError

NUM_BYTES = 40 << 20 | 123  # not whole pages: the span rounds out to them
HEADER_BYTES = 16  # the array starts into its first page, as after malloc's chunk header
GUARD_BYTES = 1 << 20  # private memory on each side of the array's pages
ENGINE = "inplacetest"


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


@pytest.fixture
def mapping():
    """A private anonymous mapping of random bytes, larger than the array moved out of it
    (``GUARD_BYTES`` each side): a copy off by an offset reads or writes its neighbours,
    never unmapped memory, so it shows as bytes compared, not as a crash.  (mapping, its
    bytes before)."""
    mapped = mmap.mmap(-1, 2 * GUARD_BYTES + HEADER_BYTES + NUM_BYTES + mmap.PAGESIZE, flags=mmap.MAP_PRIVATE)
    whole = np.frombuffer(mapped, dtype=np.uint8)
    whole[:] = np.random.default_rng(3).integers(0, 256, whole.size, dtype=np.uint8)
    yield whole, whole.copy()
    # (the mapping goes with its last view: the range moved in place included)


@pytest.fixture
def private(mapping):
    """The array a vLLM CPU worker's KV cache stands for: private anonymous memory, starting
    past a header in its first page; (array, its bytes before)."""
    whole, before = mapping
    at = GUARD_BYTES + HEADER_BYTES
    yield whole[at:at + NUM_BYTES], before[at:at + NUM_BYTES]


@pytest.fixture
def shared(private):
    """``private``'s memory moved in place: (array, its bytes before, the buffer), closed after."""
    array, before = private
    buffer = share_in_place(_address(array), array.nbytes, ENGINE)
    yield array, before, buffer
    buffer.close()


def test_in_place_move_keeps_every_byte_where_it_was(mapping):
    # 1. The array's pages (and the header and neighbours on them) moved in place.
    whole, before = mapping
    array = whole[GUARD_BYTES + HEADER_BYTES:GUARD_BYTES + HEADER_BYTES + NUM_BYTES]
    buffer = share_in_place(_address(array), array.nbytes, ENGINE)
    try:
        # 2. Every byte of the mapping, moved or not, is what it was: none shifted, none lost.
        moved = slice(buffer.address - _address(whole), buffer.address - _address(whole) + buffer.num_bytes)
        differ = np.flatnonzero(whole != before)
        assert differ.size == 0, (f"{differ.size} bytes differ after the move, the first at {differ[0]} "
                                  f"(the moved pages are [{moved.start}, {moved.stop}))")
        # 3. The segment holds the same bytes at the same offsets.
        assert np.array_equal(buffer.data, before[moved]), "the segment's bytes are not the moved pages'"
    finally:
        buffer.close()


def test_in_place_private_array_keeps_its_bytes_and_address(shared):
    array, before, buffer = shared
    # 1. Nothing moved for the array's owner: same address, every byte as it was.
    assert np.array_equal(array, before)
    start, span = page_span(_address(array), array.nbytes)
    assert buffer.address == start and buffer.num_bytes == span
    # 2. The segment's own mapping holds the same bytes (the array's offset in it)...
    offset = _address(array) - start
    assert np.array_equal(buffer.data[offset:offset + array.nbytes], before)
    # 3. ...and is the same memory: a write on either side shows on the other.
    array[17] ^= 0xFF
    assert buffer.data[offset + 17] == array[17]
    buffer.data[offset + NUM_BYTES - 1] ^= 0x0F
    assert array[-1] == before[-1] ^ 0x0F


def test_in_place_memory_is_readable_by_another_process(shared):
    array, _, buffer = shared
    offset = _address(array) - buffer.address
    array[:4] = [1, 2, 3, 4]
    array[-4:] = [9, 8, 7, 6]
    # Another process attaches the segment by name: it reads what the owner wrote.
    code = ("import sys, numpy as np; from pegaflow.platform import shm; "
            "s = shm.attach_segment(sys.argv[1]); d = s.array(np.uint8, s.size); o, n = int(sys.argv[2]), "
            "int(sys.argv[3]); print(d[o:o + 4].tolist() + d[o + n - 4:o + n].tolist())")
    out = subprocess.run([sys.executable, "-c", code, buffer.name, str(offset), str(NUM_BYTES)],
                         check=True, capture_output=True, text=True).stdout
    assert out == "[1, 2, 3, 4, 9, 8, 7, 6]\n"


def test_in_place_range_already_shared_is_the_same_buffer(shared):
    array, _, buffer = shared
    assert share_in_place(_address(array) + 4096, 100, ENGINE) is buffer
    assert find_buffer(_address(array), array.nbytes)[0] is buffer


def test_in_place_closed_buffer_unlinks_its_name_and_the_memory_stays(private):
    array, before = private
    buffer = share_in_place(_address(array), array.nbytes, ENGINE)
    name = buffer.name
    buffer.close()
    # The name is gone (nothing leaks in /dev/shm); the owner's memory is still its own.
    assert not shm.unlink_segment(name)
    assert find_buffer(_address(array), array.nbytes) is None
    assert np.array_equal(array, before)
    array[:] = 5
    assert int(array.sum()) == 5 * NUM_BYTES


def test_in_place_file_mapping_is_refused_and_left_alone(tmp_path):
    path = tmp_path / "file"
    path.write_bytes(b"\x07" * mmap.PAGESIZE * 2)
    with open(path, "r+b") as f:
        mapped = mmap.mmap(f.fileno(), 0)
    view = np.frombuffer(mapped, dtype=np.uint8)
    with pytest.raises(LayoutError, match="not a private anonymous mapping"):
        share_in_place(_address(view), view.nbytes, ENGINE)
    assert find_buffer(_address(view), view.nbytes) is None
    assert bool((view == 7).all())
    del view
    mapped.close()


def test_in_place_segments_of_processes_gone_are_removed_and_live_ones_kept():
    # 1. A process that is gone (exited and reaped) and this live one each left a segment.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    prefix = f"/pegaflow.{os.getuid()}.{ENGINE}.cpukv"
    orphan = shm.create_segment(f"{prefix}.{gone.pid}.0000abcd", 4096)
    mine = shm.create_segment(f"{prefix}.{os.getpid()}.0000abcd", 4096)
    try:
        # 2. The orphan goes; the live process's (it maps it) stays.
        assert remove_orphans(ENGINE) == 1
        assert not shm.unlink_segment(orphan.name)
        assert shm.unlink_segment(mine.name)
    finally:
        for segment in (orphan, mine):
            segment.close()
            shm.unlink_segment(segment.name)
