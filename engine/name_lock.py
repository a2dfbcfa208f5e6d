"""An engine's name, held for its lifetime: an exclusive lock on a file named for it (the
kernel drops the lock when the process dies), so two engines never both own one name.

The lock alone says whether an engine of that name runs: a pid recorded anywhere may have
gone to another process since its engine died.  ``pegaflow-engine --clean`` holds the same
lock while it removes a dead engine's leftovers, and writes ``clean <pid>`` in the file
where an engine writes its pid: an engine that starts meanwhile waits for it to finish
(it never takes a --clean for a running engine), and a --clean that finds an engine's pid
there refuses.
"""

from __future__ import annotations

import logging
import os
import signal
import time

from pegaflow.platform.errors import EngineAlreadyRunningError, StartInterruptedError
from pegaflow.platform.locks import lock_path, open_lock_file, try_hold

logger = logging.getLogger(__name__)

CLEANING = "clean"        # what --clean writes before its pid in the lock file
CLEAN_WAIT_S = 300.0      # the longest a start waits for a --clean (a 1 TiB pool's memory given back)
_RETRY_S = 0.01
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}  # blocked while the engine starts: seen as pending


def name_lock_path(name: str) -> str:
    return lock_path(name, "lock")


def claim_name(name: str, cleaning: bool = False, wait_s: float = CLEAN_WAIT_S) -> int:
    """Hold an exclusive lock on the engine's name (the fd), for an engine's lifetime or for
    a --clean (``cleaning``).  EngineAlreadyRunningError, naming the pid, while an engine
    holds it; a --clean holding it is waited for, up to ``wait_s`` (StartInterruptedError
    if a stop signal comes meanwhile).  The file is unlinked at a clean stop: a lock taken
    on a file that was unlinked meanwhile is not the name's lock, and the claim starts over."""
    path = name_lock_path(name)
    deadline = time.monotonic() + wait_s
    is_waiting = False
    while True:
        fd = open_lock_file(path, create=True)
        holder = try_hold(fd, CLEANING if cleaning else "")
        if holder is None:
            if _is_current(path, fd):
                return fd
            os.close(fd)
            continue
        if holder.isdigit():  # an engine's pid: it runs (or is starting or stopping)
            raise EngineAlreadyRunningError(_running_message(name, holder, cleaning))
        if time.monotonic() >= deadline:
            raise EngineAlreadyRunningError(
                f"the name {name!r} is still held after {wait_s:.0f}s ({holder}): a "
                f"`pegaflow-engine --clean {name}` that does not finish; stop it and start again")
        if STOP_SIGNALS & signal.sigpending():
            raise StartInterruptedError(f"a stop signal came while waiting for the name {name!r}")
        if not is_waiting and holder.startswith(CLEANING):
            logger.info("the name %r is held by `pegaflow-engine --clean` (pid %s): waiting for it "
                        "to finish", name, holder.split()[-1])
            is_waiting = True
        time.sleep(_RETRY_S)  # a --clean, or a holder that has not written its pid yet


def _running_message(name: str, pid: str, cleaning: bool) -> str:
    if cleaning:
        return (f"an engine named {name!r} is running (pid {pid}): --clean removes only what a dead "
                f"engine left; stop this one instead (SIGTERM), it removes its own segments")
    return (f"an engine named {name!r} is already running (pid {pid}); stop it or start this one "
            f"with another --name")


def _is_current(path: str, fd: int) -> bool:
    """Whether ``fd`` is the file at ``path`` now (not one unlinked since it was opened)."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def release_name(name: str, fd: int) -> None:
    """Give the name back: its file unlinked while still locked (see ``claim_name``), then
    the lock dropped, so the next claim makes a fresh file."""
    try:
        os.unlink(name_lock_path(name))
    except FileNotFoundError:
        pass  # removed by hand; nothing to clean up
    os.close(fd)
