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
