"""The KV caches an engine's CPU workers moved into shared memory (``pegaflow/client/in_place.py``),
found by their names.

Each is a segment ``/pegaflow.<uid>.<engine>.cpukv.<pid>.<random>``: the engine the worker
serves, and the worker's pid.  A worker that stops unlinks its own; one killed first leaves its
whole KV cache in /dev/shm.  Those whose owner is gone are removed by the next worker of the
engine to move its cache, by the engine at its start and by ``pegaflow-engine --clean``;
``pegaflow-stat`` lists them all.

A segment's owner is alive while the process of that pid maps it: the kernel's account
(``/proc/<pid>/maps``), which a pid reused by another process does not fool.  In the moment
between making its segment and mapping it the owner does not map it yet, so one made less
than ``YOUNG_S`` ago also counts as its owner's while that pid runs.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass

from pegaflow.platform import shm

WHAT = "cpukv"
YOUNG_S = 60.0
SHM_DIR = "/dev/shm"


def buffer_tag(engine_name: str) -> str:
    """What a worker of engine ``engine_name`` names its in-place segment with
    (``shm.private_buffer_name``'s ``what``)."""
    return f"{shm.check_engine_name(engine_name)}.{WHAT}"


@dataclass(frozen=True, slots=True)
class InPlaceSegment:
    name: str             # the POSIX name, /pegaflow.<uid>.<engine>.cpukv.<pid>.<random>
    pid: int              # the worker that made it
    num_bytes: int        # the memory it holds in /dev/shm
    is_owner_alive: bool  # its worker still maps it (or has only just made it)
    is_ours: bool         # this user's (not another's, planted under our name)

    @property
    def is_orphan(self) -> bool:
        """Left by a worker that is gone: for this user to remove."""
        return self.is_ours and not self.is_owner_alive


def find(engine_name: str) -> list[InPlaceSegment]:
    """The in-place segments of engine ``engine_name``'s workers, under this user's names."""
    if not os.path.isdir(SHM_DIR):
        return []  # not Linux's layout: nothing to find them by
    pattern = re.compile(rf"pegaflow\.{os.getuid()}\.{re.escape(buffer_tag(engine_name))}\.(\d+)\.[0-9a-f]{{8}}")
    found = []
    for entry in sorted(os.listdir(SHM_DIR)):
        if (match := pattern.fullmatch(entry)) is None:
            continue
        try:
            st = os.lstat(os.path.join(SHM_DIR, entry))
        except FileNotFoundError:  # unlinked meanwhile
            continue
        name, pid = f"/{entry}", int(match[1])
        found.append(InPlaceSegment(name, pid, st.st_blocks * 512, _is_owner_alive(name, pid, st),
                                    st.st_uid == os.geteuid()))
    return found


def _is_owner_alive(name: str, pid: int, st: os.stat_result) -> bool:
    if shm.maps_segment(pid, name):
        return True
    return time.time() - st.st_mtime < YOUNG_S and shm.is_pid_alive(pid)


def remove_orphans(engine_name: str) -> list[InPlaceSegment]:
    """Unlink engine ``engine_name``'s in-place segments whose owner is gone (another user's,
    planted under our name, are left alone); those removed."""
    return [s for s in find(engine_name) if s.is_orphan and shm.unlink_segment(s.name)]
