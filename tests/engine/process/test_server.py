"""The engine process's life: start, refuse a second, clients coming and going, shutdown.

Most tests run ``python -m engine`` as a subprocess (``engine`` / ``engine_factory`` in
``tests/conftest.py``, whose teardown also checks the exit code and /dev/shm).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import pegaflow.client.connection
from engine.config import EngineConfig
from engine.process.server import EngineServer
from pegaflow.client.connection import EngineClient
from pegaflow.platform import shm
from pegaflow.platform.errors import EngineGoneError, EngineNotRunningError, NoFreeSlotError, WireVersionError
from pegaflow.platform.wire import (
    CONTROL_HEADER,
    RING_HEADER,
    SLOT,
    Opcode,
    SlotState,
    Status,
    encode_hashes,
)
from tests.conftest import readline_within

NAMESPACE = 0x5E7
SIGTERM_EXIT_S = 60.0  # a wait for the exit, not a bound on it
WAIT_S = 30.0  # how long a test waits for what should take milliseconds
REPO_ROOT = Path(__file__).resolve().parents[3]
_names = itertools.count()


def shm_entries(name: str) -> list[str]:
    prefix = f"pegaflow.{os.getuid()}.{name}."
    return sorted(e for e in os.listdir("/dev/shm") if e.startswith(prefix) or e.startswith(f"sem.{prefix}"))


def slot_table(name: str, num_slots: int) -> list[tuple[int, int]]:
    """(state, pid) of every client slot, read from the control segment."""
    control = shm.attach_segment(shm.ipc_name(name, "control"), readonly=True)
    try:
        slots = control.array(SLOT, num_slots, CONTROL_HEADER.itemsize).copy()
    finally:
        control.close()
    return [(int(s["state"]), int(s["pid"])) for s in slots]


def test_server_sigterm_unlinks_every_segment_and_exits_0(engine, kv_client, rng, make_hashes):
    kv = kv_client(engine)
    hashes = make_hashes(4)
    kv.fill(rng, range(4))
    assert kv.save(NAMESPACE, range(4), hashes).value == 4
    assert kv.client.lookup(NAMESPACE, hashes).num_hit_blocks == 4  # a lease still held
    # 1. While it runs, the engine's segments and semaphores exist.
    names = shm_entries(engine.name)
    prefix = f"pegaflow.{os.getuid()}.{engine.name}."
    assert {prefix + w for w in ("control", "stats", "pool", "ring.0", "ring.7")} <= set(names)
    assert {f"sem.{prefix}{w}" for w in ("doorbell", "cq.0", "cq.7")} <= set(names)
    from pegaflow.platform.locks import lock_path
    assert os.path.exists(lock_path(engine.name, "claims"))
    # 2. SIGTERM: it exits 0 by itself, with a client still attached (how fast is for
    #    tools/bench_engine_start.py to say; here it is waited for generously).
    assert engine.stop(signal.SIGTERM, timeout_s=SIGTERM_EXIT_S) == 0
    # 3. Everything it created is gone; the client's own KV buffer is the client's to unlink.
    assert shm_entries(engine.name) == []
    assert not os.path.exists(lock_path(engine.name, "claims"))
    assert os.path.exists("/dev/shm/" + kv.kv.name.lstrip("/"))
    assert "stopped" in engine.stderr_text()


def test_server_sigint_also_stops_cleanly(engine):
    assert engine.stop(signal.SIGINT, timeout_s=SIGTERM_EXIT_S) == 0
    assert shm_entries(engine.name) == []


def wait_until_asleep(engine, timeout_s: float = 30.0, poll_s: float = 1e-3) -> None:
    control = shm.attach_segment(shm.ipc_name(engine.name, "control"), readonly=True)
    header = control.array(CONTROL_HEADER, 1)
    deadline = time.monotonic() + timeout_s
    while not header["engine_sleeping"][0]:
        assert time.monotonic() < deadline, "the idle engine never went to sleep"
        time.sleep(poll_s)
    del header
    control.close()


def is_asleep(engine) -> bool:
    control = shm.attach_segment(shm.ipc_name(engine.name, "control"), readonly=True)
    header = control.array(CONTROL_HEADER, 1)
    asleep = bool(header["engine_sleeping"][0])
    del header
    control.close()
    return asleep


def test_server_idle_spin_flag_keeps_polling_that_long_after_work(engine_factory):
    # 1. An engine told to poll for a second after its last work, answering a ping.
    engine = engine_factory(extra=("--idle-spin-ms", "1000"))
    client = engine.connect()
    try:
        client.ping()
        answered = time.monotonic()
        # 2. It sleeps once the second is over, not before: the first moment it is seen
        #    asleep is at least that long after the answer (a stalled test sees it later:
        #    never sooner than it fell asleep).
        wait_until_asleep(engine, poll_s=0.0)
        assert time.monotonic() - answered >= 0.9
        # 3. Asleep, it still answers: the doorbell wakes it.
        assert client.ping() == 0
    finally:
        client.close()


def wait_until_stopped(pid: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, f"pid {pid} did not stop"
        time.sleep(1e-3)


def test_server_sigterm_with_a_queued_command_answers_it_once_and_exits_0(engine):
    client = engine.connect()
    try:
        # 1. Once the engine is idle (asleep on its doorbell), freeze it, queue a PING it
        #    has not seen, then ask it to stop.
        wait_until_asleep(engine)
        os.kill(engine.pid, signal.SIGSTOP)
        wait_until_stopped(engine.pid)
        command_id = client.submit(Opcode.PING)
        os.kill(engine.pid, signal.SIGTERM)
        os.kill(engine.pid, signal.SIGCONT)
        # 2. The engine exits 0, and the PING got exactly one answer: SHUTTING_DOWN, or OK if
        #    the engine handled it before it noticed the signal (the in-process test below
        #    pins the SHUTTING_DOWN path down).
        assert engine.proc.wait(SIGTERM_EXIT_S) == 0
        assert client.wait(command_id, timeout_s=1.0).status in (Status.SHUTTING_DOWN, Status.OK)
        assert client.poll() == []
    finally:
        if engine.proc.poll() is None:
            os.kill(engine.pid, signal.SIGCONT)  # never leave a frozen engine to the teardown
        client.close()


def test_server_attached_client_gets_engine_gone_not_a_hang(engine):
    client = engine.connect()
    try:
        # 1. The engine stops while a client is attached.
        assert engine.stop() == 0
        # 2. The client's next command fails with EngineGoneError when it looks, not at its
        #    deadline (an hour: a wait for it would outlast this generous one).
        raised = []

        def ping():
            with pytest.raises(EngineGoneError):
                client.ping(timeout_s=3600.0)
            raised.append(True)
        pinger = threading.Thread(target=ping, daemon=True)
        pinger.start()
        pinger.join(WAIT_S)
        assert raised == [True]
    finally:
        client.close()


def test_server_second_engine_with_same_name_refuses_to_start(engine, engine_factory):
    before = shm_entries(engine.name)
    # 1. Start a second engine under the running one's name.
    second = engine_factory(engine.name, wait=False)
    second.is_clean_exit_expected = False
    returncode = second.proc.wait(30)
    # 2. It exits 1 and says why, naming the running engine.
    assert returncode == 1
    message = second.stderr_text()
    assert "already running" in message and engine.name in message and str(engine.pid) in message
    # 3. The first engine lost nothing and still serves.
    assert shm_entries(engine.name) == before
    client = engine.connect()
    assert client.ping() == 0
    client.close()


@pytest.mark.parametrize("attempt", range(4))
def test_server_two_engines_started_at_once_under_one_name_leave_one_running(engine_factory, attempt):
    # 1. Two engines race for one name (each creates its segments while the other does).
    name = f"t{os.getpid()}_race{attempt}_{next(_names)}"
    first, second = engine_factory(name, wait=False), engine_factory(name, wait=False)
    first.is_clean_exit_expected = second.is_clean_exit_expected = False
    deadline = time.monotonic() + 5.0
    while first.proc.poll() is None and second.proc.poll() is None:
        if time.monotonic() > deadline:
            pytest.fail("neither engine gave way: both run under one name")
        time.sleep(0.01)
    # 2. Exactly one of them gives way, with exit code 1; the other keeps serving.
    loser, winner = (first, second) if first.proc.poll() is not None else (second, first)
    assert loser.proc.returncode == 1, loser.stderr_text()
    assert "already running" in loser.stderr_text() and "Traceback" not in loser.stderr_text()
    winner.is_clean_exit_expected = True
    client = winner.connect()
    assert client.engine_pid == winner.pid
    client.close()


def test_server_restart_after_a_crash_removes_stale_segments(engine_factory):
    # 1. An engine dies by SIGKILL: it cannot unlink anything.
    crashed = engine_factory()
    crashed.is_clean_exit_expected = False
    assert crashed.stop(signal.SIGKILL) == -signal.SIGKILL
    assert shm_entries(crashed.name) != []
    # 2. A new engine under the same name starts anyway and serves.
    restarted = engine_factory(crashed.name)
    assert "dead engine" in restarted.stderr_text()
    client = restarted.connect()
    assert client.ping() == 0
    client.close()
    # 3. (teardown) when it stops, nothing of either engine is left in /dev/shm.


def test_server_absent_engine_connect_raises_engine_not_running(engine):
    with pytest.raises(EngineNotRunningError):
        EngineClient.connect(engine.name + "_absent", timeout_s=1.0)
    # 1. Also after a real engine stopped and unlinked its name.
    assert engine.stop() == 0
    with pytest.raises(EngineNotRunningError):
        EngineClient.connect(engine.name, timeout_s=1.0)


@pytest.mark.parametrize("constant", ["WIRE_VERSION", "FINGERPRINT"])
def test_server_client_of_another_wire_version_gets_wire_version_error(engine, monkeypatch, constant):
    engine.wait_stats(lambda s: s["clients_attached"] == 0)
    # 1. A client built from another wire layout attaches.
    import pegaflow.client.slots
    monkeypatch.setattr(pegaflow.client.slots, constant, getattr(pegaflow.client.slots, constant) + 1)
    with pytest.raises(WireVersionError, match="wire version"):
        EngineClient.connect(engine.name, timeout_s=2.0)
    monkeypatch.undo()
    # 2. It was turned away before claiming a slot, and the engine serves matching clients.
    assert all(state == SlotState.FREE for state, _ in slot_table(engine.name, 8))
    client = engine.connect()
    assert client.ping() == 0
    client.close()


def test_server_detached_client_frees_its_slot(engine):
    engine.wait_stats(lambda s: s["clients_attached"] == 0)
    # 1. Attach: one slot ACTIVE under our pid.
    client = engine.connect()
    assert slot_table(engine.name, 8)[client.slot] == (SlotState.ACTIVE, os.getpid())
    engine.wait_stats(lambda s: s["clients_attached"] == 1)
    # 2. Detach: the slot is FREE again.
    client.close()
    engine.wait_stats(lambda s: s["clients_attached"] == 0)
    assert slot_table(engine.name, 8)[client.slot][0] == SlotState.FREE


def test_server_unattended_engine_wakes_for_a_new_client(engine):
    # 1. Attach and leave: nothing attached, leased or half written, so the engine sleeps
    #    until rung (its unattended sleep is far longer than this test).
    engine.connect().close()
    engine.wait_stats(lambda s: s["clients_attached"] == 0)
    time.sleep(2.5)  # past two housekeeping periods: the engine is in its long sleep
    # 2. A new client's claim rings the engine: it attaches within its 3 s deadline.
    client = EngineClient.connect(engine.name, timeout_s=3.0)
    try:
        assert client.ping() == 0  # no copies in flight
    finally:
        client.close()


def test_server_client_that_closed_its_ring_frees_its_slot(engine):
    engine.wait_stats(lambda s: s["clients_attached"] == 0)
    # 1. A live client unmaps without DETACH (as after an engine error): its slot is freed.
    client = engine.connect()
    client.close(detach=False)
    engine.wait_stats(lambda s: s["clients_attached"] == 0)
    assert slot_table(engine.name, 8)[client.slot][0] == SlotState.FREE
    # 2. One that sends DETACH but unmaps before reading the answer (a DETACH deadline):
    #    freed too, though the answer is never read.
    client = engine.connect()
    client.submit(Opcode.DETACH)
    client.close(detach=False)
    engine.wait_stats(lambda s: s["clients_attached"] == 0)
    assert slot_table(engine.name, 8)[client.slot][0] == SlotState.FREE
    # 3. One whose DETACH was answered and read leaves the flag down: its slot may already
    #    be another client's, whom the flag would get reclaimed.
    client = engine.connect()
    client.close()
    ring = shm.attach_segment(shm.ipc_name(engine.name, f"ring.{client.slot}"))
    try:
        assert int(ring.array(RING_HEADER, 1)[0]["client_closed"]) == 0
    finally:
        ring.close()


def test_server_connect_that_times_out_gives_its_slot_back(engine):
    # 1. The engine is stopped, so it never accepts a claim: connect times out.
    engine.wait_stats(lambda s: s["clients_attached"] == 0)
    os.kill(engine.pid, signal.SIGSTOP)
    try:
        with pytest.raises(pegaflow.client.connection.EngineTimeoutError):
            EngineClient.connect(engine.name, timeout_s=0.3)
        # 2. The claim was taken back: no slot is left CLAIMED under our pid.
        assert all(state != SlotState.CLAIMED for state, _ in slot_table(engine.name, 8))
    finally:
        os.kill(engine.pid, signal.SIGCONT)  # never leave a frozen engine to the teardown
    # 3. The engine, running again, serves new clients and holds no stray slot.
    client = engine.connect()
    assert client.ping() == 0
    client.close()
    engine.wait_stats(lambda s: s["clients_attached"] == 0)
    assert all(state == SlotState.FREE for state, _ in slot_table(engine.name, 8))


def test_server_all_slots_taken_raises_no_free_slot(engine_factory):
    engine = engine_factory(max_clients=2)
    engine.wait_stats(lambda s: s["clients_attached"] == 0)
    clients = [engine.connect(), engine.connect()]
    try:
        # 1. A third client finds no slot and is told so at once.
        with pytest.raises(NoFreeSlotError):
            EngineClient.connect(engine.name, timeout_s=2.0)
        # 2. The two attached clients are unaffected.
        assert all(c.ping() == 0 for c in clients)
    finally:
        for c in clients:
            c.close()


CHILD_CLIENT = r"""
import json, sys, time  # argv[1]: the repository root (the cwd, so on sys.path)
from pegaflow.client.connection import EngineClient
from pegaflow.client.host_memory import HostKVBuffer, layer_major_records
name, namespace = sys.argv[2], int(sys.argv[3])
leased = [bytes.fromhex(h) for h in sys.argv[4].split(",")]
unfinished = [bytes.fromhex(h) for h in sys.argv[5].split(",")]
layers, blocks, page = 4, 64, 4096
kv = HostKVBuffer(layers * blocks * page, "tkvchild")
client = EngineClient.connect(name)
client.register_region(0, kv.region_record(blocks, page, layers), layer_major_records(layers, blocks, page))
found = client.lookup(namespace, leased)
saved = client.wait(client.submit_save(namespace, range(len(unfinished)), unfinished, layer=0))
print(json.dumps({"slot": client.slot, "hits": found.num_hit_blocks, "lease": found.lease_id,
                  "saved_ok": saved.is_ok, "buffer": kv.name}), flush=True)
