"""Faulting a range of a shared-memory segment in: its pages allocated and mapped, its bytes
unchanged, before the pool's memory is pinned or copied to.

Methods, the first the kernel has is used (rates: ``tools/bench_engine_start.py``)::

    populate   madvise(MADV_POPULATE_WRITE), Linux 5.14+: the kernel faults the range in
               in one call (no trap per page), a part of it per thread; a page /dev/shm
               cannot back fails the call (EFAULT) instead of raising SIGBUS later
    touch      posix_fallocate of the range (a full /dev/shm is refused now), then one
               write per 4 KiB page (``x |= 0``, GIL released), a part per thread

Both leave every page allocated, so a /dev/shm that fills up later cannot SIGBUS a copy.
``advise_huge_pages`` asks for 2 MiB pages (MADV_HUGEPAGE): tmpfs gives them where
/dev/shm allows (mounted with ``huge=advise``, or ``shmem_enabled`` at ``advise``), and
faulting then runs about ten times faster; elsewhere it changes nothing.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from pegaflow.platform import shm
from pegaflow.platform.errors import ShmError
from pegaflow.platform.values import format_size

logger = logging.getLogger(__name__)

POPULATE, TOUCH = "populate", "touch"
MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23
PART_ALIGN = 2 << 20  # a part per thread starts on a huge-page boundary
_TOUCH_STRIDE = 4096
_RETRIES = 8  # EINTR / EAGAIN: a signal or a page under migration; the call is retried

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int
_state = {"has_populate": True}  # False once the kernel said it has no MADV_POPULATE_WRITE


def default_threads() -> int:
    return min(16, os.cpu_count() or 1)


def method() -> str:
    """The method ``fault_range`` uses now."""
    return POPULATE if _state["has_populate"] else TOUCH


def split(start: int, num_bytes: int, num_parts: int) -> list[tuple[int, int]]:
    """``[start, start + num_bytes)`` as up to ``num_parts`` ``(start, num_bytes)`` parts."""
    step = max(PART_ALIGN, -(-num_bytes // max(1, num_parts) // PART_ALIGN) * PART_ALIGN)
    end = start + num_bytes
    return [(s, min(step, end - s)) for s in range(start, end, step)]


def fault_range(segment: shm.Segment, start: int, num_bytes: int, how: str | None = None) -> str:
    """Fault ``[start, +num_bytes)`` of ``segment`` in (one thread's part; ``start`` on a
    page boundary) by ``how`` (default: the first the kernel has); the method used.
    ShmError if /dev/shm or the host cannot hold it."""
    if how != TOUCH and _state["has_populate"] and _populate(segment, start, num_bytes):
        return POPULATE
    _touch(segment, start, num_bytes)
    return TOUCH


def fault_in(segment: shm.Segment, start: int, num_bytes: int, num_threads: int,
             how: str | None = None) -> str:
    """``fault_range`` over ``num_threads`` threads; the method used."""
    parts = split(start, num_bytes, num_threads)
    with ThreadPoolExecutor(max(1, min(num_threads, len(parts)))) as pool:
        methods = list(pool.map(lambda part: fault_range(segment, *part, how), parts))
    return methods[-1] if methods else method()


def advise_huge_pages(segment: shm.Segment) -> bool:
    """Ask for 2 MiB pages for ``segment`` (before it is faulted in); whether the kernel took
    the advice (it may still give small pages where /dev/shm does not allow huge ones)."""
    return _madvise(segment.address(), segment.size, MADV_HUGEPAGE) == 0


def huge_page_bytes(segment: shm.Segment, smaps: str = "/proc/self/smaps") -> int | None:
    """Bytes of ``segment``'s mapping in 2 MiB pages, from the kernel's account of this
    process (None where it gives none)."""
    start = f"{segment.address():x}-"
    try:
        with open(smaps) as f:
            lines = iter(f)
            for line in lines:
                if line.startswith(start):
                    break
            else:
                return None
            for line in lines:
                if line.startswith("ShmemPmdMapped:") or line.startswith("FilePmdMapped:"):
                    return int(line.split()[1]) * 1024
                if "-" in line.split(maxsplit=1)[0]:  # the next mapping's header
                    return None
    except OSError:
        return None
    return None


def _populate(segment: shm.Segment, start: int, num_bytes: int) -> bool:
    """MADV_POPULATE_WRITE; False where the kernel does not have it."""
    for _ in range(_RETRIES):
        code = _madvise(segment.address() + start, num_bytes, MADV_POPULATE_WRITE)
        if code == 0:
            return True
        if code == errno.EINVAL:
            if _state["has_populate"]:
                logger.info("no MADV_POPULATE_WRITE in this kernel: the pool is faulted in by "
                            "posix_fallocate and a write per page")
            _state["has_populate"] = False
            return False
        if code not in (errno.EINTR, errno.EAGAIN):
            raise _cannot_hold(segment, start, num_bytes, code)
    raise _cannot_hold(segment, start, num_bytes, errno.EINTR)


def _madvise(address: int, num_bytes: int, advice: int) -> int:
    """0, or the errno of a failed madvise (ctypes releases the GIL meanwhile)."""
    return 0 if _libc.madvise(address, num_bytes, advice) == 0 else ctypes.get_errno()


def _touch(segment: shm.Segment, start: int, num_bytes: int) -> None:
    shm.reserve(segment, start, num_bytes)  # a full /dev/shm: ShmError now, not SIGBUS below
    part = segment.array(np.uint8, num_bytes, start)[::_TOUCH_STRIDE]
    np.bitwise_or(part, 0, out=part)


def _cannot_hold(segment: shm.Segment, start: int, num_bytes: int, code: int) -> ShmError:
    where = f"{format_size(num_bytes)} at {format_size(start)} into {segment.name}"
    if code == errno.ENOMEM:
        return ShmError(f"the host's memory cannot hold {where} ({os.strerror(code)})")
    try:
        stat = os.statvfs("/dev/shm")
        free = f"{format_size(stat.f_bavail * stat.f_frsize)} of /dev/shm free"
    except OSError:
        free = "/dev/shm unreadable"
    return ShmError(f"/dev/shm cannot hold {where} ({os.strerror(code)}; {free})")
