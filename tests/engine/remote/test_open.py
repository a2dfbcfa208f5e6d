"""``--remote mooncake`` without the package: the engine refuses to start, saying what to
install, and leaves nothing behind (the conftest harness checks /dev/shm)."""

from __future__ import annotations

import time

import pytest


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