time.sleep(120)
"""


def engine_maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as maps:
        return maps.read()


def test_server_killed_client_slot_leases_and_memory_are_reclaimed(engine, kv_client, rng, make_hashes):
    kv = kv_client(engine)
    stored, unfinished = make_hashes(4), make_hashes(2)
    kv.fill(rng, range(4))
    assert kv.save(NAMESPACE, range(4), stored).value == 4
    # 1. A client process registers its KV memory, leases the 4 blocks, and saves only
    #    layer 0 of 2 new blocks (left half-written); then it is killed mid-flight.
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD_CLIENT, str(REPO_ROOT), engine.name, str(NAMESPACE),
         ",".join(h.hex() for h in stored), ",".join(h.hex() for h in unfinished)],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    buffer_name = None
    try:
        report = json.loads(readline_within(child) or "{}")
        assert report.get("hits") == 4 and report["lease"] and report["saved_ok"], child.stderr.read()
        buffer_name = report["buffer"]
        # 2. While it lives: its slot is ACTIVE, its lease and half-written blocks count,
        #    and the engine has its KV memory mapped.
        assert slot_table(engine.name, 8)[report["slot"]] == (SlotState.ACTIVE, child.pid)
        live = engine.wait_stats(lambda s: s["leases_active"] == 1 and s["clients_attached"] == 2)
        assert live["pool_blocks_used"] == 4 + 2
        assert buffer_name.lstrip("/") in engine_maps(engine.pid)
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        # 3. The engine notices: the lease ends, the half-written blocks go, the slot is FREE.
        engine.wait_stats(lambda s: (s["leases_active"], s["clients_attached"], s["pool_blocks_used"]) == (0, 1, 4))
        assert slot_table(engine.name, 8)[report["slot"]] == (SlotState.FREE, 0)
        # 4. It unmapped the dead client's memory.
        assert buffer_name.lstrip("/") not in engine_maps(engine.pid)
        # 5. The blocks the dead client leased are still stored and now free to load.
        assert kv.num_hits(NAMESPACE, stored) == 4
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
        child.stderr.close()
        if buffer_name:
            shm.unlink_segment(buffer_name)


def test_server_pipelined_lookups_through_a_small_arena_get_their_own_answers(
        engine_factory, kv_client, rng, make_hashes):
    engine = engine_factory(arena_size="4KiB")
    kv = kv_client(engine)
    stored, absent = make_hashes(80), make_hashes(80)
    kv.fill(rng, range(64))
    assert kv.save(NAMESPACE, range(64), stored[:64]).value == 64
    assert kv.save(NAMESPACE, range(16), stored[64:]).value == 16
    stored_records, absent_records = encode_hashes(stored), encode_hashes(absent)
    # 1. Alternate LOOKUPs of 80 stored and 80 absent hashes (3200 bytes each, so every
    #    payload reuses the bytes of the one before), keeping 8 in flight.
    in_flight, wrong = [], []
    for i in range(4000):
        records, expected = (stored_records, 80) if i % 2 == 0 else (absent_records, 0)
        in_flight.append((kv.client.submit(Opcode.LOOKUP, payload=[records], num_items=80,
                                           namespace=NAMESPACE), expected))
        if len(in_flight) > 8 or i == 3999:
            for command_id, want in in_flight[:len(in_flight) - 8 if i < 3999 else None]:
                done = kv.client.wait(command_id)
                if (done.status, done.value) != (Status.OK, want):
                    wrong.append((done.status.name, done.value, want))
            in_flight = in_flight[-8:] if i < 3999 else []
    # 2. Each answer is about the hashes of its own LOOKUP.
    assert wrong == [], f"{len(wrong)} of 4000 lookups answered for other bytes, e.g. {wrong[:3]}"


# -- in-process engine: interleavings a subprocess cannot pin down ------------------------


@pytest.fixture
def inprocess_engine():
    """An EngineServer in a thread of this process, with a 4 KiB payload arena per client."""
    name = f"t{os.getpid()}_inproc{next(_names)}"
    server = EngineServer(EngineConfig(name=name, backend="host", pool_bytes=4 << 20, slab_bytes=1 << 20,
                                       num_slots=2, ring_slots=16, arena_bytes=4096), serve_own_process=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.request_stop()
    thread.join(10)
    assert not thread.is_alive()
    assert shm_entries(name) == []


def test_server_payload_is_copied_before_it_is_handled(inprocess_engine, kv_client, rng,
                                                                      make_hashes, monkeypatch):
    server = inprocess_engine
    kv = kv_client(server.config)
    hashes = make_hashes(80)  # 80 hash records: 3200 bytes of a 4096-byte arena
    kv.fill(rng, range(kv.NUM_BLOCKS))
    assert kv.save(NAMESPACE, range(64), hashes[:64]).value == 64
    assert kv.save(NAMESPACE, range(16), hashes[64:]).value == 16
    # 1. When the LOOKUP's handler runs, the client (here, in the engine's thread, at exactly
    #    that moment) writes other hashes over the command's payload.  A client may not, but
    #    the engine must not depend on it: it handles its own copy (``Dispatcher.handle``).
    original_lookup = server.dispatcher.handlers[Opcode.LOOKUP]
    overwritten = []

    def lookup_after_client_reuse(received, lookup):
        if lookup.namespace == NAMESPACE and not overwritten:
            arena = kv.client._view.arena
            arena[:] = np.resize(encode_hashes(make_hashes(80)).view(np.uint8), arena.shape)
            overwritten.append(True)
        return original_lookup(received, lookup)

    monkeypatch.setitem(server.dispatcher.handlers, Opcode.LOOKUP, lookup_after_client_reuse)
    # 2. The LOOKUP still sees the 80 hashes the client sent, not the bytes written after.
    found = kv.client.lookup(NAMESPACE, hashes)
    assert overwritten, "the LOOKUP never reached the dispatcher"
    assert found.num_hit_blocks == 80


def test_server_shutdown_answers_queued_commands_with_shutting_down(inprocess_engine, monkeypatch):
    server = inprocess_engine
    client = EngineClient.connect(server.config.name)
    try:
        # 1. The engine stops taking commands off the rings (as if busy elsewhere).
        is_frozen = threading.Event()

        def frozen_drain() -> bool:
            is_frozen.set()
            return False

        monkeypatch.setattr(server, "_drain_rings", frozen_drain)
        assert is_frozen.wait(5) and is_frozen.wait(0)
        is_frozen.clear()
        assert is_frozen.wait(5)  # a whole frozen round has passed: nothing is mid-drain
        # 2. Two commands wait on the ring when the engine is asked to stop.
        request_ids = [client.submit(Opcode.PING), client.submit(Opcode.RELEASE, arg=1)]
        server.request_stop()
        # 3. Shutdown answers each of them, once, with SHUTTING_DOWN.
        assert [client.wait(r, timeout_s=5.0).status for r in request_ids] == [Status.SHUTTING_DOWN] * 2
        assert client.poll() == []
    finally:
        client.close()


def test_engine_server_loop_that_fails_still_stops_and_leaves_nothing_behind(tmp_path, monkeypatch, caplog):
    # 1. An engine (in this process, its lock files under a stand-in /dev/shm) whose loop
    #    raises on its first pass (a bug, a backend error nobody caught).
    from pegaflow.platform import locks
    from tests.conftest import shm_leftovers
    monkeypatch.setattr(locks, "SHM_BASE", str(tmp_path))
    name = f"t{os.getpid()}_loopfail"
    server = EngineServer(EngineConfig(name=name, backend="host", pool_bytes=4 << 20, slab_bytes=1 << 20,
                                       num_slots=2))

    def failing_pass(now):
        raise RuntimeError("a pass that fails")

    monkeypatch.setattr(server, "run_once", failing_pass)
    # 2. serve_forever raises it, logged, after the stop: segments, lock files and their
    #    directory gone.
    with pytest.raises(RuntimeError, match="a pass that fails"):
        server.serve_forever()
    assert "its loop failed; stopping" in caplog.text
    assert shm_leftovers(name) == [] and not (tmp_path / f"pegaflow-{os.geteuid()}").exists()
