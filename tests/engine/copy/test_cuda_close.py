"""CudaBackend.close with copies that never end, on a stand-in driver (no GPU needed)."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest

cuda = pytest.importorskip("engine.copy.cuda")


def test_cuda_backend_close_gives_up_on_copies_that_never_end(monkeypatch, caplog):
    # 1. One copy in flight whose completion event never fires (it waits on client GPU
    #    work that never ends); the driver says so on every query.
    backend = object.__new__(cuda.CudaBackend)
    stuck = SimpleNamespace(device=0, done="event", token=1)
    backend._inflight, backend._ready = [stuck], []
    monkeypatch.setattr(cuda.driver, "use_device", lambda device: None)
    monkeypatch.setattr(cuda.driver, "event_done", lambda event: False)
    monkeypatch.setattr(cuda.driver, "synchronize_event",
                        lambda event: pytest.fail("close waited without a bound"))
    # 2. close returns after its wait, says why, and unmaps nothing under the copy.
    caplog.set_level(logging.ERROR, logger="engine.copy.cuda")
    started = time.monotonic()
    backend.close(wait_s=0.05)
    assert time.monotonic() - started < 1.0
    assert backend._inflight == [stuck]
    assert "1 copies still running on the GPU" in caplog.text


def test_cuda_backend_auto_measurement_does_not_wait_forever_for_copies(monkeypatch, caplog):
    # 1. A new page size is registered while a copy that never ends is in flight: the
    #    measurement is skipped (the copy engine serves those pages for now), the engine
    #    is not stalled, and the next registration of that size tries again.
    backend = object.__new__(cuda.CudaBackend)
    backend._inflight = [SimpleNamespace(device=0, done="event", token=1)]
    backend._pool, backend._usable_bytes = (0, 1 << 30), 1 << 30
    backend.probes = []
    dev = SimpleNamespace(device=0, paths={}, unmeasured=set())
    monkeypatch.setattr(cuda.driver, "use_device", lambda device: None)
    monkeypatch.setattr(cuda.driver, "event_done", lambda event: False)
    monkeypatch.setattr(cuda, "PROBE_DRAIN_S", 0.05)
    monkeypatch.setattr(cuda, "measure_paths", lambda *a: pytest.fail("measured with a copy in flight"))
    caplog.set_level(logging.WARNING, logger="engine.copy.cuda")
    started = time.monotonic()
    backend._choose_path(dev, 65536)
    assert time.monotonic() - started < 1.0
    assert dev.paths == {} and "take the copy engine" in caplog.text
    # 2. While copies are still in flight, later registrations of that size do not wait again.
    monkeypatch.setattr(cuda.driver, "event_done", lambda event: pytest.fail("drained again"))
    backend._choose_path(dev, 65536)
    assert dev.paths == {}
