"""The only module that creates, attaches or unlinks shared memory and semaphores.

Names follow ``/pegaflow.<uid>.<engine name>.<what>`` so two users, or two engines of one
user under different ``--name``s, never meet.  Segments are created with mode 0600 and
unlinked only by their creator (``Segment.unlink`` refuses otherwise).  posix_ipc is used
instead of ``multiprocessing.shared_memory``, whose resource tracker unlinks segments
when any process that attached them exits.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import re

import numpy as np
import posix_ipc

from pegaflow.platform.errors import (
    ConfigError,
    EngineNotRunningError,
    EngineStartingError,
    ForeignSegmentError,
    ShmError,
)

logger = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_MODE = 0o600



def segment_path(name: str, is_semaphore: bool = False) -> str:
    """Where Linux keeps the POSIX segment (or named semaphore) ``name``."""
    return f"/dev/shm/{'sem.' if is_semaphore else ''}{name.lstrip('/')}"

def check_engine_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise ConfigError(f"engine name {name!r}: use 1-64 letters, digits, '_' or '-'")
    return name


def ipc_name(engine_name: str, what: str) -> str:
    """The POSIX name of one of an engine's segments or semaphores."""
    return f"/pegaflow.{os.getuid()}.{check_engine_name(engine_name)}.{what}"


class Segment:
    """A mapped POSIX shared-memory segment; ``is_owner`` marks the creator."""

    def __init__(self, name: str, mem: posix_ipc.SharedMemory, readonly: bool, is_owner: bool):
        self.name = name
        self.size = mem.size
        self.is_owner = is_owner
        prot = mmap.PROT_READ if readonly else mmap.PROT_READ | mmap.PROT_WRITE
        self._map = mmap.mmap(mem.fd, mem.size, flags=mmap.MAP_SHARED, prot=prot)
        mem.close_fd()

    def array(self, dtype: np.dtype, count: int, offset: int = 0) -> np.ndarray:
        """A numpy view of ``count`` records of ``dtype`` at ``offset`` bytes."""
        dtype = np.dtype(dtype)
        if offset + count * dtype.itemsize > self.size:
            raise ShmError(f"{self.name}: view [{offset}, +{count}x{dtype.itemsize}) "
                           f"is past the segment's {self.size} bytes")
        return np.frombuffer(self._map, dtype=dtype, count=count, offset=offset)

    def address(self) -> int:
        """The virtual address of the mapping in this process."""
        view = np.frombuffer(self._map, dtype=np.uint8, count=1)
        return view.__array_interface__["data"][0]

    def discard(self) -> None:
        """Give the segment's memory back to the system now; its bytes read as zeros after.
        For a stopping owner whose mapping (numpy views) outlives the segment's name."""
        if not hasattr(mmap, "MADV_REMOVE"):
            return  # not Linux: the memory goes when the last mapping does
        try:
            self._map.madvise(mmap.MADV_REMOVE)
        except OSError as exc:
            logger.info("%s: memory kept until exit (madvise: %s)", self.name, exc)

    def close(self) -> None:
        """Unmap; views still alive keep the mapping until they are collected."""
        try:
            self._map.close()
        except BufferError:
            logger.debug("%s: views still alive, unmapped when they are collected", self.name)

    def unlink(self) -> None:
        if not self.is_owner:
            raise ShmError(f"{self.name}: only the creator unlinks a segment")
        unlink_segment(self.name)


def create_segment(name: str, size: int) -> Segment:
    """Create a new segment; raises ``posix_ipc.ExistentialError`` if the name is taken."""
    mem = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=_MODE, size=size)
    return Segment(name, mem, readonly=False, is_owner=True)


def check_private(name: str, st: os.stat_result) -> None:
    """ForeignSegmentError unless ``st`` (of ``name``) is owned by this user and neither
    readable nor writable by anyone else: names are predictable and /dev/shm is
    world-writable, so another local user could plant a segment under ours."""
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise ForeignSegmentError(
            f"{name} is owned by uid {st.st_uid} with mode {st.st_mode & 0o777:o}, not this "
            f"user's (uid {os.geteuid()}) private 600: refusing it (another user may have "
            f"planted it; remove it)")


def reserve(segment: Segment, start: int = 0, num_bytes: int | None = None) -> None:
    """Allocate every page of ``segment`` (or of ``[start, +num_bytes)``) now
    (``posix_fallocate``): a segment is sparse, and a write into a page a full /dev/shm
    cannot back kills the writer with SIGBUS.  A ShmError names the shortfall instead."""
    num_bytes = segment.size - start if num_bytes is None else num_bytes
    mem = posix_ipc.SharedMemory(segment.name, 0)
    try:
        os.posix_fallocate(mem.fd, start, num_bytes)
    except OSError as exc:
        what = "its" if num_bytes == segment.size else f"{start / 2**20:.0f} MiB into it,"
        raise ShmError(f"{segment.name}: /dev/shm cannot hold {what} {num_bytes / 2**20:.0f} MiB "
                       f"({exc.strerror}); free /dev/shm, make it larger (--shm-size), or "
                       f"choose a smaller --pool-size") from exc
    finally:
        mem.close_fd()


_MAP_FIXED = 0x10  # Linux; Python's mmap module does not export it
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]


