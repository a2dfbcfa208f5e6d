"""The engine's PEGAFLOW_* variables cleared for a test, so that none of the host's leaks in
(the tests of engine/config.py and engine/process/options.py)."""

from __future__ import annotations

from engine.process.options import OPTIONS


def clear_option_env(monkeypatch):
    """``monkeypatch`` with every option's env var removed; the test sets its own."""
    for option in OPTIONS:
        monkeypatch.delenv(option.env, raising=False)
    return monkeypatch
