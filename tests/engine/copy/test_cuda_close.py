"""CudaBackend.close with copies that never end, on a stand-in driver (no GPU needed)."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest

cuda = pytest.importorskip("engine.copy.cuda")


def test_cuda_backend_close_gives_up_on_copies_that_never_end(monkeypatch, caplog):
    # 1. One copy in flight whose completion event never fires (it waits on client GPU
    #    work that never ends); the driver says so on every query.
    backend = object.__new__(cuda.CudaBackend)
    stuck = SimpleNamespace(device=0, done="event", token=1)
    backend._inflight, backend._ready = [stuck], []
    backend._held = cuda.HeldSaves()
    monkeypatch.setattr(cuda.driver, "use_device", lambda device: None)
    monkeypatch.setattr(cuda.driver, "event_done", lambda event: False)
    monkeypatch.setattr(cuda.driver, "synchronize_event",
                        lambda event: pytest.fail("close waited without a bound"))
    # 2. close returns after its wait, says why, and unmaps nothing under the copy.
    caplog.set_level(logging.ERROR, logger="engine.copy.cuda")
    closer = threading.Thread(target=backend.close, kwargs={"wait_s": 0.05}, daemon=True)
    closer.start()
    closer.join(30.0)  # generous: an unbounded wait never ends
    assert not closer.is_alive()
    assert backend._inflight == [stuck]
    assert "1 copies still running on the GPU" in caplog.text


def _backend_with_a_gone_client(monkeypatch, close_ipc_mem):
    """A CudaBackend on a stand-in driver with slot 3's allocation mapped and two events open
    (the real ``ClientMappings``); ``close_ipc_mem`` stands in for the driver's unmap."""
    import numpy as np

    from engine.copy import cuda_clients
    from pegaflow.platform import wire
    backend = object.__new__(cuda.CudaBackend)
    backend._inflight, backend._ready, backend._held = [], [], cuda.HeldSaves()
    backend._gone, backend._releaser, backend._num_waits_let_go = set(), cuda.Releaser(), 0
    backend._clients = cuda_clients.ClientMappings()
    destroyed = []
    for module in (cuda, cuda_clients):
        monkeypatch.setattr(module.driver, "use_device", lambda device: None)
    monkeypatch.setattr(cuda_clients.driver, "open_ipc_event", lambda handle: handle[:1])
    monkeypatch.setattr(cuda_clients.driver, "destroy_event", destroyed.append)
    monkeypatch.setattr(cuda_clients.driver, "open_ipc_mem", lambda handle: 0x7000_0000)
    monkeypatch.setattr(cuda_clients.driver, "close_ipc_mem", close_ipc_mem)
    region = np.zeros(1, wire.REGION)[0]
    region["kind"], region["alloc_bytes"], region["handle"] = wire.RegionKind.CUDA_IPC, 1 << 20, b"a" * 8
    events = np.zeros(2, wire.EVENT_HANDLE)
    events["handle"][0], events["handle"][1] = b"x" * 8, b"y" * 8
    backend._clients.map_region(3, 0, region, device=0)
    backend._clients.set_events(3, events)
    # Whatever close releases past the clients' handles must not be reached here.
    backend._staging = SimpleNamespace(close=lambda: pytest.fail("staging released under a stuck unmap"))
    backend._pinned, backend._devices = None, {}
    return backend, destroyed


def test_cuda_backend_unmap_of_a_gone_clients_memory_that_blocks_holds_up_neither_reclaim_nor_close(
        monkeypatch, caplog):
    # 1. Slot 3's client is gone (killed while the GPU ran its work); unmapping its memory
    #    blocks in the driver (an unmap may wait for GPU work that never ends).
    unblock, entered = threading.Event(), threading.Event()

    def blocking_unmap(address):
        entered.set()
        unblock.wait(60.0)

    backend, destroyed = _backend_with_a_gone_client(monkeypatch, blocking_unmap)
    caplog.set_level(logging.ERROR)
    try:
        # 2. The client table reclaims the slot: told the client is gone, then its handles
        #    let go.  The engine's thread returns at once; the unmap runs off it.
        backend.drop_held(3)
        reclaimer = threading.Thread(target=backend.unregister_client, args=(3,), daemon=True)
        reclaimer.start()
        reclaimer.join(30.0)
        assert not reclaimer.is_alive(), "the engine's thread waited for the stuck unmap"
        assert backend._clients.slots == set() and backend._clients.regions == {}
        assert entered.wait(30.0)
        # 3. close waits for it no longer than its bound, says so, and releases nothing that
        #    could wait for the GPU (the process exit tears it down).
        closer = threading.Thread(target=backend.close, kwargs={"wait_s": 0.05}, daemon=True)
        closer.start()
        closer.join(30.0)
        assert not closer.is_alive(), "close waited for the stuck unmap without a bound"
        assert "did not end within" in caplog.text and "letting go of a gone client's memory" in caplog.text
        assert destroyed == []  # its events come after the unmap, on the same thread
    finally:
        unblock.set()


def test_cuda_backend_unmap_refused_by_the_driver_still_lets_go_of_the_slot(monkeypatch, caplog):
    # The driver refuses the unmap of a live client's memory: the error is logged, the events
    # are still destroyed, the slot is forgotten, and unregister_client does not raise.
    from pegaflow.platform.errors import CudaError

    def refused(address):
        raise CudaError("cuIpcCloseMemHandle: CUDA_ERROR_INVALID_CONTEXT")

    backend, destroyed = _backend_with_a_gone_client(monkeypatch, refused)
    backend.unregister_client(3)
    assert backend._clients.slots == set() and destroyed == [b"x", b"y"]
    assert "CUDA_ERROR_INVALID_CONTEXT" in caplog.text and "slot 3" in caplog.text
