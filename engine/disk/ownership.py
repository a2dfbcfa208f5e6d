"""Whose files the disk tier takes in: only this user's, in directories no one else may write.

A block file is served to whoever looks its key up, so a file another user could have made
or changed would serve their bytes; and a file others may read hands them a tenant's KV
cache.  So, at start, before any file is read:

- a ``--disk-path`` another user owns, or that every user may write in, is refused, as is
  anything in its ``pegaflow-blocks`` tree that another user owns, that is a link, or a
  directory every user may write in: one line naming the path, its owner and mode, and
  the fix;
- the engine's own files and directories there are made private (0600 files, 0700
  directories), as it makes every new one; trees written by engines before that are
  tightened in place.

A file read later is checked again as it is opened (``blockfile.read_block``): only this
user's regular file is read.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from pegaflow.platform.errors import ConfigError

logger = logging.getLogger(__name__)

FILE_MODE = 0o600
DIR_MODE = 0o700
_OTHERS_WRITE = 0o002  # world-writable (group-writable ones are tightened, as umask 002 makes them)


def check_disk_path(path: Path) -> None:
    """ConfigError unless ``path`` (a directory, made by now) is this user's and not every
    user may write in it."""
    st = os.stat(path)
    if st.st_uid != os.geteuid():
        raise ConfigError(f"--disk-path {path} is owned by uid {st.st_uid}, not this user (uid "
                          f"{os.geteuid()}): another user could put blocks there for this engine to "
                          f"serve; use a directory of this user's")
    if st.st_mode & _OTHERS_WRITE:
        raise ConfigError(f"--disk-path {path} has mode {st.st_mode & 0o777:o}: others may write "
                          f"in it and plant blocks; chmod o-w {path}, or use another directory")


def secure_tree(root: Path) -> int:
    """Check every entry of ``root`` (the ``pegaflow-blocks`` tree) and make this user's
    private; ConfigError for one another user owns, a link, or a directory others may write
    in.  Returns how many entries were tightened."""
    if not root.exists():
        return 0
    num_tightened = _secure(root, os.lstat(root))
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            num_tightened += _secure(path, os.lstat(path))
    if num_tightened:
        logger.info("disk tier %s: %d files and directories written by an earlier engine made private "
                    "(0600 files, 0700 directories)", root, num_tightened)
    return num_tightened


def _secure(path, st: os.stat_result) -> int:
    uid, is_dir = os.geteuid(), stat.S_ISDIR(st.st_mode)
    if st.st_uid != uid:
        raise ConfigError(f"disk tier: {path} is owned by uid {st.st_uid}, not this user (uid {uid}): "
                          f"refusing to serve blocks another user could have written; remove it")
    if stat.S_ISLNK(st.st_mode):
        raise ConfigError(f"disk tier: {path} is a link; the engine writes none: remove it")
    if is_dir and st.st_mode & _OTHERS_WRITE:
        raise ConfigError(f"disk tier: directory {path} has mode {st.st_mode & 0o777:o}: others may "
                          f"write in it and plant blocks; remove it (or chmod o-w it)")
    mode = DIR_MODE if is_dir else FILE_MODE
    if st.st_mode & 0o777 == mode or not (is_dir or stat.S_ISREG(st.st_mode)):
        return 0
    os.chmod(path, mode, follow_symlinks=False)
    return 1


def is_own_file(st: os.stat_result) -> bool:
    """Whether ``st`` is of a regular file of this user (the only files the tier reads)."""
    return st.st_uid == os.geteuid() and stat.S_ISREG(st.st_mode)