def map_over(segment: Segment, address: int, num_bytes: int) -> None:
    """Map the first ``num_bytes`` of ``segment`` (this process's own) at ``address`` in
    place of the pages there (``MAP_FIXED``): whatever pointed into the range now reads and
    writes the segment.  ``address`` and ``num_bytes`` are whole pages; the old pages'
    bytes are lost, so the caller copies them into the segment first."""
    if address % mmap.PAGESIZE or num_bytes % mmap.PAGESIZE or num_bytes > segment.size:
        raise ShmError(f"{segment.name}: cannot map {num_bytes} bytes at {address:#x} "
                       f"(whole pages of a {segment.size}-byte segment only)")
    mem = posix_ipc.SharedMemory(segment.name, 0)
    try:
        got = _libc.mmap(address, num_bytes, mmap.PROT_READ | mmap.PROT_WRITE,
                         mmap.MAP_SHARED | _MAP_FIXED, mem.fd, 0)
    finally:
        mem.close_fd()
    if got != address:
        raise ShmError(f"{segment.name}: mmap at {address:#x} failed: {os.strerror(ctypes.get_errno())}")


def attach_segment(name: str, readonly: bool = False) -> Segment:
    try:
        mem = posix_ipc.SharedMemory(name, 0, read_only=readonly)
    except posix_ipc.ExistentialError as exc:
        raise EngineNotRunningError(f"shared-memory segment {name} does not exist") from exc
    except posix_ipc.PermissionsError as exc:
        raise ShmError(f"no permission to open {name}: {exc}") from exc
    try:
        check_private(name, os.fstat(mem.fd))
    except ForeignSegmentError:
        mem.close_fd()
        raise
    if mem.size == 0:  # its creator has not sized it yet: still starting
        mem.close_fd()
        raise EngineStartingError(f"shared-memory segment {name} is not initialised yet")
    return Segment(name, mem, readonly=readonly, is_owner=False)


def unlink_segment(name: str) -> bool:
    """Unlink a segment by name; False if it was already gone.  ForeignSegmentError if it
    is another user's that this one may not remove."""
    return _unlink(name, posix_ipc.unlink_shared_memory, segment_path(name))


def _unlink(name: str, unlink, path: str) -> bool:
    try:
        unlink(name)
    except posix_ipc.ExistentialError:
        return False
    except posix_ipc.PermissionsError as exc:
        raise _not_removable(name, path, exc) from None
    return True


def _not_removable(name: str, path: str, exc: Exception) -> ForeignSegmentError:
    try:
        owner = f"uid {os.lstat(path).st_uid}"
    except OSError:
        owner = "another user"
    return ForeignSegmentError(f"{name} is there, owned by {owner}, and this user (uid {os.geteuid()}) "
                               f"may not remove it ({exc}): have its owner or root remove {path}")


def create_semaphore(name: str, initial: int = 0) -> posix_ipc.Semaphore:
    return posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=_MODE, initial_value=initial)


def attach_semaphore(name: str) -> posix_ipc.Semaphore:
    try:
        sem = posix_ipc.Semaphore(name, 0)
    except posix_ipc.ExistentialError as exc:
        raise EngineNotRunningError(f"semaphore {name} does not exist") from exc
    try:  # Linux keeps a named semaphore as /dev/shm/sem.<name>
        st = os.stat(segment_path(name, is_semaphore=True), follow_symlinks=False)
    except FileNotFoundError:
        return sem  # another platform's layout: nothing to check it by
    try:
        check_private(name, st)
    except ForeignSegmentError:
        sem.close()
        raise
    return sem


def unlink_semaphore(name: str) -> bool:
    """Unlink a semaphore by name; False if it was already gone.  ForeignSegmentError if it
    is another user's that this one may not remove."""
    return _unlink(name, posix_ipc.unlink_semaphore, segment_path(name, is_semaphore=True))


def private_buffer_name(what: str) -> str:
    """A fresh name for a segment a client creates for itself (host-backend KV memory)."""
    return f"/pegaflow.{os.getuid()}.{what}.{os.getpid()}.{os.urandom(4).hex()}"


def is_private_buffer_of(name: str, pid: int) -> bool:
    """Whether ``name`` is a ``private_buffer_name`` made by process ``pid`` of this user
    (never one of an engine's own segments: those have no pid and random part).  Its
    ``what`` may be an engine's name and a tag (``<engine>.cpukv``: in_place_segments.py)."""
    return re.fullmatch(rf"/pegaflow\.{os.getuid()}\.[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)?\.{pid}\.[0-9a-f]{{8}}",
                        name) is not None


def maps_segment(pid: int, name: str) -> bool:
    """Whether process ``pid`` has segment ``name`` mapped, by the kernel's account of it
    (``/proc/<pid>/maps``): what a process writes about itself can lie, this cannot."""
    path = segment_path(name)
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            return any(line.rstrip().endswith(path.encode()) for line in f)
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False


MAX_PID = 1 << 22  # Linux's largest pid_max: no process has a larger pid


def is_pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed but not yet reaped, does not).  Any integer may
    come in (it may have been read from shared memory): one that is no pid (0 would mean
    our process group to ``kill``, one past ``MAX_PID`` overflows it) runs nowhere."""
    if not 0 < pid <= MAX_PID:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):  # reaped meanwhile
        return False
