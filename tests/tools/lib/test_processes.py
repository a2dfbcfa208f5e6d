"""tools/lib/processes.py with real processes: a child's whole group stopped, the segments a
stopped process left removed (and no other), a bench's signal stopping every child, the
phase lines."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tools.lib import processes

ROOT = Path(__file__).resolve().parents[3]
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids: list[int], timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(map(_alive, pids)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_processes_stop_ends_the_childs_whole_group_and_runs_its_leftovers(tmp_path):
    # 1. A child that starts a process of its own and ignores the stop signal.
    script = ("import signal, subprocess, sys, time\n"
              "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              f"core = subprocess.Popen({SLEEPER!r})\n"
              f"open({str(tmp_path / 'core')!r}, 'w').write(str(core.pid))\n"
              "time.sleep(600)\n")
    cleared = []
    proc = processes.start([sys.executable, "-c", script], label="stand-in", stop_timeout_s=1.0,
                           leftovers=lambda: cleared.append(True))
    deadline = time.monotonic() + 30
    while not (tmp_path / "core").exists() or not (tmp_path / "core").read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    core = int((tmp_path / "core").read_text())
    assert "stand-in" in processes.running()
    # 2. Stopped: killed past its timeout, the process it started with it, leftovers run once.
    assert processes.stop(proc) == -signal.SIGKILL
    assert _wait_gone([proc.pid, core]) and cleared == [True]
    assert "stand-in" not in processes.running()


def _holder(path: Path, ready: Path) -> list[str]:
    """A process that makes ``path`` and keeps it open (as a server keeps its segment)."""
    return [sys.executable, "-c", f"f = open({str(path)!r}, 'w'); open({str(ready)!r}, 'w').close(); "
                                  "import time; time.sleep(600)"]


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + 30
    while not path.exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_processes_new_segments_since_removes_what_the_stopped_group_held_and_nothing_else(tmp_path, caplog):
    shm = processes.SHM_DIR
    tag = f"pegaflow-test-{os.getpid()}"
    before_path = shm / f"{tag}-before"
    before_path.write_bytes(b"x")
    try:
        # 1. A child (a server) makes a segment and holds it; meanwhile another process of this
        #    host makes one it does not hold (a crashed engine's leftovers, another bench's).
        sweep = processes.new_segments_since(processes.shm_snapshot())
        its, others = shm / f"{tag}-its", shm / f"{tag}-others"
        child = processes.start(_holder(its, tmp_path / "ready"), label="server", leftovers=sweep)
        _wait_for(tmp_path / "ready")
        others.write_bytes(b"x")
        # 2. Stopped: the segment its group held goes; the other one and the one from before stay.
        processes.stop(child)
        assert not its.exists() and others.exists() and before_path.exists()
        # 3. A child that exited by itself before its stop: what is new is logged, not removed.
        sweep = processes.new_segments_since(processes.shm_snapshot())
        gone = subprocess.Popen([sys.executable, "-c", f"open({str(its)!r}, 'w').close()"])
        gone.wait()
        processes.register(gone, "exited", lambda: sweep())
        processes.stop(gone)
        assert its.exists() and any(f"{tag}-its" in r.getMessage() for r in caplog.records)
    finally:
        for path in shm.glob(f"{tag}-*"):
            path.unlink()



CUDA_USER = textwrap.dedent("""
    import os, subprocess, sys, time
    shm = sys.argv[1]
    open(os.path.join(shm, "cuda.shm.0.%x.1" % os.getpid()), "w").close()  # as the CUDA driver names it
    if sys.argv[2] == "server":
        core = subprocess.Popen([sys.executable, __file__, shm, "core"])
        open(os.path.join(shm, "other.%x" % os.getpid()), "w").close()
        open(os.path.join(shm, "core"), "w").write(str(core.pid))
    time.sleep(600)
