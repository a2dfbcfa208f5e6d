"""tools/lib/phases.py: a bench's phase in a process of its own, and the engine its phases
attach to (a real child process; the engine faked)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import tools.engine_process
from tools.lib import processes
from tools.lib.phases import ENGINE_START_TIMEOUT_S, ROOT, engine_unless_named, spawn_phase

PHASE = textwrap.dedent("""
    import argparse, os, sys
    from tools.lib.phases import add_phase_args, write_phase
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int)
    add_phase_args(p, ["pegaflow", "broken"])
    args = p.parse_args()
    print("vLLM's chatter")
    if args.phase == "broken":
        sys.exit(3)
    write_phase(args, {"phase": args.phase, "seed": args.seed, "out": args.phase_out, "cwd": os.getcwd(),
                       "mark": os.environ.get("PHASE_MARK")})
""")


@pytest.fixture
def phase_dir(tmp_path, monkeypatch):
    """A phase module outside the repository (it runs there), importing the repository's tools."""
    (tmp_path / "fake_phase.py").write_text(PHASE)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    return tmp_path


def test_spawn_phase_returns_what_the_phase_wrote_and_removes_its_file(phase_dir, capfd):
    # 1. The phase gets its name, the flags and a file to write; it runs where it is told,
    #    with the environment it is given.
    result = spawn_phase("fake_phase", "pegaflow", ["--seed", "7"], timeout_s=60, env=dict(os.environ, PHASE_MARK="m1"),
                         cwd=phase_dir)
    assert {k: result[k] for k in ("phase", "seed", "mark")} == {"phase": "pegaflow", "seed": 7, "mark": "m1"}
    assert Path(result["cwd"]) == phase_dir
    # 2. Its file is gone, and its stdout went to our stderr (our stdout carries only our JSON).
    assert not Path(result["out"]).exists()
    # 3. A phase name it does not declare is refused by the phase's own parser.
    with pytest.raises(subprocess.CalledProcessError):
        spawn_phase("fake_phase", "idle", [], timeout_s=60, cwd=phase_dir)
    captured = capfd.readouterr()
    assert "vLLM's chatter" in captured.err and "vLLM's chatter" not in captured.out


def test_spawn_phase_that_fails_raises_and_leaves_no_file(phase_dir, monkeypatch):
    made = []
    real_start = processes.start

    def start(cmd, **kwargs):
        made.append(cmd[cmd.index("--phase-out") + 1])
        return real_start(cmd, **kwargs)
    monkeypatch.setattr(processes, "start", start)
    with pytest.raises(subprocess.CalledProcessError) as failed:
        spawn_phase("fake_phase", "broken", [], timeout_s=60, cwd=phase_dir)
    assert failed.value.returncode == 3 and failed.value.cmd[:3] == [sys.executable, "-m", "fake_phase"]
    assert len(made) == 1 and not Path(made[0]).exists()


class _FakeEngine:
    made: list[_FakeEngine] = []

    def __init__(self, name, **kwargs):
        self.name, self.kwargs, self.stopped = name, kwargs, False
        _FakeEngine.made.append(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stopped = True


def test_engine_unless_named_starts_one_only_when_none_is_named(monkeypatch):
    _FakeEngine.made = []
    monkeypatch.setattr(tools.engine_process, "EngineProcess", _FakeEngine)
    # 1. An engine named: that one, nothing started.
    with engine_unless_named("given", "decode", "8GiB") as name:
        assert name == "given"
    assert _FakeEngine.made == []
    # 2. None named: a fresh CUDA engine for the block, stopped after it (an error too).
    with pytest.raises(KeyError), engine_unless_named("", "decode", "8GiB") as name:
        (engine,) = _FakeEngine.made
        assert name == engine.name == f"decode{os.getpid()}" and not engine.stopped
        assert engine.kwargs == {"backend": "cuda", "pool_size": "8GiB", "start_timeout_s": ENGINE_START_TIMEOUT_S}
        raise KeyError("a phase failed")
    assert engine.stopped
