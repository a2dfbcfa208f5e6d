"""``pegaflow-engine --clean NAME``: remove what a dead engine left in shared memory.

An engine killed with SIGKILL (or by the OOM killer) cannot unlink its segments: its pool,
control, stats and ring segments, its semaphores and its lock files stay in /dev/shm, the
pool's memory in use, until an engine of that name starts again (which removes them) or
this command does.  It refuses while an engine of that name runs (it holds the name's
lock, or the control segment names a live process): a running engine removes its own at
its stop.  A pool kept with ``--keep-pool`` goes too: cleaning gives the memory back.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pegaflow.platform import shm
from pegaflow.platform.errors import EngineAlreadyRunningError, ForeignSegmentError
from pegaflow.platform.locks import lock_path

from ..config import MAX_SLOTS
from .name_lock import claim_name, name_lock_path
from .segments import _what_names, recorded_header

# Every name an engine creates: its segments and its semaphores (with at most MAX_SLOTS clients).
SEGMENTS, SEMAPHORES = _what_names(MAX_SLOTS)


@dataclass(frozen=True, slots=True)
class Cleaned:
    """What ``clean`` removed, and what it could not (another user's, planted under our name)."""
    engine_pid: int          # the dead engine's, from its control segment (0: unreadable or none)
    num_segments: int
    num_semaphores: int
    num_bytes: int           # the memory the removed segments held
    not_removed: tuple[str, ...]

    @property
    def is_empty(self) -> bool:
        return not (self.num_segments or self.num_semaphores or self.not_removed)


def clean(name: str) -> Cleaned:
    """Remove engine ``name``'s leftovers; EngineAlreadyRunningError while it runs."""
    shm.check_engine_name(name)
    try:
        name_lock = claim_name(name)
    except EngineAlreadyRunningError:
        raise EngineAlreadyRunningError(_running_message(name, _lock_owner(name))) from None
    try:
        pid = _dead_engine_pid(name)
        num_segments, num_bytes, refused = _unlink_all(name, SEGMENTS, shm.unlink_segment, _segment_bytes)
        num_semaphores, _, refused_sems = _unlink_all(name, SEMAPHORES, shm.unlink_semaphore, lambda _: 0)
        _remove_file(lock_path(name, "claims"))
        _remove_file(name_lock_path(name))  # while still locked, as a stopping engine does
    finally:
        os.close(name_lock)
    return Cleaned(pid, num_segments, num_semaphores, num_bytes, tuple(refused + refused_sems))


def _dead_engine_pid(name: str) -> int:
    """The pid the control segment names (0: none, or unreadable); refused if it is alive."""
    header = recorded_header(shm.ipc_name(name, "control"))
    pid = 0 if header is None else int(header["engine_pid"])
    if pid and pid != os.getpid() and shm.is_pid_alive(pid):
        raise EngineAlreadyRunningError(_running_message(name, str(pid)))
    return pid


def _unlink_all(name: str, whats, unlink, size_of) -> tuple[int, int, list[str]]:
    num_removed, num_bytes, refused = 0, 0, []
    for what in whats:
        ipc_name = shm.ipc_name(name, what)
        size = size_of(ipc_name)
        try:
            if unlink(ipc_name):
                num_removed, num_bytes = num_removed + 1, num_bytes + size
        except ForeignSegmentError:  # another user's, which this user may not remove
            refused.append(ipc_name)
    return num_removed, num_bytes, refused


def _segment_bytes(ipc_name: str) -> int:
    """The memory a segment holds (its pages in use, not its size: a pool may be sparse)."""
    try:
        return os.stat(shm.segment_path(ipc_name)).st_blocks * 512
    except OSError:  # gone, or not Linux's layout: not counted
        return 0


def _remove_file(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass  # never made, or removed by hand: nothing to do


def _lock_owner(name: str) -> str:
    try:
        with open(name_lock_path(name), "rb") as f:
            return f.read(32).decode(errors="replace").strip() or "unknown"
    except OSError:
        return "unknown"


def _running_message(name: str, pid: str) -> str:
    return (f"an engine named {name!r} is running (pid {pid}): --clean removes only what a dead "
            f"engine left; stop this one instead (SIGTERM), it removes its own segments")


def describe(name: str, cleaned: Cleaned) -> str:
    """One line for the command's output."""
    if cleaned.is_empty:
        return f"nothing of an engine named {name!r} was left in shared memory"
    whose = f" (pid {cleaned.engine_pid})" if cleaned.engine_pid else ""
    line = (f"removed what the engine named {name!r}{whose} left: {cleaned.num_segments} segments "
            f"holding {cleaned.num_bytes / 2**20:.1f} MiB and {cleaned.num_semaphores} semaphores")
    if cleaned.not_removed:
        line += (f"; {len(cleaned.not_removed)} not removed, not this user's (another user made them "
                 f"under our name): {', '.join(cleaned.not_removed[:3])}")
    return line

