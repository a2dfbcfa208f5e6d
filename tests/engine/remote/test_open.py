"""``--remote mooncake`` at start: without the package, with no master listening, with one
that never answers, and stopped by SIGTERM meanwhile; each time the engine says why in one
line of its own, keeps the store's client's log out of its own, and leaves nothing behind
(the conftest harness checks /dev/shm)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def test_open_remote_without_the_package_the_engine_refuses_to_start(engine_factory, monkeypatch, tmp_path):
    # 1. A ``mooncake`` package that cannot be imported shadows any installed one.
    (tmp_path / "mooncake").mkdir()
    (tmp_path / "mooncake" / "__init__.py").write_text("raise ImportError('no mooncake on this host')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    # 2. The engine exits at start with the typed error's message, naming the package.
    engine = engine_factory(wait=False, extra=("--remote", "mooncake"))
    engine.is_clean_exit_expected = False
    deadline = time.monotonic() + 30
    while engine.proc.poll() is None:
        if time.monotonic() > deadline:
            pytest.fail("the engine started without its remote tier's package")
        time.sleep(0.02)
    assert engine.proc.returncode != 0
    assert "mooncake-transfer-engine" in engine.stderr_text()


# The store's own log lines (glog: "E1206 05:20:51.783260 21081 master_client.cpp:361] ...").
_CLIENT_LOG_LINE = re.compile(r"^[IWEF]\d{4} [\d:.]+\s+\d+ [\w.]+:\d+\] ", re.MULTILINE)


def _require_mooncake() -> None:
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"mooncake-transfer-engine is not installed ({exc}): pip install -e '.[remote]' (make test)")


@pytest.fixture
def silent_port():
    """A port that accepts connections and never answers: a master that does not respond."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield listener.getsockname()[1]


def _exit_code(engine, timeout_s: float = 120.0) -> int:
    try:
        return engine.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the engine was still starting after {timeout_s:g} s:\n{engine.stderr_text()}")


def test_open_remote_with_no_master_listening_is_refused_without_the_clients_log(engine_factory):
    _require_mooncake()
    # 1. A master address where nothing listens (a port just freed).
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    engine = engine_factory(wait=False, extra=("--remote", "mooncake", "--remote-master", f"127.0.0.1:{port}"))
    engine.is_clean_exit_expected = False
    # 2. The engine refuses to start, saying what it could not reach; the store's client
    #    never ran, so none of its retry lines is in the engine's log.
    assert _exit_code(engine) == 1
    text = engine.stderr_text()
    assert f"--remote-master 127.0.0.1:{port}: cannot connect" in text, text
    assert not _CLIENT_LOG_LINE.search(text), text


def test_open_remote_setup_past_its_timeout_is_an_error_naming_the_flag(engine_factory, silent_port):
    _require_mooncake()
    # 1. A master that accepts and never answers: the store's setup would retry for minutes.
    engine = engine_factory(wait=False, extra=("--remote", "mooncake", "--remote-master",
                                               f"127.0.0.1:{silent_port}", "--remote-start-timeout", "1"))
    engine.is_clean_exit_expected = False
    # 2. It gives up at its --remote-start-timeout with one error naming the flag, and the
    #    client's own retry lines stay out of the engine's log.
    assert _exit_code(engine) == 1
    text = engine.stderr_text()
    assert "the store's setup did not finish within 1 s (--remote-start-timeout)" in text, text
    assert not _CLIENT_LOG_LINE.search(text), text


def test_open_remote_sigterm_while_the_store_is_set_up_stops_the_engine_cleanly(engine_factory, silent_port):
    _require_mooncake()
    # 1. An engine waiting for a master that never answers (up to 10 minutes).
    engine = engine_factory(wait=False, extra=("--remote", "mooncake", "--remote-master",
                                               f"127.0.0.1:{silent_port}", "--remote-start-timeout", "600"))
    deadline = time.monotonic() + 60
    while "trying its master" not in engine.stderr_text():
        if engine.proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the engine never tried the store:\n{engine.stderr_text()}")
        time.sleep(0.05)
    # 2. SIGTERM stops it: exit 0, saying so; the harness checks nothing is left in /dev/shm.
    engine.proc.send_signal(signal.SIGTERM)
    assert _exit_code(engine) == 0, engine.stderr_text()
    assert "stopped before serving" in engine.stderr_text()


def test_open_remote_trial_dies_with_an_engine_killed_meanwhile(engine_factory, silent_port):
    _require_mooncake()
    # 1. An engine trying a master that never answers, its trial setup in a child process.
    engine = engine_factory(wait=False, extra=("--remote", "mooncake", "--remote-master",
                                               f"127.0.0.1:{silent_port}", "--remote-start-timeout", "600"))
    deadline = time.monotonic() + 60
    while not (children := _children(engine.proc.pid)):
        if engine.proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the engine never started its trial:\n{engine.stderr_text()}")
        time.sleep(0.05)
    # 2. SIGKILL: the child goes with it (no orphan retrying for minutes)...
    engine.is_clean_exit_expected = False
    engine.stop(signal.SIGKILL)
    deadline = time.monotonic() + 60
    while any(os.path.exists(f"/proc/{pid}") and _state(pid) != "Z" for pid in children):
        if time.monotonic() > deadline:
            pytest.fail(f"the trial {children} outlived its engine")
        time.sleep(0.05)
    # 3. ...and --clean gives back what the killed engine left in /dev/shm.
    cleaned = subprocess.run([sys.executable, "-m", "engine", "--clean", engine.name], capture_output=True,
                             text=True, timeout=120, cwd=ROOT)
    assert cleaned.returncode == 0 and "removed what the engine named" in cleaned.stdout, cleaned.stderr


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "Z"
