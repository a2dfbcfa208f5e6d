"""pegaflow/client/slots.py: opening an engine's control segment, and an engine caught starting."""

from __future__ import annotations

import os
import threading
import time

import pytest

from pegaflow.client import slots
from pegaflow.client.slots import open_control
from pegaflow.platform import shm
from pegaflow.platform.errors import EngineNotRunningError, EngineStartingError, WireVersionError
from pegaflow.platform.wire import CONTROL_HEADER, FINGERPRINT, MAGIC, WIRE_VERSION


@pytest.fixture
def blank_control():
    """A control segment as an engine has just made it: sized, its header not written yet."""
    name = f"slots{os.getpid()}_{time.monotonic_ns()}"
    segment = shm.create_segment(shm.ipc_name(name, "control"), 4096)
    yield name, segment
    segment.unlink()
    segment.close()


def _write_header(segment, version: int = WIRE_VERSION) -> None:
    header = segment.array(CONTROL_HEADER, 1)
    header["version"], header["fingerprint"], header["engine_pid"] = version, FINGERPRINT, os.getpid()
    header["magic"] = MAGIC  # last, as the engine writes it


def test_open_control_engine_of_the_previous_wire_version_is_refused_naming_both(blank_control):
    # 1. An engine of the version before ours (a client upgraded first, its engine not yet).
    name, segment = blank_control
    _write_header(segment, WIRE_VERSION - 1)
    # 2. Refused at once, saying which version each side speaks and what to do.
    with pytest.raises(WireVersionError) as info:
        open_control(name, None)
    text = str(info.value)
    assert f"engine speaks wire version {WIRE_VERSION - 1} " in text
    assert f"this client speaks {WIRE_VERSION} " in text and "run a matching pegaflow on both sides" in text


def test_open_control_waits_for_a_header_written_meanwhile(blank_control):
    # 1. The header is written 0.2 s after the client starts looking: it is waited for.
    name, segment = blank_control
    writer = threading.Timer(0.2, _write_header, (segment,))
    writer.start()
    try:
        control, header = open_control(name, time.monotonic() + 5.0)
    finally:
        writer.join()
    try:
        assert int(header["magic"]) == MAGIC and int(header["engine_pid"]) == os.getpid()
    finally:
        control.close()


def _no_wait(seconds: float) -> None:
    pytest.fail(f"waited {seconds}s: this should be refused at once")


def test_open_control_without_a_deadline_refuses_a_starting_engine_at_once(blank_control, monkeypatch):
    name, _ = blank_control
    monkeypatch.setattr(slots.time, "sleep", _no_wait)
    with pytest.raises(EngineStartingError):
        open_control(name, None)


def test_open_control_gives_up_on_a_header_never_written_at_its_deadline(blank_control):
    # A starting engine is still "not running" to callers that catch only that.
    name, _ = blank_control
    t0 = time.monotonic()
    with pytest.raises(EngineNotRunningError, match="still starting"):
        open_control(name, time.monotonic() + 0.3)
    assert time.monotonic() - t0 >= 0.3


def test_open_control_of_an_absent_engine_raises_at_once(monkeypatch):
    monkeypatch.setattr(slots.time, "sleep", _no_wait)
    with pytest.raises(EngineNotRunningError) as info:
        open_control(f"absent{os.getpid()}", time.monotonic() + 3600.0)
    assert not isinstance(info.value, EngineStartingError)
