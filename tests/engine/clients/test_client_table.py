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
from pegaflow.platform.wire import STATS, SlotState, Status
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


def _holding_backend(monkeypatch, event_done=lambda event: False, destroy=None):
    """The host backend with --hold-saves as the cuda backend has it: each SAVE held in a real
    ``HeldSaves`` (engine/copy/held_saves.py) on a stand-in driver whose client work never
    ends (its marker never fires; ``event_done`` its query), and ended by
    ``CudaBackend.drop_held`` itself; ``destroy``: the driver's destroy of a stream or event
    (by default it succeeds, each handle listed in ``let_go``)."""
    from types import SimpleNamespace

    from engine.copy.base import Direction
    from engine.copy.host import HostBackend
    cuda = pytest.importorskip("engine.copy.cuda")  # (held_saves, like it, needs cuda-python)
    held_saves = pytest.importorskip("engine.copy.held_saves")
    let_go = []  # streams and markers the driver was told to destroy
    destroy = destroy or let_go.append
    for call, stand_in in (("use_device", lambda device: None), ("event_done", event_done),
                           ("create_stream", lambda low_priority=True: "gate"), ("wait", lambda s, e: None),
                           ("record", lambda event, stream: None), ("destroy_stream", destroy),
                           ("destroy_event", destroy)):
        monkeypatch.setattr(held_saves.driver, call, stand_in)

    class HoldingBackend(HostBackend):
        drop_held = cuda.CudaBackend.drop_held  # (the product's: its ended SAVEs into ``_ready``)
        _end_held = cuda.CudaBackend._end_held
        _ready = property(lambda self: self._done, lambda self, done: setattr(self, "_done", done))

        def __init__(self):
            super().__init__()
            self.held, self.let_go = held_saves.HeldSaves(), let_go
            self._held, self._gone, self._num_waits_let_go = self.held, set(), 0
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


def _kill_a_client_whose_save_is_held(backend, on_kill=lambda: None) -> None:
    """An engine on ``backend`` (a ``_holding_backend``) in a thread; a client process submits
    a SAVE the engine holds, then is killed (``on_kill`` right after); the engine must end the
    held SAVE and reclaim the slot, then stop leaving nothing behind."""
    import threading

    from pegaflow.platform import shm
    from tests.spawn import start_child

    name = f"t{os.getpid()}_held{next(_names)}"
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
        on_kill()
        # The engine ends the held SAVE (its data will never be written) and reclaims the
        # slot: nothing stays in flight, no client is left.
        while server.table.clients or backend.num_inflight():
            assert thread.is_alive(), "the engine's loop died"
            assert time.monotonic() < deadline, "the killed client's slot was never reclaimed"
            time.sleep(0.01)
        assert not len(backend.held) and server.dispatcher.pending == {}
        stats = server.segments.stats.array(STATS, 1)[0]
        assert int(stats["errors_by_status"][Status.COPY_FAILED]) == 1  # the SAVE's answer
    finally:
        if child.is_alive():
            child.kill()
        if kv_name is not None:
            shm.unlink_segment(kv_name)
        server.request_stop()
        thread.join(30)
    assert not thread.is_alive() and shm_leftovers(name) == []


def test_client_table_client_killed_while_its_save_is_held_is_reclaimed(monkeypatch):
    # An engine whose backend holds every SAVE until its client's GPU has written the data
    # (--hold-saves), and that data never comes: the client's process is killed meanwhile.
    backend = _holding_backend(monkeypatch)
    _kill_a_client_whose_save_is_held(backend)
    assert backend.let_go == ["gate", "marker"]  # let go without waiting for the client's GPU


def test_client_table_client_killed_while_its_save_is_held_is_reclaimed_when_the_driver_refuses_the_release(
        monkeypatch, caplog):
    # The driver refuses to destroy the gone client's gate stream and marker (an error of its
    # dead context): the held SAVE still ends, the slot is still reclaimed, and why is logged.
    from pegaflow.platform.errors import CudaError

    def refused(handle):
        raise CudaError(f"cuEventDestroy: CUDA_ERROR_LAUNCH_FAILED ({handle})")

    backend = _holding_backend(monkeypatch, destroy=refused)
    _kill_a_client_whose_save_is_held(backend)
    assert "letting go of its held saves' gate" in caplog.text and "CUDA_ERROR_LAUNCH_FAILED" in caplog.text


def test_client_table_client_killed_while_its_save_is_held_is_reclaimed_when_its_marker_query_fails(
        monkeypatch, caplog):
    # Once the client is killed, querying the held SAVE's marker fails (the wait on its event
    # errors out) and so does destroying the marker: the SAVE ends COPY_FAILED with the reason
    # logged, the slot is reclaimed, the engine serves on.
    from pegaflow.platform.errors import CudaError
    is_killed = []

    def query(event):
        if is_killed:
            raise CudaError("cuEventQuery: CUDA_ERROR_LAUNCH_FAILED")
        return False

    def destroy(handle):
        if is_killed:
            raise CudaError("cuEventDestroy: CUDA_ERROR_LAUNCH_FAILED")

    backend = _holding_backend(monkeypatch, event_done=query, destroy=destroy)
    _kill_a_client_whose_save_is_held(backend, on_kill=lambda: is_killed.append(True))
    assert "its client's data was never written" in caplog.text or "held saves ended" in caplog.text
