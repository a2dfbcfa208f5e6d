"""pegaflow.platform.locks: a lock file held, and its holder named to the next one."""

from __future__ import annotations

import os

import pytest


def test_try_hold_takes_a_free_lock_and_names_the_holder_of_a_taken_one(tmp_path):
    from pegaflow.platform.locks import try_hold
    path = tmp_path / "x.lock"
    first = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    assert try_hold(first) is None
    assert path.read_text() == f"{os.getpid()}\n"  # its holder's pid, for the next one's error
    second = os.open(path, os.O_RDWR)  # another open of the file: flock's holder is per open
    assert try_hold(second) == str(os.getpid())
    with pytest.raises(OSError):
        os.fstat(second)  # closed by try_hold
    os.close(first)


def test_open_lock_file_makes_its_directory_again_when_it_went_after_the_path_was_named(tmp_path, monkeypatch):
    # The race with a stopping engine: this process names its lock file (the directory is
    # there), the last engine in it stops and removes the empty directory, then this opens.
    from pegaflow.platform import locks
    monkeypatch.setattr(locks, "SHM_BASE", str(tmp_path))
    path = locks.lock_path("racer", "lock")
    assert locks.remove_lock_dir_if_empty(path)
    fd = locks.open_lock_file(path, create=True)
    try:
        st = os.stat(os.path.dirname(path))
        assert os.path.exists(path) and st.st_mode & 0o777 == 0o700 and st.st_uid == os.geteuid()
    finally:
        os.close(fd)
    # A client's open (no create) of a lock that is gone says the engine is not running.
    os.unlink(path)
    assert locks.remove_lock_dir_if_empty(path)
    with pytest.raises(locks.EngineNotRunningError):
        locks.open_lock_file(path, create=False)


def test_remove_lock_dir_if_empty_keeps_a_directory_with_another_engines_file(tmp_path, monkeypatch):
    from pegaflow.platform import locks
    monkeypatch.setattr(locks, "SHM_BASE", str(tmp_path))
    mine, other = locks.lock_path("mine", "lock"), locks.lock_path("other", "lock")
    open(other, "w").close()
    assert not locks.remove_lock_dir_if_empty(mine)
    assert os.path.exists(other)
