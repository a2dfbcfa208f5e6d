"""An engine subprocess for tools and tests: started, waited for until it serves, stopped.

    with EngineProcess("bench", backend="cuda", pool_size="16GiB") as engine:
        ...

Flags in ``extra_args`` come last, so they win over the ones made here.  The test suite's
fixtures (``tests/conftest.py``) build on this class.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pegaflow.client.connection import EngineClient
from pegaflow.platform.errors import PegaflowError
from tools.lib import processes

ROOT = Path(__file__).resolve().parent.parent
LARGE_POOL_STOP_S = 120.0  # a 64 GiB pool takes over 10 s to give back: wait for it, do not kill it


class EngineStartError(RuntimeError):
    """The engine exited at start, or did not serve within its start timeout."""


class EngineProcess:
    def __init__(self, name: str | None = None, *extra_args: str, backend: str = "host",
                 pool_size: str = "256MiB", start_timeout_s: float = 30.0, log_level: str = "WARNING",
                 stderr_path: Path | None = None, wait: bool = True, prefix: tuple[str, ...] = ()):
        self.name = name or f"tool{os.getpid()}"
        self.stderr_path = stderr_path  # None: the engine's log goes to our stderr
        # prefix: a command that execs the engine (e.g. ``ip netns exec NS``: its pid stays the engine's)
        args = [*prefix, sys.executable, "-m", "engine", "--name", self.name, "--backend", backend,
                "--pool-size", pool_size, "--log-level", log_level, *extra_args]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        stderr = open(stderr_path, "wb") if stderr_path is not None else None
        try:
            self.proc = subprocess.Popen(args, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL if stderr is not None else None,
                                         stderr=stderr)
        finally:
            if stderr is not None:
                stderr.close()
        # a bench stopped by a signal stops it too (tools/lib/processes.py)
        processes.register(self.proc, f"engine {self.name}", lambda: self.stop(timeout_s=LARGE_POOL_STOP_S))
        if wait:
            try:
                self.wait_ready(start_timeout_s)
            except BaseException:
                self.stop()
                raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr_text(self) -> str:
        return self.stderr_path.read_text(errors="replace") if self.stderr_path is not None else ""

    def connect(self, timeout_s: float = 5.0) -> EngineClient:
        return EngineClient.connect(self.name, timeout_s=timeout_s)

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Until a client can attach and PING (the probe's slot is freed at the engine's next
        housekeeping); EngineStartError if the engine exits first or the time runs out."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise EngineStartError(f"engine {self.name} exited with {self.proc.returncode} at start"
                                       + (f":\n{self.stderr_text()}" if self.stderr_path else ""))
            try:
                client = self.connect(timeout_s=min(2.0, max(0.1, deadline - time.monotonic())))
                break
            except PegaflowError:  # not started yet (or still preparing its pool)
                if time.monotonic() >= deadline:
                    raise EngineStartError(f"engine {self.name} not serving after {timeout_s}s"
                                           + (f":\n{self.stderr_text()}" if self.stderr_path else ""))
                time.sleep(0.01)
        try:
            client.ping()
        finally:
            client.close()

    def wait_pool_pinned(self, timeout_s: float = 120.0) -> None:
        """Until the whole pool is pinned and in use (an engine serves once its first chunk
        is; a benchmark that must not meet a part-grown pool waits for the rest)."""
        from pegaflow.stats.engine_stats import read_stats
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise EngineStartError(f"engine {self.name} exited with {self.proc.returncode} "
                                       f"while pinning its pool")
            stats = read_stats(self.name)
            if stats["pool_bytes_ready"] >= stats["pool_bytes_capacity"]:
                return
            if time.monotonic() >= deadline:
                raise EngineStartError(f"engine {self.name}: pool {stats['pool_bytes_ready']} of "
                                       f"{stats['pool_bytes_capacity']} bytes pinned after {timeout_s}s")
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> int:
        """Send ``sig`` (if still running) and reap; killed past ``timeout_s``, and then what it
        left in /dev/shm removed (``engine/cleanup.py``). The exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                from engine.cleanup import clean  # here: only a killed engine needs it
                clean(self.name)
        processes.forget(self.proc)
        return self.proc.returncode

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
