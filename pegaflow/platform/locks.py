"""File locks the kernel drops when their holder dies: the engine's name and its control lock.

Both live in this user's private directory ``/dev/shm/pegaflow-<uid>`` (the /dev/shm every
vLLM must share with the engine anyway; ``<tmp>/pegaflow-<uid>`` where there is none),
created 0700.  One that another user made, a link, or one others may read or write is never
used: the first of ``pegaflow-<uid>.1`` .. ``.3`` that is ours is (``lock_dir``), so no
name another user squats stops an engine.  Lock files are opened without following links.
The engine removes its two files when it stops, and the directory once nothing else is in it
(``remove_lock_dir_if_empty``); whoever creates a lock file makes the directory again if it
went meanwhile (``open_lock_file``).

    name lock      <name>.lock     the engine holds it for its lifetime: one engine a name
    control lock   <name>.claims   clients claim slots and the engine accepts them under it;
                                   a client killed while holding it frees it by dying
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import tempfile

from pegaflow.platform.errors import EngineNotRunningError, EngineTimeoutError, ForeignSegmentError
from pegaflow.platform.shm import check_engine_name, check_private
from pegaflow.platform.waits import poll_until

logger = logging.getLogger(__name__)

SHM_BASE = "/dev/shm"
NUM_REMAKES = 8  # a lock file's directory made again at most this often while opening it
NUM_LOCK_DIRS = 4  # pegaflow-<uid>, then .1 .. .3 where another user took the name
_fallbacks_said: set[str] = set()  # fallback directories already logged (once a process)


def lock_dir(base: str | None = None) -> str:
    """This user's lock directory under ``base`` (default /dev/shm, else the temp dir):
    ``pegaflow-<uid>``, or where another user took that name (or it is not private),
    the first of ``pegaflow-<uid>.1`` .. ``.3`` that is ours.  Every process walks the
    same names in the same order and takes the first of ours that exists, making one only
    where none does, so the engine and its clients meet in one directory."""
    uid = os.geteuid()
    if base is None:
        base = SHM_BASE if os.path.isdir(SHM_BASE) else tempfile.gettempdir()
    paths = [os.path.join(base, f"pegaflow-{uid}" + (f".{i}" if i else "")) for i in range(NUM_LOCK_DIRS)]
    for path in paths:
        if _dir_problem(path, uid) is None:
            return _chosen(path, paths)
    for path in paths:  # none of ours yet: make the first name free (or made meanwhile)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        if _dir_problem(path, uid) is None:
            return _chosen(path, paths)
    raise ForeignSegmentError(
        f"no private directory for pegaflow's locks under {base}: "
        + "; ".join(f"{p} {_dir_problem(p, uid)}" for p in paths)
        + f". Each must be a directory of uid {uid} with mode 700: have its owner (or root) "
          f"remove one, e.g. `rm -r {paths[0]}`, and start again")


def _dir_problem(path: str, uid: int) -> str | None:
    """What keeps ``path`` from being this user's lock directory (None: nothing)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "does not exist"
    if stat.S_ISLNK(st.st_mode):
        return f"is a link (owned by uid {st.st_uid})"
    if not stat.S_ISDIR(st.st_mode):
        return f"is not a directory (owned by uid {st.st_uid})"
    if st.st_uid != uid or st.st_mode & 0o077:
        return f"is owned by uid {st.st_uid} with mode {st.st_mode & 0o777:o}"
    return None


def _chosen(path: str, paths: list[str]) -> str:
    if path != paths[0] and path not in _fallbacks_said:
        _fallbacks_said.add(path)
        logger.warning("%s %s: pegaflow's locks live in %s instead (remove the first to use it "
                       "again)", paths[0], _dir_problem(paths[0], os.geteuid()), path)
    return path


def try_hold(fd: int, role: str = "") -> str | None:
    """Take the exclusive flock on ``fd`` for this process and write its pid in the file
    (after ``role`` and a space, if given, in one write); if another process holds it,
    close ``fd`` and return what that holder wrote ("unknown": nothing yet)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        return holder
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{role + ' ' if role else ''}{os.getpid()}\n".encode(), 0)
    return None


def lock_path(engine_name: str, what: str) -> str:
    return os.path.join(lock_dir(), f"{check_engine_name(engine_name)}.{what}")


def open_lock_file(path: str, create: bool) -> int:
    """An fd of the lock file at ``path`` (never through a link), checked to be ours.  With
    ``create``, a directory removed since ``path`` was named (the last engine in it stopped:
    ``remove_lock_dir_if_empty``) is made again, private, and the open retried."""
    flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT if create else 0)
    for _ in range(NUM_REMAKES):
        try:
            fd = os.open(path, flags, 0o600)
            break
        except FileNotFoundError as exc:
            if not create:
                raise EngineNotRunningError(f"lock {path} does not exist") from exc
            _remake_dir(os.path.dirname(path))
        except OSError as exc:  # ELOOP: a link planted where the lock goes
            raise ForeignSegmentError(f"cannot open the lock {path}: {exc}") from exc
    else:
        raise ForeignSegmentError(f"cannot open the lock {path}: its directory keeps disappearing")
    try:
        check_private(path, os.fstat(fd))
    except ForeignSegmentError:
        os.close(fd)
        raise
    return fd


def _remake_dir(path: str) -> None:
    with contextlib.suppress(FileExistsError):  # made again meanwhile by another process
        os.mkdir(path, 0o700)
    if (problem := _dir_problem(path, os.geteuid())) is not None:
        raise ForeignSegmentError(f"the lock directory {path} {problem}")


def remove_lock_dir_if_empty(path: str) -> bool:
    """Remove the directory of ``path`` (a lock file just removed) if nothing is left in it:
    True if removed.  ``rmdir`` removes only an empty directory, in one step, so a lock file
    another engine made first keeps it, and one made after finds it gone and makes it again
    (``open_lock_file``)."""
    try:
        os.rmdir(os.path.dirname(path))
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
            logger.warning("lock directory %s kept: %s", os.path.dirname(path), exc)
        return False
    return True


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
