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
