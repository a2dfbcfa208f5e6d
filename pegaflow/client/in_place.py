"""A process's private memory moved into shared memory where it lies: vLLM's CPU KV cache.

vLLM's CPU build keeps its KV cache in one private anonymous mapping (all layers views of
one tensor storage), which no other process can reach.  ``share_in_place`` gives that
range to the host backend without a copy per step: it creates a segment the size of the
range's pages, copies the pages' bytes into it, and maps the segment over the range with
``MAP_FIXED``.  Every tensor keeps its address and its bytes; from then on they live in the
segment, which the engine attaches by name like any ``HostKVBuffer``:

    before:  [ page | page | ... | page ]  private anonymous (vLLM's torch storage)
    after:   [ page | page | ... | page ]  MAP_SHARED of /dev/shm/pegaflow.<uid>.<engine>.cpukv.<pid>.<rand>
                                           (the same bytes, the same addresses)

The range must be private anonymous memory (not the heap, not a file): malloc maps an
allocation that large on its own, so no other object shares its pages.  The move happens at
registration, before vLLM runs a step, so nothing writes the range while its bytes are
copied.  The owner keeps the mapping: when
vLLM frees the storage its allocator unmaps the range, and ``HostKVBuffer.close`` unlinks
the name.  A worker killed before it could leaves the segment behind, named for the engine
and the worker (``pegaflow/platform/in_place_segments.py``): the next worker of that engine to
move its cache removes those whose worker is gone, so do the engine's start and
``pegaflow-engine --clean``, and ``pegaflow-stat`` lists them.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import time

import numpy as np

from pegaflow.client.host_memory import HostKVBuffer, find_buffer
from pegaflow.platform import in_place_segments, shm
from pegaflow.platform.errors import LayoutError

logger = logging.getLogger(__name__)


def page_span(address: int, num_bytes: int) -> tuple[int, int]:
    """The whole pages holding ``[address, +num_bytes)``: (first page's address, bytes)."""
    start = address - address % mmap.PAGESIZE
    end = -(-(address + num_bytes) // mmap.PAGESIZE) * mmap.PAGESIZE
    return start, end - start


def _mappings_over(start: int, end: int) -> list[tuple[int, int, str]]:
    """This process's mappings overlapping ``[start, end)``: (start, end, path; "" when
    private anonymous), in address order."""
    found = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low < end and start < high:
                path = fields[5].strip() if len(fields) > 5 else ""
                found.append((low, high, path or ("" if fields[1].endswith("p") else "shared memory")))
    return found


def check_movable(start: int, num_bytes: int) -> None:
    """LayoutError unless ``[start, +num_bytes)`` is private anonymous memory, mapped without
    a gap (one mapping, or several where madvise split it, e.g. for huge pages)."""
    end, covered = start + num_bytes, start
    for low, high, path in _mappings_over(start, end):
        if path:
            raise LayoutError(f"memory at {start:#x} is part of {path}, not a private anonymous "
                              f"mapping: it cannot be moved into shared memory")
        if low > covered:
            break
        covered = high
    if covered < end:
        raise LayoutError(f"memory at {start:#x} (+{num_bytes}) is not all mapped in this process")


def share_in_place(address: int, num_bytes: int, engine_name: str = "pegaflow") -> HostKVBuffer:
    """Move the pages holding ``[address, +num_bytes)`` into a new ``HostKVBuffer`` mapped at
    the same address (its ``address`` is the first page's), named for engine ``engine_name``
    and this process; the bytes stay as they were.  A range already inside a live buffer is
    that buffer."""
    found = find_buffer(address, num_bytes)
    if found is not None:
        return found[0]
    start, span = page_span(address, num_bytes)
    check_movable(start, span)
    remove_orphans(engine_name)
    began = time.monotonic()
    # its pages reserved: no SIGBUS on a full /dev/shm later
    buffer = HostKVBuffer(span, in_place_segments.buffer_tag(engine_name))
    try:
        # span bytes onto span bytes, shapes checked: never a byte past the segment
        buffer.data[:] = np.ctypeslib.as_array((ctypes.c_uint8 * span).from_address(start))
        shm.map_over(buffer.segment, start, span)
    except BaseException:
        buffer.close()
        raise
    buffer.address = start
    logger.info("pegaflow: %d MiB of private memory at %#x moved into shared memory %s in %.2f s",
                span >> 20, start, buffer.name, time.monotonic() - began)
    return buffer


def remove_orphans(engine_name: str) -> int:
    """Unlink the in-place segments of engine ``engine_name``'s workers that are gone (each a
    whole KV cache of /dev/shm); how many.  A live worker's are never touched."""
    removed = in_place_segments.remove_orphans(engine_name)
    if removed:
        logger.info("pegaflow: removed %d KV cache segment(s) (%d MiB) of CPU workers that are gone",
                    len(removed), sum(s.num_bytes for s in removed) >> 20)
    return len(removed)
