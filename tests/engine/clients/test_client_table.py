"""engine.clients.client_table: claims accepted under the control lock, and checked (a real
engine's segments, in this process; a forked child, which maps them too, claims)."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import time

import pytest

from engine.config import EngineConfig
from engine.process.server import EngineServer
from pegaflow.platform.locks import ControlLock
from pegaflow.platform.wire import SlotState
from tests.conftest import shm_leftovers

_names = itertools.count()


@contextlib.contextmanager
def _child():
    """A child process that maps what we map (it inherits our mappings) until the end."""
    pid = os.fork()
    if pid == 0:
        signal.pause()
        os._exit(0)
    try:
        yield pid
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


@pytest.fixture
def server():
    name = f"t{os.getpid()}_claim{next(_names)}"
    server = EngineServer(EngineConfig(name=name, backend="host", pool_bytes=4 << 20,
                                       slab_bytes=1 << 20, num_slots=2))
    yield server
    server.shutdown()
    assert shm_leftovers(name) == []


def _claim(server, slot: int, pid: int) -> None:
    server.segments.slots["pid"][slot], server.segments.slots["state"][slot] = pid, SlotState.CLAIMED


def test_client_table_accepts_a_claim_only_under_the_control_lock(server):
    # A client that gives up on its attach frees its still-CLAIMED slot under the control
    # lock; the engine accepts under the same lock, so it never activates a slot given up.
    slots = server.segments.slots
    with _child() as pid:
        # 1. Slot 1 is claimed by the child; someone holds the control lock: it stays CLAIMED.
        _claim(server, 1, pid)
        other = ControlLock.open(server.config.name)
        other.acquire(1.0)
        server.table.accept_claims()
        assert int(slots["state"][1]) == SlotState.CLAIMED and 1 not in server.table.clients
        # 2. The lock free again: the claim is accepted.
        other.release()
        other.close()
        server.table.accept_claims()
        assert int(slots["state"][1]) == SlotState.ACTIVE and server.table.clients[1].pid == pid


@pytest.mark.parametrize("pid", [0, 1, 2**31 + 5, 2**32 - 1, "engine"])
def test_client_table_claim_under_no_clients_pid_is_freed_and_counted(server, pid):
    # A claim naming a pid no client has is never accepted: its slot is FREE again.
    _claim(server, 0, os.getpid() if pid == "engine" else pid)
    server.table.accept_claims()
    assert int(server.segments.slots["state"][0]) == SlotState.FREE and not server.table.clients
    assert server.stats._words[server.stats._at["clients_refused"]] == 1


def test_client_table_claimant_without_attach_is_closed_after_the_timeout(server):
    # 1. The child's claim is accepted; it never ATTACHes.
    server.table.attach_timeout_s = 0.05
    with _child() as pid:
        _claim(server, 1, pid)
        server.table.accept_claims()
        server.table.check_alive()
        assert 1 in server.table.clients  # not yet: within the timeout
        # 2. Past the timeout, housekeeping closes it and frees the slot.
        time.sleep(0.1)
        server.table.check_alive()
    assert 1 not in server.table.clients and int(server.segments.slots["state"][1]) == SlotState.FREE
    assert server.stats._words[server.stats._at["clients_refused"]] == 1


@pytest.mark.parametrize("state", [SlotState.FREE, 3, 2**32 - 1])
def test_client_table_slot_state_rewritten_closes_its_client(server, state):
    # 1. An accepted client writes a state into its slot that is not ACTIVE.
    with _child() as pid:
        _claim(server, 0, pid)
        server.table.accept_claims()
        server.segments.slots["state"][0] = state
        # 2. Housekeeping closes it, counted; the slot is FREE for the next claimant.
        server.table.check_alive()
    assert not server.table.clients and int(server.segments.slots["state"][0]) == SlotState.FREE
    assert server.stats._words[server.stats._at["clients_refused"]] == 1


def test_client_table_slot_claimed_again_replaces_its_client(server):
    # An accepted client marks its own slot CLAIMED again: the old client is closed and the
    # claim checked like any other (here the claimant's pid is still good: accepted anew).
    with _child() as pid:
        _claim(server, 0, pid)
        server.table.accept_claims()
        first = server.table.clients[0]
        server.segments.slots["state"][0] = SlotState.CLAIMED
        server.table.accept_claims()
        assert server.table.clients[0] is not first and first.close_reason
        assert int(server.segments.slots["state"][0]) == SlotState.ACTIVE


def test_client_table_stray_state_on_a_free_slot_is_freed(server):
    # A slot no client holds, with a state some client wrote after its slot was freed.
    server.segments.slots["state"][1] = 9
    server.table.check_alive()
    assert int(server.segments.slots["state"][1]) == SlotState.FREE


def _save_then_wait(conn, engine_name: str) -> None:
    """A child that registers its KV cache, submits a SAVE (held by the engine: never answered
    here), says so with its KV buffer's name, and waits to be killed."""
    import numpy as np

    from tests.engine.conftest import KVClient
    kv = KVClient(engine_name)
    kv.fill(np.random.default_rng(0), range(2))
    kv.client.submit_save(0x5AFE, [0, 1], [b"h" * 32, b"i" * 32])
    conn.send(kv.kv.name)
    conn.recv()


