"""CPU workers' KV caches moved into shared memory (``pegaflow/client/in_place.py``), for the
tests of what finds them, removes them and shows them: one of a worker killed before it could
unlink it, and this process's own, as a worker still running."""

from __future__ import annotations

import contextlib
import mmap
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from pegaflow.client.in_place import share_in_place
from tests.conftest import unique_engine_name

ROOT = Path(__file__).resolve().parents[1]
CACHE_BYTES = 1 << 20


def killed_worker_cache(engine_name: str) -> str:
    """A CPU worker of engine ``engine_name`` moves a 1 MiB KV cache in place and is killed
    (SIGKILL) before it can unlink it: the segment's name."""
    code = ("import mmap, os, signal, numpy as np; from pegaflow.client.in_place import share_in_place; "
            "m = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE); a = np.frombuffer(m, np.uint8); a[:] = 7; "
            "b = share_in_place(a.__array_interface__['data'][0], a.nbytes, os.environ['ENGINE']); "
            "print(b.name, flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, ENGINE=engine_name))
    assert done.returncode == -signal.SIGKILL, done.stderr
    return done.stdout.strip()


@contextlib.contextmanager
def running_worker_cache():
    """This process as a running CPU worker of a new engine name: (the name, its moved KV
    cache), unlinked at the end."""
    name = unique_engine_name("inplace")
    mapped = mmap.mmap(-1, CACHE_BYTES, flags=mmap.MAP_PRIVATE)
    view = np.frombuffer(mapped, np.uint8)
    view[:] = 3
    buffer = share_in_place(view.__array_interface__["data"][0], view.nbytes, name)
    try:
        yield name, buffer
    finally:
        buffer.close()
