"""engine/process/stop_watch.py: a stop signal ends the engine process within a bound even
while its loop's thread never returns from a call (a real engine process, its loop stuck)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

from engine.process.name_lock import name_lock_path
from engine.process.stop_watch import STOP_GRACE_S
from pegaflow.platform.cli import EXIT_FAILED
from pegaflow.platform.locks import lock_path
from tests.conftest import REPO_ROOT, shm_leftovers, unique_engine_name

STUCK_ENGINE = textwrap.dedent("""
    import sys, threading
    from engine.__main__ import main
    from engine.process.server import EngineServer

    def stuck(self, now):
        print("serving", flush=True)
        threading.Event().wait()  # as a driver call that never returns: no signal ends it

    EngineServer.run_once = stuck
    sys.exit(main(["--name", sys.argv[1], "--backend", "host", "--pool-size", "4MiB",
                   "--slab-size", "1MiB", "--max-clients", "2"]))
""")


@contextlib.contextmanager
def _engine_process(script: str, name: str):
    """The engine process ``script`` starts under ``name``; killed and its names cleaned if a
    test leaves it running."""
    proc = subprocess.Popen([sys.executable, "-c", script, name], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:  # (a stop that failed: what it left removed for the next test)
            proc.kill()
            proc.wait()
            subprocess.run([sys.executable, "-m", "engine", "--clean", name], cwd=REPO_ROOT, timeout=60,
                           capture_output=True)
        proc.stdout.close()
        proc.stderr.close()


def test_stop_watch_engine_whose_loop_never_returns_exits_after_its_grace_leaving_nothing():
    # 1. An engine process whose loop's thread is stuck in a call from its first pass on.
    name = unique_engine_name("stuck")
    with _engine_process(STUCK_ENGINE, name) as proc:
        assert proc.stdout.readline().strip() == "serving"
        assert shm_leftovers(name) and os.path.exists(name_lock_path(name))
        # 2. SIGTERM: the loop never sees it; the stop watch does.  After its grace the
        #    process exits 1, every thread's stack and why on stderr, its names removed.
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(STOP_GRACE_S + 60.0) == EXIT_FAILED
        assert time.monotonic() - sent >= STOP_GRACE_S
        err = proc.stderr.read()
        assert "did not stop within" in err and "in stuck" in err
        assert shm_leftovers(name) == [] and not os.path.exists(name_lock_path(name))
        assert not os.path.exists(lock_path(name, "claims"))


THREAD_FIRST_ENGINE = textwrap.dedent("""
    import sys, threading
    threading.Thread(target=threading.Event().wait, daemon=True).start()  # before the mask
    from engine.__main__ import main
    print("starting", flush=True)
    sys.exit(main(["--name", sys.argv[1], "--backend", "host", "--pool-size", "4MiB",
                   "--slab-size", "1MiB", "--max-clients", "2"]))
""")


def _wait_serving(name: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Until a client of ``name`` is answered a PING."""
    from pegaflow.client.connection import EngineClient
    from pegaflow.platform.errors import PegaflowError
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.stderr.read()
        try:
            client = EngineClient.connect(name, timeout_s=2.0)
            break
        except PegaflowError:
            assert time.monotonic() < deadline, f"engine {name} not serving after {timeout_s}s"
            time.sleep(0.05)
    try:
        assert client.ping() == 0
    finally:
        client.close()


def test_stop_watch_signal_taken_by_a_thread_older_than_the_mask_still_stops_the_engine_cleanly():
    # 1. An engine whose process had a thread before engine.__main__ blocked the stop
    #    signals: that thread is the only one SIGTERM can be delivered to.
    name = unique_engine_name("older")
    with _engine_process(THREAD_FIRST_ENGINE, name) as proc:
        assert proc.stdout.readline().strip() == "starting"
        _wait_serving(name, proc)  # (its loop runs: the handlers are in)
        # 2. SIGTERM: a graceful stop (exit 0, everything removed), not the default action's kill.
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60.0) == 0
        assert shm_leftovers(name) == [] and not os.path.exists(name_lock_path(name))
