"""engine.copy.probe: the path a page size takes under ``--copy-backend auto`` (no GPU:
the driver calls faked)."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest

from engine.copy import probe


def _choose(dev, inflight):
    probe.choose_path(dev, 65536, 1 << 30, inflight, copy=None, stage=None, unstage=None, probes=[])



def _returns(call) -> None:
    """``call()`` returns, waited for generously (a wait without a bound never does)."""
    raised = []

    def run():
        try:
            call()
        except BaseException as exc:  # (pytest.fail's too) re-raised in the test's thread
            raised.append(exc)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30.0)
    assert not thread.is_alive(), "it never returned"
    if raised:
        raise raised[0]

def test_probe_auto_measurement_does_not_wait_forever_for_copies(monkeypatch, caplog):
    # 1. A new page size is registered while a copy that never ends is in flight: the
    #    measurement is skipped (the copy engine serves those pages for now), the engine
    #    is not stalled, and the next registration of that size tries again.
    inflight = [SimpleNamespace(device=0, done="event", token=1)]
    dev = SimpleNamespace(device=0, paths={}, unmeasured=set())
    monkeypatch.setattr(probe.driver, "use_device", lambda device: None)
    monkeypatch.setattr(probe.driver, "event_done", lambda event: False)
    monkeypatch.setattr(probe, "PROBE_DRAIN_S", 0.05)
    monkeypatch.setattr(probe, "measure_paths", lambda *a: pytest.fail("measured with a copy in flight"))
    caplog.set_level(logging.WARNING, logger="engine.copy.probe")
    _returns(lambda: _choose(dev, inflight))
    assert dev.paths == {} and "take the copy engine" in caplog.text
    # 2. While copies are still in flight, later registrations of that size do not wait again.
    monkeypatch.setattr(probe.driver, "event_done", lambda event: pytest.fail("drained again"))
    _choose(dev, inflight)
    assert dev.paths == {}


def test_probe_measures_once_nothing_is_in_flight_and_records_the_choice(monkeypatch):
    # A page size registered with no copy in flight: measured, and the faster path by the
    # margins chosen each way (the kernel for loads, the copy engine for saves here).
    dev = SimpleNamespace(device=0, paths={}, unmeasured={65536})
    rates = {probe.Direction.LOAD: (50.0, 40.0), probe.Direction.SAVE: (50.0, 30.0)}
    monkeypatch.setattr(probe, "measure_paths", lambda *a: rates)
    probes = []
    probe.choose_path(dev, 65536, 1 << 30, [], None, None, None, probes)
    assert dev.paths == {(65536, probe.Direction.LOAD): "kernel", (65536, probe.Direction.SAVE): "copy-engine"}
    assert not dev.unmeasured and [p["path"] for p in probes] == ["kernel", "copy-engine"]
