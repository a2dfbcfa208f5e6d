"""engine/memory/fault_in.py: a segment's range faulted in, every page allocated, its bytes kept,
by MADV_POPULATE_WRITE or (without it) fallocate and a write per page; a /dev/shm that
cannot hold it is a ShmError, never a SIGBUS."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from engine.memory import fault_in
from pegaflow.platform import shm
from pegaflow.platform.errors import ShmError

SIZE = 8 << 20


@pytest.fixture
def segment():
    seg = shm.create_segment(f"/pegaflow.{os.getuid()}.faultin{os.getpid()}", SIZE)
    yield seg
    seg.close()
    seg.unlink()


def allocated_bytes(seg: shm.Segment) -> int:
    return os.stat(f"/dev/shm/{seg.name.lstrip('/')}").st_blocks * 512


def written(seg: shm.Segment) -> np.ndarray:
    """Some bytes written before the fault-in (a kept pool's), the rest never touched."""
    data = np.random.default_rng(1).integers(0, 256, 3 << 20, dtype=np.uint8)
    seg.array(np.uint8, len(data), 1 << 20)[:] = data
    return data


@pytest.mark.skipif(fault_in.method() != fault_in.POPULATE,
                    reason="this kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
def test_fault_in_populate_allocates_every_page_and_keeps_the_bytes(segment):
    data = written(segment)
    assert allocated_bytes(segment) < SIZE
    # 1. Faulted in by three threads: every page allocated, the written bytes unchanged,
    #    the others zero.
    assert fault_in.fault_in(segment, 0, SIZE, 3) == fault_in.POPULATE
    assert allocated_bytes(segment) == SIZE
    view = segment.array(np.uint8, SIZE)
    assert np.array_equal(view[1 << 20:(1 << 20) + len(data)], data)
    assert not view[:1 << 20].any() and not view[(1 << 20) + len(data):].any()
    del view


def test_fault_in_without_populate_falls_back_to_fallocate_and_a_write_per_page(segment, monkeypatch):
    # 1. A kernel without MADV_POPULATE_WRITE answers EINVAL.
    monkeypatch.setitem(fault_in._state, "has_populate", True)
    monkeypatch.setattr(fault_in, "_madvise", lambda address, n, advice: errno.EINVAL)
    data = written(segment)
    # 2. The range is faulted in all the same, by the fallback, which is used from then on.
    assert fault_in.fault_in(segment, 2 << 20, SIZE - (2 << 20), 2) == fault_in.TOUCH
    assert fault_in.method() == fault_in.TOUCH
    assert allocated_bytes(segment) >= SIZE - (2 << 20)
    assert np.array_equal(segment.array(np.uint8, len(data), 1 << 20), data)


def test_fault_in_full_dev_shm_is_a_shm_error_that_says_so(segment, monkeypatch):
    # 1. MADV_POPULATE_WRITE meets a page /dev/shm cannot back: EFAULT (where a write
    #    would have raised SIGBUS).
    monkeypatch.setitem(fault_in._state, "has_populate", True)
    monkeypatch.setattr(fault_in, "_madvise", lambda address, n, advice: errno.EFAULT)
    with pytest.raises(ShmError, match=r"/dev/shm cannot hold 4\.0 MiB at 2\.0 MiB into .*free"):
        fault_in.fault_range(segment, 2 << 20, 4 << 20)
    # 2. The fallback's fallocate refused (ENOSPC): a ShmError too, before any page is touched.
    monkeypatch.setitem(fault_in._state, "has_populate", False)

    def no_space(fd, start, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shm.os, "posix_fallocate", no_space)
    with pytest.raises(ShmError, match="cannot hold 2 MiB into it, 4 MiB"):
        fault_in.fault_range(segment, 2 << 20, 4 << 20)
    assert allocated_bytes(segment) == 0


def test_fault_in_split_covers_the_range_in_aligned_parts():
    parts = fault_in.split(64 << 20, 37 << 20, 4)
    assert parts[0][0] == 64 << 20 and sum(n for _, n in parts) == 37 << 20
    assert all(start % fault_in.PART_ALIGN == 0 for start, _ in parts) and len(parts) <= 4
    assert [start + n for start, n in parts[:-1]] == [start for start, _ in parts[1:]]
    assert fault_in.split(0, 1 << 20, 8) == [(0, 1 << 20)]


def test_fault_in_huge_page_bytes_of_a_mapped_segment_is_a_number(segment):
    fault_in.advise_huge_pages(segment)
    fault_in.fault_in(segment, 0, SIZE, 1)
    assert 0 <= fault_in.huge_page_bytes(segment) <= SIZE
