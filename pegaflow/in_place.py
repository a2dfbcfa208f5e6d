"""A process's private memory moved into shared memory where it lies: vLLM's CPU KV cache.

vLLM's CPU build keeps its KV cache in one private anonymous mapping (all layers views of
one tensor storage), which no other process can reach.  ``share_in_place`` gives that
range to the host backend without a copy per step: it creates a segment the size of the
range's pages, copies the pages' bytes into it, and maps the segment over the range with
``MAP_FIXED``.  Every tensor keeps its address and its bytes; from then on they live in the
segment, which the engine attaches by name like any ``HostKVBuffer``:

    before:  [ page | page | ... | page ]  private anonymous (vLLM's torch storage)
    after:   [ page | page | ... | page ]  MAP_SHARED of /dev/shm/pegaflow.<uid>.cpukv.<pid>.<rand>
                                           (the same bytes, the same addresses)

The range must lie in one anonymous mapping (not the heap, not a file), so no other
object shares its pages; the move happens at registration, before vLLM runs a step, so
nothing writes the range while its bytes are copied.  The owner keeps the mapping: when
vLLM frees the storage its allocator unmaps the range, and ``HostKVBuffer.close`` unlinks
the name.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import time

from pegaflow import shm
from pegaflow.errors import LayoutError
from pegaflow.host_memory import HostKVBuffer, find_buffer

logger = logging.getLogger(__name__)


def page_span(address: int, num_bytes: int) -> tuple[int, int]:
    """The whole pages holding ``[address, +num_bytes)``: (first page's address, bytes)."""
    start = address - address % mmap.PAGESIZE
    end = -(-(address + num_bytes) // mmap.PAGESIZE) * mmap.PAGESIZE
    return start, end - start


def _mapping_of(address: int) -> tuple[int, int, str] | None:
    """This process's mapping holding ``address``: (start, end, path; "" when anonymous)."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return start, end, fields[5].strip() if len(fields) > 5 else ""
    return None


def check_movable(start: int, num_bytes: int) -> None:
    """LayoutError unless ``[start, +num_bytes)`` lies in one private anonymous mapping."""
    found = _mapping_of(start)
    if found is None or found[1] < start + num_bytes:
        raise LayoutError(f"memory at {start:#x} (+{num_bytes}) is not one mapping of this process")
    if found[2]:
        raise LayoutError(f"memory at {start:#x} is part of {found[2]}, not a private anonymous "
                          f"mapping: it cannot be moved into shared memory")


def share_in_place(address: int, num_bytes: int, what: str = "cpukv") -> HostKVBuffer:
    """Move the pages holding ``[address, +num_bytes)`` into a new ``HostKVBuffer`` mapped at
    the same address (its ``address`` is the first page's); the bytes stay as they were.
    A range already inside a live buffer is that buffer."""
    found = find_buffer(address, num_bytes)
    if found is not None:
        return found[0]
    start, span = page_span(address, num_bytes)
    check_movable(start, span)
    began = time.monotonic()
    buffer = HostKVBuffer(span, what)  # its pages reserved: no SIGBUS on a full /dev/shm later
    try:
        ctypes.memmove(buffer.segment.address(), start, span)
        shm.map_over(buffer.segment, start, span)
    except BaseException:
        buffer.close()
        raise
    buffer.address = start
    logger.info("pegaflow: %d MiB of private memory at %#x moved into shared memory %s in %.2f s",
                span >> 20, start, buffer.name, time.monotonic() - began)
    return buffer
