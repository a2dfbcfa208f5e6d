"""engine/copy/held_saves.py: with --hold-saves a SAVE whose client's GPU is still writing waits
in the engine, not in a stream every client's saves share; CudaBackend on a stand-in driver
(no GPU needed)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from engine.copy.base import CopyDone, CopyOp, Direction

cuda = pytest.importorskip("engine.copy.cuda")  # (held_saves, like it, needs cuda-python)
held_saves = pytest.importorskip("engine.copy.held_saves")


def _op(token, direction=Direction.SAVE, slot=1, wait_event=4, per_layer=True, layers=3):
    return CopyOp(token, direction, slot, [object()] * layers, 64, np.arange(2), np.arange(2) * 64,
                  wait_event=wait_event, wait_per_layer=per_layer)


class _Driver:
    """The driver calls held_saves makes, on plain objects: a wait binds to the client event's
    record issued so far (its ``generation``), a marker fires once that record has."""

    def __init__(self, monkeypatch):
        self.done_generation: dict[str, int] = {}  # client event -> the last record that ran
        self.generation: dict[str, int] = {}       # client event -> records issued
        self.streams, self.destroyed = [], []
        self._pending = {}  # marker -> [(client event, generation it waits for)]
        self._waits = []
        for module in (cuda, held_saves):
            monkeypatch.setattr(module.driver, "use_device", lambda device: None)
            monkeypatch.setattr(module.driver, "event_done", self.event_done)
        monkeypatch.setattr(held_saves.driver, "create_stream", self.create_stream)
        monkeypatch.setattr(held_saves.driver, "wait", self.wait)
        monkeypatch.setattr(held_saves.driver, "record", self.record)
        monkeypatch.setattr(held_saves.driver, "destroy_stream", lambda s: self.destroyed.append(s))
        monkeypatch.setattr(held_saves.driver, "destroy_event", lambda e: self.destroyed.append(e))

    def create_stream(self, low_priority=True):
        self.streams.append(f"stream{len(self.streams)}")
        return self.streams[-1]

    def client_records(self, event):
        self.generation[event] = self.generation.get(event, 0) + 1

    def client_work_done(self, event):
        self.done_generation[event] = self.generation[event]

    def wait(self, stream, event):
        self._waits.append((event, self.generation.get(event, 0)))

    def record(self, marker, stream):
        self._pending[marker], self._waits = self._waits, []

    def event_done(self, event):
        if event in self._pending:  # an engine marker: every wait before it done
            return all(self.done_generation.get(client, 0) >= generation
                       for client, generation in self._pending[event])
        return self.done_generation.get(event, 0) >= self.generation.get(event, 0)


def _device():
    markers = iter(range(100))
    dev = SimpleNamespace(device=0, idle_events=[])
    dev.event = lambda: dev.idle_events.pop() if dev.idle_events else f"marker{next(markers)}"
    return dev


def _backend(monkeypatch, hold_saves=True):
    backend = object.__new__(cuda.CudaBackend)
    backend._inflight, backend._ready, backend._held = [], [], held_saves.HeldSaves()
    backend.hold_saves, backend.started = hold_saves, []
    dev = _device()
    events = [f"event{i}" for i in range(8)]
    backend._clients = SimpleNamespace(events=lambda slot, device: events, close_slot=lambda slot: [])
    backend._gone, backend._releaser, backend._num_waits_let_go = set(), cuda.Releaser(), 0
    monkeypatch.setattr(backend, "_validate", lambda op: [SimpleNamespace(device=0)], raising=False)
    monkeypatch.setattr(backend, "_device", lambda device: dev, raising=False)
    backend.issued = []
    monkeypatch.setattr(backend, "_start", lambda dev, op, regions: (backend.started.append(op.token),
                                                                    backend.issued.append(op)), raising=False)
    return backend, dev


def test_last_wait_event_is_the_last_layers_or_the_one_event():
    assert held_saves.last_wait_event(_op(1)) == 4 + 2  # events 4, 5, 6 for layers 0, 1, 2
    assert held_saves.last_wait_event(_op(1, per_layer=False)) == 4
    assert held_saves.last_wait_event(_op(1, wait_event=None)) is None
    assert held_saves.last_wait_event(_op(1, direction=Direction.LOAD)) is None


def test_cuda_backend_holds_a_save_until_its_clients_data_is_written(monkeypatch):
    gpu = _Driver(monkeypatch)
    backend, dev = _backend(monkeypatch)
    gpu.client_records("event3")
    gpu.client_work_done("event3")
    for layer_event in ("event4", "event5", "event6"):  # the step that writes the SAVE's layers
        gpu.client_records(layer_event)
    gpu.client_work_done("event4")  # layer 0 written, layers 1 and 2 not yet
    # 1. A SAVE whose last layer's event (6) has not fired is held: nothing issued, yet in flight.
    backend.submit(_op(1))
    assert backend.started == [] and backend.num_inflight() == 1
    # 2. A LOAD, and a SAVE whose one event (3) has fired, are issued at once, not behind it.
    backend.submit(_op(2, direction=Direction.LOAD, wait_event=None))
    backend.submit(_op(3, wait_event=3, per_layer=False))
    assert backend.started == [2, 3]
    # 3. The client records event 6 again for its next step before the first one ends: the held
    #    SAVE waits for the record it came after, not for the newer one.
    assert backend.poll() == [] and backend.started == [2, 3]
    for layer_event in ("event4", "event5", "event6"):
        gpu.client_records(layer_event)
    gpu.done_generation["event5"] = gpu.done_generation["event6"] = 1  # step 1 done, step 2 not
    backend.poll()
    assert backend.started == [2, 3, 1] and backend.num_inflight() == 0
    # ... and it went without its waits on the client's events (they would bind to step 2's).
    assert backend.issued[-1].wait_event is None and backend.issued[-1].token == 1
    # 4. Its marker went back to the device's idle events; one stream per client and device.
    assert dev.idle_events == ["marker0"] and gpu.streams == ["stream0"]


def test_cuda_backend_without_hold_saves_issues_a_save_at_once(monkeypatch):
    gpu = _Driver(monkeypatch)
    backend, _ = _backend(monkeypatch, hold_saves=False)
    gpu.client_records("event6")
    backend.submit(_op(1))
    assert backend.started == [1] and gpu.streams == [] and backend.issued[0].wait_event == 4


def test_cuda_backend_a_held_save_of_a_client_that_leaves_ends_with_an_error(monkeypatch):
    gpu = _Driver(monkeypatch)
    backend, _ = _backend(monkeypatch)
    gpu.client_records("event6")
    backend.submit(_op(7, slot=2))
    backend.unregister_client(2)
    done = backend.poll()
    assert backend.started == [] and done == [CopyDone(7, "the client left before its data to save was written")]
    assert gpu.destroyed == ["stream0", "marker0"]  # let go without waiting on the gone client


def test_cuda_backend_a_held_save_whose_clients_work_failed_ends_with_an_error(monkeypatch):
    # Its marker reports an error (the client's GPU work failed): issued now, without its waits,
    # it would copy bytes never written; it ends its command with the error instead.
    from pegaflow.platform.errors import CudaError
    gpu = _Driver(monkeypatch)
    backend, dev = _backend(monkeypatch)
    gpu.client_records("event6")
    backend.submit(_op(8))
    marker = gpu.streams and next(iter(gpu._pending))
    event_done = gpu.event_done

    def failing(event):
        if event == marker:
            raise CudaError("cuEventQuery: an illegal memory access was encountered")
        return event_done(event)
    monkeypatch.setattr(held_saves.driver, "event_done", failing)
    done = backend.poll()
    assert backend.started == [] and done == [CopyDone(8, "CudaError: cuEventQuery: an illegal memory access "
                                                          "was encountered")]
    assert backend.num_inflight() == 0 and marker in gpu.destroyed and marker not in dev.idle_events


def test_cuda_backend_drop_held_ends_a_gone_clients_held_saves_and_nothing_else(monkeypatch):
    # 1. Two clients' SAVEs held (their data not written yet); client 2 dies.
    gpu = _Driver(monkeypatch)
    backend, _ = _backend(monkeypatch)
    gpu.client_records("event6")
    backend.submit(_op(7, slot=2))
    backend.submit(_op(8, slot=3))
    # 2. Its held SAVE ends with an error at the next poll, though its event never fires; its
    #    gate stream and marker are let go without waiting.  Client 3's stays held.
    backend.drop_held(2)
    assert backend.poll() == [CopyDone(7, "the client left before its data to save was written")]
    assert backend.started == [] and backend.num_inflight() == 1
    assert "stream0" in gpu.destroyed and "marker0" in gpu.destroyed
    # 3. Once client 3's data is written, its SAVE is issued as usual.
    gpu.client_work_done("event6")
    backend.poll()
    assert backend.started == [8] and backend.num_inflight() == 0
