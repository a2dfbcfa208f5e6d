"""engine/memory/host_capacity.py: an engine that would not fit /dev/shm or the host's memory is refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.memory import host_capacity
from engine.memory.host_capacity import check_room
from pegaflow.platform.errors import ShmError

GIB = 1 << 30


def _meminfo(tmp_path, available_kib: int) -> str:
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal: {2 * available_kib} kB\nMemAvailable: {available_kib} kB\n")
    return str(path)


def _free_shm(monkeypatch, free_bytes: int) -> None:
    monkeypatch.setattr(host_capacity.os, "statvfs",
                        lambda path: SimpleNamespace(f_bavail=free_bytes // 4096, f_frsize=4096))


def test_check_room_refuses_more_than_dev_shm_has_free(tmp_path, monkeypatch):
    # 1. /dev/shm has 2 GiB free, memory is plentiful: 3 GiB of segments are refused,
    #    with both figures and what to change.
    _free_shm(monkeypatch, 2 * GIB)
    meminfo = _meminfo(tmp_path, 64 * GIB // 1024)
    with pytest.raises(ShmError, match=r"3\.0 GiB.*2\.0 GiB free.*--pool-size.*--shm-size"):
        check_room(3 * GIB, 3 * GIB, shm_dir=str(tmp_path), meminfo=meminfo)
    # 2. 1 GiB fits.
    check_room(GIB, GIB, shm_dir=str(tmp_path), meminfo=meminfo)


def test_check_room_refuses_a_pool_larger_than_available_memory(tmp_path, monkeypatch):
    # 1. Room in /dev/shm, but only 4 GiB of memory available: an 8 GiB pool is refused.
    _free_shm(monkeypatch, 100 * GIB)
    meminfo = _meminfo(tmp_path, 4 * GIB // 1024)
    with pytest.raises(ShmError, match=r"8\.0 GiB is more than the host's available memory \(4\.0 GiB\)"):
        check_room(8 * GIB, 8 * GIB, shm_dir=str(tmp_path), meminfo=meminfo)
    # 2. Without /proc/meminfo (not Linux) only /dev/shm is checked.
    check_room(8 * GIB, 8 * GIB, shm_dir=str(tmp_path), meminfo=str(tmp_path / "absent"))