def _holding_backend(monkeypatch):
    """The host backend with --hold-saves as the cuda backend has it: each SAVE held in a real
    ``HeldSaves`` (engine/copy/held_saves.py) on a stand-in driver whose client work never
    ends (its marker never fires), and ended by ``CudaBackend.drop_held`` itself."""
    from types import SimpleNamespace

    from engine.copy.base import Direction
    from engine.copy.host import HostBackend
    cuda = pytest.importorskip("engine.copy.cuda")  # (held_saves, like it, needs cuda-python)
    held_saves = pytest.importorskip("engine.copy.held_saves")
    let_go = []  # streams and markers the driver was told to destroy
    for call, stand_in in (("use_device", lambda device: None), ("event_done", lambda event: False),
                           ("create_stream", lambda low_priority=True: "gate"), ("wait", lambda s, e: None),
                           ("record", lambda event, stream: None), ("destroy_stream", let_go.append),
                           ("destroy_event", let_go.append)):
        monkeypatch.setattr(held_saves.driver, call, stand_in)

    class HoldingBackend(HostBackend):
        drop_held = cuda.CudaBackend.drop_held  # (the product's: its ended SAVEs into ``_ready``)
        _ready = property(lambda self: self._done, lambda self, done: setattr(self, "_done", done))

        def __init__(self):
            super().__init__()
            self.held, self.let_go = held_saves.HeldSaves(), let_go
            self._held = self.held
            self.dev = SimpleNamespace(device=0, idle_events=[], event=lambda: "marker")

        def submit(self, op):
            if op.direction != Direction.SAVE:
                return super().submit(op)
            self.held.hold(self.dev, op, [], [])

        def poll(self):
            self.held.issue_ready(lambda held: HostBackend.submit(self, held.op), self._done)
            return super().poll()

        def num_inflight(self):
            return super().num_inflight() + len(self.held)

    return HoldingBackend()


def test_client_table_client_killed_while_its_save_is_held_is_reclaimed(monkeypatch):
    # 1. An engine whose backend holds every SAVE until its client's GPU has written the data
    #    (--hold-saves), and that data never comes: the client's process is killed meanwhile.
    import threading

    from pegaflow.platform import shm
    from tests.spawn import start_child

    name = f"t{os.getpid()}_held{next(_names)}"
    backend = _holding_backend(monkeypatch)
    server = EngineServer(EngineConfig(name=name, backend="host", pool_bytes=4 << 20, slab_bytes=1 << 20,
                                       num_slots=2), backend=backend)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    conn, child = start_child(_save_then_wait, name)
    kv_name = None
    try:
        assert conn.poll(30), "the client never saved"
        kv_name = conn.recv()
        deadline = time.monotonic() + 30
        while not len(backend.held):
            assert time.monotonic() < deadline, "the SAVE never reached the backend"
            time.sleep(0.01)
        child.kill()
        child.join(30)
        # 2. The engine ends the held SAVE (its data will never be written) and reclaims the
        #    slot: nothing stays in flight, no client is left.
        while server.table.clients or backend.num_inflight():
            assert time.monotonic() < deadline, "the killed client's slot was never reclaimed"
            time.sleep(0.01)
        assert not len(backend.held) and server.dispatcher.pending == {}
        assert backend.let_go == ["gate", "marker"]  # let go without waiting for the client's GPU
    finally:
        if child.is_alive():
            child.kill()
        if kv_name is not None:
            shm.unlink_segment(kv_name)
        server.request_stop()
        thread.join(30)
    assert not thread.is_alive() and shm_leftovers(name) == []
