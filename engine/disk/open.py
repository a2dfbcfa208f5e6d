"""The disk tier as an engine configures it: its paths sized, its files taken in, its
policy wired to the index (or None without ``--disk-path``)."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np

from pegaflow.platform.errors import ConfigError
from pegaflow.platform.locks import try_hold
from pegaflow.platform.values import format_size

from .ownership import DIR_MODE, check_disk_path, secure_tree

logger = logging.getLogger(__name__)

AUTO_SHARE = 0.9  # --disk-size 0: this share of each path's free space at start
LOCK_NAME = "pegaflow-blocks.lock"


def disk_size(paths: list[Path], size_bytes: int) -> int:
    """The bytes each path may hold: ``size_bytes``, or (0) 90 % of the least free space
    among the paths, the blocks already there counted as free."""
    if size_bytes:
        return size_bytes
    free = []
    for path in paths:
        held = sum(f.stat().st_size for f in (path / "pegaflow-blocks").rglob("*.blk")) \
            if (path / "pegaflow-blocks").is_dir() else 0
        free.append(int((shutil.disk_usage(path).free + held) * AUTO_SHARE))
    return min(free)


def make_path(path: Path) -> None:
    """Create ``path`` if its parent exists; a missing parent is refused: a mistyped mount
    point would put the blocks on whatever disk holds the tree made for it (the root disk),
    sized at 90 % of that disk."""
    if not path.parent.exists():
        raise ConfigError(f"--disk-path {path}: its parent {path.parent} does not exist (is the "
                          f"drive mounted?); create it first if it is meant")
    if not path.parent.is_dir():
        raise ConfigError(f"--disk-path {path}: its parent {path.parent} is not a directory")
    try:
        path.mkdir(mode=DIR_MODE, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--disk-path {path}: {exc.strerror}") from exc


def lock_path(path: Path) -> int:
    """Hold ``path`` for this engine (an flock the kernel drops when it dies): two engines on
    one path would evict and remove each other's blocks.  Returns the lock's fd."""
    try:
        fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as exc:  # ELOOP: a link planted where the lock goes
        raise ConfigError(f"--disk-path {path}: cannot open {LOCK_NAME}: {exc.strerror}") from exc
    owner = os.fstat(fd).st_uid
    if owner != os.geteuid():
        os.close(fd)
        raise ConfigError(f"--disk-path {path}: {LOCK_NAME} is owned by uid {owner}, not this user: "
                          f"remove it")
    if (holder := try_hold(fd)) is not None:
        raise ConfigError(f"--disk-path {path} is in use by another engine (pid {holder}): give each "
                          f"engine paths of its own")
    return fd


def open_disk_tier(config, index, pool_segment, stats, wake: Callable[[], None]):
    if not config.disk_paths:
        return None
    from .blockfile import BLOCKS_DIR  # only with a disk tier (they need xxhash)
    from .store import DiskStore
    from .tier import DiskTier
    paths = [Path(p) for p in config.disk_paths]
    for path in paths:
        make_path(path)
        check_disk_path(path)
        if not os.access(path, os.W_OK):
            raise ConfigError(f"--disk-path {path}: not writable by this user")
    locks = []
    try:
        for path in paths:
            locks.append(lock_path(path))
            secure_tree(path / BLOCKS_DIR)
        size = disk_size(paths, config.disk_bytes)
        store = DiskStore(paths, size, config.disk_threads, wake=wake)
        num_blocks = store.scan()
    except BaseException:
        for fd in locks:
            os.close(fd)
        raise
    tier = DiskTier(store, index, pool_segment.array(np.uint8, pool_segment.size), stats,
                    config.disk_admission, locks)
    tier.update_stats()
    logger.info("disk tier: %d paths of %s each (%s), %d blocks (%s) taken in; admission %s",
                len(paths), format_size(size), ", ".join(map(str, paths)), num_blocks,
                format_size(store.bytes_used), config.disk_admission)
    return tier
