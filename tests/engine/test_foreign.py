"""Another local user's segments under our names are never trusted: names are predictable
and /dev/shm is world-writable.  Runs as root in CI, where chown stands in for a second
user; skipped where this process may not chown."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from engine.process import name_lock
from pegaflow.client.connection import EngineClient
from pegaflow.platform import shm
from pegaflow.platform.errors import ForeignSegmentError
from tests.conftest import unique_engine_name

OTHER_UID = 54321
KEEP = ("--keep-pool",)

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand a file to another uid")


def _dev_shm(name: str) -> str:
    return "/dev/shm/" + name.lstrip("/")


def _give_away(name: str, mode: int | None = None) -> None:
    path = _dev_shm(name)
    os.chown(path, OTHER_UID, OTHER_UID)
    if mode is not None:
        os.chmod(path, mode)


@needs_root
def test_foreign_kept_pool_is_removed_not_taken_in(engine_factory, kv_client, rng):
    # 1. A keeping engine stores blocks and dies; its pool is then handed to another user
    #    (as if that user had planted a pool and table that pass every check).
    name = unique_engine_name("forpool")
    first = engine_factory(name, extra=KEEP)
    first.is_clean_exit_expected = False
    hashes, _ = kv_client(first).store(rng, 5, [2, 7])
    first.stop(signal.SIGKILL)
    _give_away(shm.ipc_name(name, "pool"))
    _give_away(shm.ipc_name(name, "pool.table"))
    # 2. The next keeping engine refuses it (says why) and starts with an empty pool.
    second = engine_factory(name, extra=KEEP)
    assert "owned by uid 54321" in second.stderr_text()
    assert "took in" not in second.stderr_text()
    assert kv_client(second).num_hits(5, hashes) == 0
    # 3. An engine that does not keep pools removes the one the second engine kept.
    assert second.stop() == 0
    engine_factory(name)


@needs_root
def test_foreign_control_segment_is_not_attached_to(engine_factory):
    # A control segment under our name that another user owns: a client refuses it (an
    # engine impersonating ours), with a typed error naming the owner.
    engine = engine_factory()
    _give_away(shm.ipc_name(engine.name, "control"))
    with pytest.raises(ForeignSegmentError, match="owned by uid 54321"):
        EngineClient.connect(engine.name, timeout_s=2.0)
    os.chown(_dev_shm(shm.ipc_name(engine.name, "control")), 0, 0)  # let teardown stop it


def test_foreign_readable_segment_is_refused():
    # Our own uid, but readable by everyone (mode 644): not private, refused.
    name = shm.private_buffer_name("modecheck")
    segment = shm.create_segment(name, 4096)
    try:
        os.chmod(_dev_shm(name), 0o644)
        with pytest.raises(ForeignSegmentError, match="mode 644"):
            shm.attach_segment(name)
    finally:
        segment.close()
        segment.unlink()


def test_foreign_link_where_the_name_lock_goes_is_not_followed(engine_factory, tmp_path):
    # 1. A link planted where an engine's name lock will be, pointing at a file of ours.
    name = unique_engine_name("forlock")
    target = tmp_path / "precious"
    target.write_text("keep me")
    os.symlink(target, name_lock.name_lock_path(name))
    try:
        # 2. The engine refuses to start, with one line; the target is untouched.
        with pytest.raises(ForeignSegmentError, match="cannot open the lock"):
            name_lock.claim_name(name)
        assert target.read_text() == "keep me"
    finally:
        os.unlink(name_lock.name_lock_path(name))


@needs_root
def test_foreign_segment_planted_under_a_ring_name_is_replaced(engine_factory):
    # Another user's segment where the engine will create ring.0: the engine (which holds
    # the name) removes it and starts, instead of dying with a traceback.
    name = unique_engine_name("forring")
    planted = shm.create_segment(shm.ipc_name(name, "ring.0"), 4096)
    planted.array(np.uint8, 16)[:] = 7
    planted.close()
    _give_away(shm.ipc_name(name, "ring.0"))
    engine = engine_factory(name)
    assert engine.connect().ping() == 0
    assert "was there before this engine made it" in engine.stderr_text()


def test_foreign_attach_naming_another_process_is_refused(engine_factory):
    # A client that names a pid other than its own (pid 1 maps none of our rings): the
    # engine would reclaim the slot by that pid's life, so the lie is refused.
    from pegaflow.platform.errors import CommandError
    from pegaflow.platform.wire import Opcode, Status
    engine = engine_factory()
    client = engine.connect()
    with pytest.raises(CommandError) as info:
        client.call(Opcode.ATTACH, arg=1)
    assert info.value.status == Status.BAD_ARGUMENT
    assert client.ping() == 0  # still attached under its own pid
    client.close()


def test_foreign_register_of_memory_this_client_did_not_make_is_refused(engine_factory):
    # 1. Another process (client A) made a KV buffer; client B registers it as its own, then
    #    the engine's own pool: both refused, so B can neither read nor overwrite them.
    import subprocess
    import sys

    from pegaflow.client.host_memory import HostKVBuffer, layer_records
    from pegaflow.platform.errors import CommandError
    from pegaflow.platform.wire import Status
    engine = engine_factory()
    child = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pegaflow.client.host_memory import HostKVBuffer; "
        "kv = HostKVBuffer(1 << 16, 'childkv'); print(kv.name, flush=True); sys.stdin.read(); kv.close()")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    b = engine.connect()
    mine = HostKVBuffer(1 << 16, "bkv")
    try:
        a_name = child.stdout.readline().strip()
        layers = layer_records([0], [0], [4096])
        for name in (a_name, shm.ipc_name(engine.name, "pool")):
            region = mine.region_record(4, 4096, 1)
            region["shm_name"] = name.encode()
            with pytest.raises(CommandError) as info:
                b.register_region(0, region, layers)
            assert info.value.status == Status.BAD_ARGUMENT, name
        # 2. Its own buffer it registers.
        b.register_region(0, mine.region_record(4, 4096, 1), layers)
    finally:
        b.close()
        mine.close()
        child.communicate("", timeout=10)


def test_foreign_client_killed_holding_the_control_lock_does_not_wedge_attaches(engine_factory):
    # 1. A process takes the engine's control lock (as a client claiming a slot does) and is
    #    SIGKILLed while holding it.
    import subprocess
    import sys
    engine = engine_factory()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pegaflow.platform.locks import ControlLock; "
        f"lock = ControlLock.open({engine.name!r}); lock.acquire(5.0); print('held', flush=True); "
        "time.sleep(60)")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.send_signal(signal.SIGKILL)
    holder.wait(10)
    # 2. The kernel let go of it with the process: the next client attaches at once.
    client = EngineClient.connect(engine.name, timeout_s=2.0)
    assert client.ping() == 0
    client.close()


def test_foreign_client_that_never_reads_its_answers_is_held_back_not_buffered(engine_factory):
    # 1. A client submits PINGs and never reads an answer: past its completion ring and
    #    the engine's cap of queued answers, its commands wait unread, so its own submit
    #    times out (it is told) while the engine's memory stays bounded.
    from engine.process.server import MAX_UNREAD_ANSWERS
    from pegaflow.platform.errors import RingFullError
    from pegaflow.platform.wire import Opcode
    engine = engine_factory(extra=("--ring-slots", "16"))
    flooder, other = engine.connect(), engine.connect()
    sent = 0
    with pytest.raises(RingFullError):
        for _ in range(16 + MAX_UNREAD_ANSWERS + 16 + 64):
            flooder.submit(Opcode.PING, timeout_s=0.5)
            sent += 1
    assert 16 + MAX_UNREAD_ANSWERS <= sent <= 16 + MAX_UNREAD_ANSWERS + 16 + 16
    # 2. Another client is served meanwhile.
    assert other.ping() == 0
    # 3. Once the flooder reads its answers, its commands are served again.
    import time
    answered, deadline = 0, time.monotonic() + 10
    while answered < sent:
        assert time.monotonic() < deadline, f"{answered} of {sent} answers came"
        answered += len(flooder.poll())
    assert flooder.ping() == 0
    flooder.close()
    other.close()


@needs_root
@pytest.mark.parametrize("squat", ["dir", "dir777", "link"])
def test_foreign_lock_directory_of_another_user_gets_a_fallback(tmp_path, squat):
    # 1. Another user made the directory where pegaflow's locks go (a directory of any
    #    mode, or a link): it is never used, the next name that is ours is.
    from pegaflow.platform import locks
    fake_shm = tmp_path / "shm"
    fake_shm.mkdir()
    planted = fake_shm / f"pegaflow-{os.geteuid()}"
    if squat == "link":
        (fake_shm / "elsewhere").mkdir(mode=0o700)
        os.symlink(fake_shm / "elsewhere", planted)
        os.lchown(planted, OTHER_UID, OTHER_UID)
    else:
        planted.mkdir()
        os.chmod(planted, 0o777 if squat == "dir777" else 0o700)
        os.chown(planted, OTHER_UID, OTHER_UID)
    fallback = locks.lock_dir(str(fake_shm))
    assert fallback == f"{planted}.1"
    st = os.lstat(fallback)
    assert st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o700
    # 2. Every process walks the same names: the next call meets in the same directory,
    #    even once the squatter's is gone (ours exists, so none is made under the first name).
    os.unlink(planted) if squat == "link" else os.rmdir(planted)
    assert locks.lock_dir(str(fake_shm)) == fallback and not planted.exists()


@needs_root
def test_foreign_lock_directories_all_taken_is_one_line_naming_owner_and_fix(tmp_path):
    from pegaflow.platform import locks
    fake_shm = tmp_path / "shm"
    fake_shm.mkdir()
    for i in range(locks.NUM_LOCK_DIRS):
        planted = fake_shm / (f"pegaflow-{os.geteuid()}" + (f".{i}" if i else ""))
        planted.mkdir(mode=0o700)
        os.chown(planted, OTHER_UID, OTHER_UID)
    with pytest.raises(ForeignSegmentError) as info:
        locks.lock_dir(str(fake_shm))
    message = str(info.value)
    assert "\n" not in message and "owned by uid 54321" in message and "rm -r" in message


@needs_root
def test_foreign_lock_directory_squatted_engine_and_client_still_meet(tmp_path, monkeypatch):
    # The squatted name under a stand-in /dev/shm: an engine (in a thread of this process)
    # starts, and a client attaches to it through the fallback directory.
    import threading

    from engine.config import EngineConfig
    from engine.process.server import EngineServer
    from pegaflow.platform import locks
    monkeypatch.setattr(locks, "SHM_BASE", str(tmp_path))
    planted = tmp_path / f"pegaflow-{os.geteuid()}"
    planted.mkdir(mode=0o755)
    os.chown(planted, OTHER_UID, OTHER_UID)
    server = EngineServer(EngineConfig(name=unique_engine_name("squat"), backend="host",
                                       pool_bytes=4 << 20, slab_bytes=1 << 20, num_slots=2), serve_own_process=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        client = EngineClient.connect(server.config.name, timeout_s=10.0)
        assert client.ping() == 0
        client.close()
        assert sorted(os.listdir(f"{planted}.1")) == [f"{server.config.name}.claims",
                                                      f"{server.config.name}.lock"]
    finally:
        server.request_stop()
        thread.join(10)
    assert not thread.is_alive() and os.listdir(planted) == []


@needs_root
@pytest.mark.parametrize("what", ["doorbell", "cq.0", "cq.3"])
def test_foreign_semaphore_planted_under_an_engine_name_is_replaced(engine_factory, what):
    # Another user's semaphore where the engine will create one: removed (one line) and
    # the engine starts, instead of exiting with a traceback.
    import posix_ipc
    name = unique_engine_name("forsem")
    planted = posix_ipc.Semaphore(shm.ipc_name(name, what), posix_ipc.O_CREX, mode=0o666, initial_value=5)
    planted.close()
    os.chown(_dev_shm("sem." + shm.ipc_name(name, what).lstrip("/")), OTHER_UID, OTHER_UID)
    engine = engine_factory(name)
    assert engine.connect().ping() == 0
    log = engine.stderr_text()
    assert "was there before this engine made it" in log and "Traceback" not in log


def test_foreign_semaphore_that_cannot_be_removed_is_one_typed_line(monkeypatch):
    # As a user who may not remove another's semaphore: a typed error, naming the fix.
    import posix_ipc

    def refuse(name):
        raise posix_ipc.PermissionsError("Permission denied")
    monkeypatch.setattr(posix_ipc, "unlink_semaphore", refuse)
    with pytest.raises(ForeignSegmentError, match="may not remove it") as info:
        shm.unlink_semaphore(shm.ipc_name("x", "doorbell"))
    assert "remove /dev/shm/sem.pegaflow." in str(info.value)
