"""pegaflow.platform.shm: names, modes, ownership and errors of segments and semaphores."""

from __future__ import annotations

import itertools
import os
import stat

import numpy as np
import posix_ipc
import pytest

from pegaflow.client.connection import EngineClient
from pegaflow.platform import shm
from pegaflow.platform.errors import ConfigError, EngineNotRunningError, ShmError

_counter = itertools.count()


@pytest.fixture
def seg_name():
    """A fresh segment name; whatever the test left under it is unlinked afterwards."""
    name = shm.ipc_name(f"t{os.getpid()}_shm{next(_counter)}", "seg")
    yield name
    shm.unlink_segment(name)


def _dev_shm_path(name: str) -> str:
    return "/dev/shm/" + name.lstrip("/")


@pytest.mark.parametrize("name", ["pegaflow", "a", "t_1-x", "A" * 64])
def test_shm_check_engine_name_accepts_plain_names(name):
    assert shm.check_engine_name(name) == name


@pytest.mark.parametrize("name", ["", "a/b", "a.b", "a b", "../x", "A" * 65, "é"])
def test_shm_check_engine_name_rejects_other_names(name):
    with pytest.raises(ConfigError):
        shm.check_engine_name(name)


def test_shm_ipc_name_carries_uid_and_engine_name():
    assert shm.ipc_name("eng", "ring.3") == f"/pegaflow.{os.getuid()}.eng.ring.3"
    with pytest.raises(ConfigError):
        shm.ipc_name("bad/name", "control")


def test_shm_create_segment_is_private_to_the_user(seg_name):
    # 1. Create a segment; it is mode 0600 and its creator owns it.
    segment = shm.create_segment(seg_name, 4096)
    assert segment.is_owner and segment.size == 4096
    assert stat.S_IMODE(os.stat(_dev_shm_path(seg_name)).st_mode) == 0o600
    segment.close()


def test_shm_create_segment_twice_raises_existential_error(seg_name):
    first = shm.create_segment(seg_name, 4096)
    # 1. The name is taken: creating it again must not silently attach.
    with pytest.raises(posix_ipc.ExistentialError):
        shm.create_segment(seg_name, 4096)
    first.close()


def test_shm_attach_missing_segment_raises_engine_not_running(seg_name):
    with pytest.raises(EngineNotRunningError):
        shm.attach_segment(seg_name)


def test_shm_attached_segment_shares_bytes_with_creator(seg_name):
    # 1. Write through the creator's view; read through an attachment.
    owner = shm.create_segment(seg_name, 4096)
    owner.array(np.uint64, 4, 64)[:] = [1, 2, 3, 2**64 - 1]
    other = shm.attach_segment(seg_name)
    assert not other.is_owner
    assert other.array(np.uint64, 4, 64).tolist() == [1, 2, 3, 2**64 - 1]
    # 2. And the other way round.
    other.array(np.uint8, 1, 0)[0] = 7
    assert owner.array(np.uint8, 1, 0)[0] == 7


def test_shm_readonly_attachment_cannot_write(seg_name):
    shm.create_segment(seg_name, 4096)
    reader = shm.attach_segment(seg_name, readonly=True)
    view = reader.array(np.uint8, 16)
    # 1. A read-only mapping gives read-only views: writing raises instead of corrupting.
    with pytest.raises(ValueError):
        view[0] = 1


def test_shm_array_past_the_segment_raises_shm_error(seg_name):
    segment = shm.create_segment(seg_name, 4096)
    assert len(segment.array(np.uint8, 4096)) == 4096
    with pytest.raises(ShmError):
        segment.array(np.uint8, 1, 4096)
    with pytest.raises(ShmError):
        segment.array(np.uint64, 513)


def test_shm_only_the_creator_unlinks(seg_name):
    owner = shm.create_segment(seg_name, 4096)
    other = shm.attach_segment(seg_name)
    # 1. An attacher may not unlink; the segment stays.
    with pytest.raises(ShmError):
        other.unlink()
    assert os.path.exists(_dev_shm_path(seg_name))
    # 2. The creator may; a second unlink by name reports it was already gone.
    owner.unlink()
    assert not os.path.exists(_dev_shm_path(seg_name))
    assert shm.unlink_segment(seg_name) is False


def test_shm_close_with_live_views_does_not_raise(seg_name):
    segment = shm.create_segment(seg_name, 4096)
    view = segment.array(np.uint8, 16)
    # 1. Views outlive close(); the mapping goes when they are collected.
    segment.close()
    view[0] = 3
    assert view[0] == 3


def test_shm_semaphore_create_attach_unlink(seg_name):
    name = seg_name + ".sem"
    # 1. Create with an initial count; mode 0600.
    sem = shm.create_semaphore(name, initial=2)
    try:
        assert stat.S_IMODE(os.stat("/dev/shm/sem." + name.lstrip("/")).st_mode) == 0o600
        # 2. An attachment sees the same count.
        other = shm.attach_semaphore(name)
        other.acquire(0)
        other.acquire(0)
        with pytest.raises(posix_ipc.BusyError):
            sem.acquire(0)
        # 3. Creating it again fails.
        with pytest.raises(posix_ipc.ExistentialError):
            shm.create_semaphore(name)
    finally:
        assert shm.unlink_semaphore(name) is True
    assert shm.unlink_semaphore(name) is False
    with pytest.raises(EngineNotRunningError):
        shm.attach_semaphore(name)


def test_shm_private_buffer_names_are_unique_and_per_user():
    names = {shm.private_buffer_name("kv") for _ in range(100)}
    assert len(names) == 100
    assert all(n.startswith(f"/pegaflow.{os.getuid()}.kv.{os.getpid()}.") for n in names)


def test_shm_attach_segment_not_yet_sized_raises_typed_error(seg_name):
    # 1. A creator between shm_open and ftruncate: the segment exists with 0 bytes (what a
    #    client sees when it attaches while the engine is still starting).
    raw = posix_ipc.SharedMemory(seg_name, posix_ipc.O_CREX, mode=0o600, size=0)
    raw.close_fd()
    # 2. Attaching fails with a pegaflow error a caller can catch and retry on, not a
    #    bare ValueError from mmap.
    with pytest.raises(EngineNotRunningError, match="not initialised"):
        shm.attach_segment(seg_name)


def test_shm_client_connect_to_a_starting_engine_raises_typed_error():
    # 1. An engine that has created its control segment but not written its header yet.
    name = f"t{os.getpid()}_starting{next(_counter)}"
    control = shm.ipc_name(name, "control")
    try:
        shm.create_segment(control, 4096).close()
        # 2. A client attaching now gets a pegaflow error (retry-able), nothing else.
        with pytest.raises(EngineNotRunningError, match="still starting"):
            EngineClient.connect(name, timeout_s=1.0)
    finally:
        shm.unlink_segment(control)
