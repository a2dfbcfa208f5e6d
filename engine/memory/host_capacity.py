"""Whether the host has room for an engine: /dev/shm for its segments, memory for its pool
(checked before anything is created)."""

from __future__ import annotations

import os

from pegaflow.platform.errors import ShmError
from pegaflow.platform.values import format_size


def _mem_available(meminfo: str) -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is no such file)."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_room(num_bytes: int, pool_bytes: int, shm_dir: str = "/dev/shm",
               meminfo: str = "/proc/meminfo") -> None:
    """Refuse to start when ``shm_dir`` has no room for ``num_bytes`` of segments or the
    host's available memory cannot hold the pool: either would kill the engine with
    SIGBUS (or the OOM killer) once the pool fills, long after a clean start."""
    if os.path.isdir(shm_dir):
        stat = os.statvfs(shm_dir)
        free = stat.f_bavail * stat.f_frsize
        if num_bytes > free:
            raise ShmError(f"the engine needs {format_size(num_bytes)} of shared memory but {shm_dir} has "
                           f"{format_size(free)} free: lower --pool-size, or give {shm_dir} more room "
                           f"(in a container: --shm-size, or --ipc=host)")
    available = _mem_available(meminfo)
    if available is not None and pool_bytes > available:
        raise ShmError(f"--pool-size {format_size(pool_bytes)} is more than the host's available memory "
                       f"({format_size(available)}): lower --pool-size")
