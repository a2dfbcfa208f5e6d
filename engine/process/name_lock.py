"""An engine's name, held for its lifetime: an exclusive lock on a file named for it (the
kernel drops the lock when the process dies), so two engines never both own one name."""

from __future__ import annotations

import os

from pegaflow.platform.errors import EngineAlreadyRunningError
from pegaflow.platform.locks import lock_path, open_lock_file, try_hold


def name_lock_path(name: str) -> str:
    return lock_path(name, "lock")


def claim_name(name: str) -> int:
    """Hold an exclusive lock on the engine's name for the engine's lifetime (the kernel
    drops it when the process dies), so two engines can never both own one name.  The
    file is unlinked at a clean stop: a lock taken on a file that was unlinked meanwhile
    is not the name's lock, and the claim starts over."""
    path = name_lock_path(name)
    while True:
        fd = open_lock_file(path, create=True)
        if (owner := try_hold(fd)) is not None:
            raise EngineAlreadyRunningError(
                f"an engine named {name!r} is already running (pid {owner}); stop it or start "
                f"this one with another --name")
        try:
            is_current = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            is_current = False
        if is_current:
            return fd
        os.close(fd)
