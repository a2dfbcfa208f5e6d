"""engine/name_lock.py: the name held by an engine refuses another at once; held by a --clean, a
start waits for it and then takes the name."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from engine import name_lock
from pegaflow.platform.errors import EngineAlreadyRunningError
from tests.conftest import unique_engine_name


def test_name_lock_held_by_an_engine_refuses_a_claim_at_once_naming_its_pid():
    name = unique_engine_name("lock")
    held = name_lock.claim_name(name)
    try:
        # wait_s is long: the refusal must not come from the wait running out
        with pytest.raises(EngineAlreadyRunningError, match=f"already running \\(pid {os.getpid()}\\)"):
            name_lock.claim_name(name, wait_s=300)
        with pytest.raises(EngineAlreadyRunningError, match=f"is running \\(pid {os.getpid()}\\): --clean"):
            name_lock.claim_name(name, cleaning=True, wait_s=300)
    finally:
        name_lock.release_name(name, held)


def test_name_lock_held_by_a_clean_makes_a_start_wait_then_take_it():
    # 1. A --clean holds the name (another open of the file: flock's holder is per open).
    name = unique_engine_name("lock")
    cleaning = name_lock.claim_name(name, cleaning=True)
    with open(name_lock.name_lock_path(name)) as f:
        assert f.read() == f"{name_lock.CLEANING} {os.getpid()}\n"
    # 2. An engine's claim meanwhile waits instead of refusing...
    claimed: list = []
    starting = threading.Thread(target=lambda: claimed.append(_claim_or_error(name)))
    starting.start()
    starting.join(0.5)
    assert claimed == []
    # 3. ...and takes the name once the --clean lets go.
    name_lock.release_name(name, cleaning)
    starting.join(30)
    assert len(claimed) == 1 and isinstance(claimed[0], int), claimed
    with open(name_lock.name_lock_path(name)) as f:
        assert f.read() == f"{os.getpid()}\n"
    name_lock.release_name(name, claimed[0])


def test_name_lock_clean_that_never_lets_go_is_refused_at_the_wait_s():
    name = unique_engine_name("lock")
    cleaning = name_lock.claim_name(name, cleaning=True)
    try:
        with pytest.raises(EngineAlreadyRunningError, match="--clean .* that does not finish"):
            name_lock.claim_name(name, wait_s=0.05)
    finally:
        name_lock.release_name(name, cleaning)


def _claim_or_error(name: str):
    try:
        return name_lock.claim_name(name)
    except EngineAlreadyRunningError as exc:
        return exc


def test_name_lock_start_waiting_for_a_clean_stops_on_sigterm(engine_factory):
    # 1. A --clean holds the name; an engine of that name starts and waits for it.
    name = unique_engine_name("lock")
    cleaning = name_lock.claim_name(name, cleaning=True)
    try:
        engine = engine_factory(name, wait=False)
        deadline = time.monotonic() + 60
        while "held by `pegaflow-engine --clean`" not in engine.stderr_text():
            assert engine.proc.poll() is None and time.monotonic() < deadline, engine.stderr_text()
            time.sleep(0.05)
        # 2. SIGTERM meanwhile: it stops at once, exit 0, having made nothing.
        assert engine.stop(signal.SIGTERM) == 0
        assert "stopped before serving" in engine.stderr_text()
    finally:
        name_lock.release_name(name, cleaning)
