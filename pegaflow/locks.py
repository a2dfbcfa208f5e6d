"""File locks the kernel drops when their holder dies: the engine's name and its control lock.

Both live in this user's private directory ``/dev/shm/pegaflow-<uid>`` (the /dev/shm every
vLLM must share with the engine anyway; ``<tmp>/pegaflow-<uid>`` where there is none),
created 0700 and refused if another user made it, it is a link, or others may write in
it.  Lock files are opened without following links.

    name lock      <name>.lock     the engine holds it for its lifetime: one engine a name
    control lock   <name>.claims   clients claim slots and the engine accepts them under it;
                                   a client killed while holding it frees it by dying
"""

from __future__ import annotations

import fcntl
import os
import stat
import tempfile

from pegaflow.errors import EngineNotRunningError, EngineTimeoutError, ForeignSegmentError
from pegaflow.shm import check_engine_name, check_private
from pegaflow.waits import poll_until


def lock_dir(base: str | None = None) -> str:
    """This user's lock directory under ``base`` (default /dev/shm, else the temp dir)."""
    uid = os.geteuid()
    if base is None:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = os.path.join(base, f"pegaflow-{uid}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o077:
        raise ForeignSegmentError(
            f"{path} (where pegaflow's locks live) is not a directory of uid {uid} with mode "
            f"700 (uid {st.st_uid}, mode {st.st_mode & 0o777:o}): remove it and start again")
    return path


def lock_path(engine_name: str, what: str) -> str:
    return os.path.join(lock_dir(), f"{check_engine_name(engine_name)}.{what}")


def open_lock_file(path: str, create: bool) -> int:
    """An fd of the lock file at ``path`` (never through a link), checked to be ours."""
    flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except FileNotFoundError as exc:
        raise EngineNotRunningError(f"lock {path} does not exist") from exc
    except OSError as exc:  # ELOOP: a link planted where the lock goes
        raise ForeignSegmentError(f"cannot open the lock {path}: {exc}") from exc
    try:
        check_private(path, os.fstat(fd))
    except ForeignSegmentError:
        os.close(fd)
        raise
    return fd


class ControlLock:
    """The engine's control lock, as the engine (``create``) or a client (``open``) holds it."""

    def __init__(self, fd: int, path: str):
        self.fd, self.path = fd, path

    @classmethod
    def create(cls, engine_name: str) -> "ControlLock":
        path = lock_path(engine_name, "claims")
        return cls(open_lock_file(path, create=True), path)

    @classmethod
    def open(cls, engine_name: str) -> "ControlLock":
        path = lock_path(engine_name, "claims")
        return cls(open_lock_file(path, create=False), path)

    def try_acquire(self) -> bool:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def acquire(self, timeout_s: float) -> None:
        """EngineTimeoutError after ``timeout_s`` (a live holder that never lets go)."""
        if poll_until(lambda: True if self.try_acquire() else None, timeout_s) is None:
            raise EngineTimeoutError(f"the engine's control lock {self.path} stayed taken "
                                     f"for {timeout_s:.1f}s")

    def release(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
