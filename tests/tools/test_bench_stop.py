"""A bench stopped by SIGTERM mid-phase (as ``timeout`` stops it) leaves nothing of its own
behind: no engine, no ``vllm serve``, no process those started, no /dev/shm segment.

Run as a user runs it (``python -m tools.bench_serving --configs pegaflow``), on the CPU: the
engine with the host backend (``--engine-arg`` flags come last and win), and ``vllm serve`` a
stand-in package first on PYTHONPATH that starts a process of its own (as vLLM's engine core
is) and answers /health and /metrics but never finishes a completion."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests.conftest import _remove_leftover, shm_leftovers
from tools.lib.peers import free_port

ROOT = Path(__file__).resolve().parents[2]
FAKE_SERVE = textwrap.dedent('''
    import http.server, os, subprocess, sys, time
    port = int(sys.argv[sys.argv.index("--port") + 1])
    core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # its engine core
    with open(os.environ["FAKE_VLLM_PIDS"], "a") as f:
        f.write(f"{os.getpid()} {core.pid}\\n")

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            body = b"" if self.path == "/health" else b"# TYPE vllm:prompt_tokens counter\\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            open(os.environ["FAKE_VLLM_PIDS"] + ".asked", "w").close()
            time.sleep(600)  # a completion that is still running when the bench is stopped

    http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
''')


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _engine_pids(name: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"engine" in argv and name.encode() in argv:
            found.append(int(pid))
    return found


def _wait_for(predicate, timeout_s: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not seen in {timeout_s} s; the bench's stderr:\n{log.read_text()}"
        time.sleep(0.2)


def test_bench_serving_sigterm_mid_phase_leaves_no_process_and_no_segment(tmp_path):
    # 1. The stand-in vllm package, and the bench started on it with a host-backend engine.
    serve = tmp_path / "fake" / "vllm" / "entrypoints" / "cli"
    serve.mkdir(parents=True)
    for package in (serve.parents[2], serve.parents[1], serve.parent, serve):
        (package / "__init__.py").write_text("")
    (serve / "main.py").write_text(FAKE_SERVE)
    pids_file, stderr_path = tmp_path / "vllm.pids", tmp_path / "bench.err"
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "fake"), FAKE_VLLM_PIDS=str(pids_file))
    argv = [sys.executable, "-m", "tools.bench_serving", "--configs", "pegaflow", "--host-gib", "1",
            "--engine-arg=--backend=host", "--engine-arg=--pool-size=64MiB", "--engine-arg=--slab-size=1MiB",
            "--port", str(free_port()), "--log-dir", str(tmp_path / "logs")]
    with open(stderr_path, "w") as stderr:
        bench = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
    engine_name = f"bench{bench.pid}"
    try:
        # 2. Mid-phase: the multi-round phase has begun and its first request is being served.
        _wait_for(lambda: Path(str(pids_file) + ".asked").exists(), 120, "a completion request", stderr_path)
        assert "multi_round started" in stderr_path.read_text()
        vllm_pids = [int(pid) for pid in pids_file.read_text().split()]  # vllm serve, its engine core
        assert len(vllm_pids) == 2 and _engine_pids(engine_name) and shm_leftovers(engine_name)
        # 3. SIGTERM, as `timeout` sends it: the bench exits with 128 + 15, saying so.
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(120) == 128 + signal.SIGTERM
        err = stderr_path.read_text()
        assert "SIGTERM: stopping" in err and "phase pegaflow0-0 multi_round failed after" in err
        # 4. Nothing of it is left: vllm serve, the process it started, the engine, its segments.
        _wait_for(lambda: not any(map(_alive, [*vllm_pids, *_engine_pids(engine_name)])), 30,
                  "every process of the bench gone", stderr_path)
        assert shm_leftovers(engine_name) == []
    finally:  # what a failing bench left, removed so that the host stays clean for the next test
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        _remove_all(engine_name, [int(pid) for pid in pids_file.read_text().split()] if pids_file.exists() else [])


def _remove_all(engine_name: str, pids: list[int]) -> None:
    for pid in pids + _engine_pids(engine_name):
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while any(map(_alive, _engine_pids(engine_name))) and time.monotonic() < deadline:
        time.sleep(0.1)
    for entry in shm_leftovers(engine_name):
        _remove_leftover(entry)
