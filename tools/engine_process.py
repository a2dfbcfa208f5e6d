"""Start and stop a private engine process for tools and tests (host backend by default)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pegaflow.client import EngineClient
from pegaflow.errors import PegaflowError

ROOT = Path(__file__).resolve().parent.parent


class EngineProcess:
    def __init__(self, name: str | None = None, *extra_args: str, backend: str = "host",
                 pool_size: str = "256MiB", start_timeout_s: float = 30.0):
        self.name = name or f"tool{os.getpid()}"
        args = [sys.executable, "-m", "engine", "--name", self.name, "--backend", backend,
                "--pool-size", pool_size, "--log-level", "WARNING", *extra_args]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen(args, cwd=ROOT, env=env)
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                EngineClient.connect(self.name, timeout_s=2.0).close()
                return
            except PegaflowError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise
                time.sleep(0.05)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout_s: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
