"""``pegaflow-engine --clean NAME``: remove what a dead engine left in shared memory.

An engine killed with SIGKILL (or by the OOM killer) cannot unlink its segments: its pool,
control, stats and ring segments, its semaphores and its lock files stay in /dev/shm, the
pool's memory in use, until an engine of that name starts again (which removes them) or
this command does.  So do the KV caches its CPU workers moved into shared memory, of those
killed too (``pegaflow/platform/in_place_segments.py``); a running worker's stay its own.

Whether an engine of that name runs is the name's lock's to say (``name_lock``), never a pid:
while it is held by an engine this refuses (a running engine removes its own at its stop);
while it is free, anything under the name is a dead engine's.  This holds the lock while it
removes them, marked as a --clean's: an engine started meanwhile waits, then starts.  A pool
kept with ``--keep-pool`` goes too: cleaning gives the memory back.  What another user made
under our name is named and left where it is, even by root.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pegaflow.platform import in_place_segments, shm
from pegaflow.platform.errors import ForeignSegmentError
from pegaflow.platform.in_place_segments import InPlaceSegment
from pegaflow.platform.locks import lock_path, remove_lock_dir_if_empty

from ..config import MAX_SLOTS
from .name_lock import claim_name, release_name
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
    num_in_place: int = 0    # KV caches of CPU workers that are gone, removed
    in_place_bytes: int = 0
    in_use: tuple[InPlaceSegment, ...] = ()  # KV caches of CPU workers still running: theirs, kept

    @property
    def is_empty(self) -> bool:
        """Nothing of the engine's own names was there to remove."""
        return not (self.num_segments or self.num_semaphores)


def clean(name: str) -> Cleaned:
    """Remove engine ``name``'s leftovers; EngineAlreadyRunningError while it runs."""
    shm.check_engine_name(name)
    name_lock = claim_name(name, cleaning=True)
    try:
        pid = _recorded_pid(name)
        num_segments, num_bytes, refused = _unlink_all(name, SEGMENTS, is_semaphore=False)
        num_semaphores, _, refused_sems = _unlink_all(name, SEMAPHORES, is_semaphore=True)
        found = in_place_segments.find(name)
        gone = [s for s in found if s.is_orphan and shm.unlink_segment(s.name)]
        _remove_file(lock_path(name, "claims"))
    finally:
        release_name(name, name_lock)  # its file unlinked while still locked, as a stopping engine does
        remove_lock_dir_if_empty(lock_path(name, "lock"))
    foreign = tuple(refused + refused_sems + [s.name for s in found if not s.is_ours])
    return Cleaned(pid, num_segments, num_semaphores, num_bytes, foreign, len(gone),
                   sum(s.num_bytes for s in gone), tuple(s for s in found if s.is_ours and s.is_owner_alive))


def _recorded_pid(name: str) -> int:
    """The pid the control segment names (0: none, or unreadable).  Only a name for the
    output: the dead engine's pid may be another process's by now."""
    header = recorded_header(shm.ipc_name(name, "control"))
    return 0 if header is None else int(header["engine_pid"])


def _unlink_all(name: str, whats, is_semaphore: bool) -> tuple[int, int, list[str]]:
    """Unlink each of the engine's names that is this user's; those of another user are
    listed, not removed (root may unlink them, but they are not the dead engine's)."""
    unlink = shm.unlink_semaphore if is_semaphore else shm.unlink_segment
    num_removed, num_bytes, refused = 0, 0, []
    for what in whats:
        ipc_name = shm.ipc_name(name, what)
        try:
            st = os.lstat(shm.segment_path(ipc_name, is_semaphore))
        except FileNotFoundError:
            continue  # never made (fewer slots), or removed already
        if st.st_uid != os.geteuid():
            refused.append(ipc_name)
            continue
        try:
            if unlink(ipc_name):
                num_removed += 1
                num_bytes += 0 if is_semaphore else st.st_blocks * 512  # pages in use, not its size
        except ForeignSegmentError:  # another user's, which this user may not remove
            refused.append(ipc_name)
    return num_removed, num_bytes, refused


def _remove_file(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass  # never made, or removed by hand: nothing to do


def describe(name: str, cleaned: Cleaned) -> str:
    """One line for the command's output."""
    if cleaned.is_empty:
        line = f"nothing of an engine named {name!r} was left in shared memory"
    else:
        whose = f" (pid {cleaned.engine_pid})" if cleaned.engine_pid else ""
        line = (f"removed what the engine named {name!r}{whose} left: {cleaned.num_segments} segments "
                f"holding {cleaned.num_bytes / 2**20:.1f} MiB and {cleaned.num_semaphores} semaphores")
    if cleaned.num_in_place:
        line += (f"; removed {_kv_caches(cleaned.num_in_place)} of its CPU workers that are gone, "
                 f"holding {cleaned.in_place_bytes / 2**20:.1f} MiB")
    if cleaned.in_use:
        line += (f"; kept {_kv_caches(len(cleaned.in_use))} of CPU workers still running (pids "
                 f"{', '.join(str(s.pid) for s in cleaned.in_use)}): each unlinks its own when it stops")
    if cleaned.not_removed:
        line += (f"; {len(cleaned.not_removed)} not removed, not this user's (another user made them "
                 f"under our name): {', '.join(cleaned.not_removed[:3])}")
    return line


def _kv_caches(count: int) -> str:
    return f"{count} KV {'cache' if count == 1 else 'caches'}"