""")


def test_processes_stop_removes_the_cuda_driver_files_of_the_groups_processes_and_no_others(tmp_path, monkeypatch):
    # 1. A child (a vLLM) and the process it started (its engine core) each make a file named
    #    as the CUDA driver names its per-process files; so does a live process that is not
    #    theirs (this one); the child also makes a file of another pattern.
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(processes, "SHM_DIR", shm)
    (tmp_path / "cuda_user.py").write_text(CUDA_USER)
    proc = processes.start([sys.executable, str(tmp_path / "cuda_user.py"), str(shm), "server"], label="vllm",
                           stop_timeout_s=1.0)
    deadline = time.monotonic() + 30
    while not (shm / "core").exists() or not (shm / "core").read_text() or len(list(shm.glob("cuda.shm.*"))) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    core = int((shm / "core").read_text())
    mine = shm / f"cuda.shm.0.{os.getpid():x}.1"
    mine.write_bytes(b"")
    # 2. Stopped: the files of its group's processes go once they are gone; this live
    #    process's stays, and so does the file of another pattern.
    processes.stop(proc)
    assert _wait_gone([proc.pid, core])
    assert sorted(p.name for p in shm.iterdir()) == sorted(["core", mine.name, f"other.{proc.pid:x}"])


def test_processes_remove_cuda_shm_of_keeps_the_files_of_a_pid_still_alive(tmp_path, monkeypatch):
    # A pid of the fleet that is alive (not gone within the wait, or another process's by now).
    monkeypatch.setattr(processes, "SHM_DIR", tmp_path)
    alive = tmp_path / f"cuda.shm.0.{os.getpid():x}.1"
    alive.write_bytes(b"")
    assert processes.remove_cuda_shm_of({os.getpid()}, wait_s=0.0) == [] and alive.exists()


BENCH = textwrap.dedent("""
    import subprocess, sys, time
    from tools.lib import processes
    processes.handle_signals()
    child = processes.start({sleeper!r}, label="server")
    with processes.phase("stand-in", "workload"):
        print(child.pid, flush=True)
        time.sleep(600)
""")


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGHUP, 128 + signal.SIGHUP),
                                         (signal.SIGINT, -signal.SIGINT)])
def test_processes_handle_signals_stops_every_child_and_says_where_it_was(sig, status):
    # 1. A bench with one registered child, mid-phase.
    bench = subprocess.Popen([sys.executable, "-c", BENCH.format(sleeper=SLEEPER)], cwd=ROOT,
                             env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    child = int(bench.stdout.readline())
    try:
        # 2. The signal: the child is stopped, the bench exits (SIGINT: as Python exits on its
        #    KeyboardInterrupt, by SIGINT).
        bench.send_signal(sig)
        assert bench.wait(60) == status
        assert _wait_gone([child])
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)
        bench.kill()
        bench.wait()
    err = bench.stderr.read()
    # 3. What it stopped and which phase it was in, each on a time-stamped line.
    assert f"{signal.Signals(sig).name}: stopping server" in err
    assert "stand-in: phase workload started" in err and "stand-in: phase workload failed after" in err


def test_processes_phase_logs_its_start_and_its_end(capsys):
    with processes.phase("bench_x", "cold"):
        pass
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[0].endswith("bench_x: phase cold started")
    assert " bench_x: phase cold ended after " in lines[1] and lines[1][:4].isdigit()
    with pytest.raises(KeyError), processes.phase("bench_x", "warm"):
        raise KeyError("gone")
    assert "bench_x: phase warm failed after" in capsys.readouterr().err


def test_processes_a_child_stops_when_the_bench_is_killed_outright():
    # SIGKILL leaves the bench no say: its child's parent-death signal stops it.
    bench = subprocess.Popen([sys.executable, "-c", BENCH.format(sleeper=SLEEPER)], cwd=ROOT,
                             env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE, text=True)
    child = int(bench.stdout.readline())
    try:
        bench.kill()
        bench.wait()
        assert _wait_gone([child])
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)
