"""engine/process/stop_watch.py: a stop signal ends the engine process within a bound even
while its loop's thread never returns from a call (a real engine process, its loop stuck)."""

from __future__ import annotations

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


def test_stop_watch_engine_whose_loop_never_returns_exits_after_its_grace_leaving_nothing():
    # 1. An engine process whose loop's thread is stuck in a call from its first pass on.
    name = unique_engine_name("stuck")
    proc = subprocess.Popen([sys.executable, "-c", STUCK_ENGINE, name], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
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
    finally:
        if proc.poll() is None:  # (a stop that failed: what it left removed for the next test)
            proc.kill()
            proc.wait()
            subprocess.run([sys.executable, "-m", "engine", "--clean", name], cwd=REPO_ROOT, timeout=60,
                           capture_output=True)
        proc.stdout.close()
        proc.stderr.close()
