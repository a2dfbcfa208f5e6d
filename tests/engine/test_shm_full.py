"""A /dev/shm that fills up while the engine runs (a private tmpfs in a mount namespace):
the pool's pinned part is allocated, so saves go on instead of SIGBUS; one that fills up
while the rest of the pool is being pinned leaves the engine serving with what it pinned."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import os, subprocess, sys, time
NAME = "shmfull" + str(os.getppid())  # the test process: its pkill finds this engine alone
import numpy as np
from tools.engine_process import EngineProcess
from pegaflow.client.host_memory import HostKVBuffer, layer_records
from pegaflow.client.connection import EngineClient
from pegaflow.platform.wire import encode_hashes
PAGE, BLOCKS = 64 << 10, 256          # one layer of 256 64-KiB pages: 16 MiB of KV
with EngineProcess(NAME, "--max-clients", "2", pool_size="32MiB", start_timeout_s=30) as engine:
    kv = HostKVBuffer(PAGE * BLOCKS, "fullkv")
    kv.data[:] = 7
    client = EngineClient.connect(NAME)
    client.register_region(0, kv.region_record(BLOCKS, PAGE, 1), layer_records([0], [0], [PAGE]))
    # Fill what is left of /dev/shm: a sparse pool would have nowhere to put its pages now.
    free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    with open("/dev/shm/filler", "wb") as f:
        f.write(b"\0" * free)
    hashes = [i.to_bytes(4, "little") * 8 for i in range(BLOCKS)]
    done = client.wait(client.submit_save(1, np.arange(BLOCKS), encode_hashes(hashes)), 10)
    print("save", done.status, done.value, flush=True)
    print("ping", client.ping(), flush=True)
    client.close()
    kv.close()
    print("engine exit", engine.stop(), flush=True)
"""


def _can_unshare() -> bool:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1M tmpfs /dev/shm"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.mark.skipif(not _can_unshare(), reason="needs root and unshare -m to mount a private tmpfs")
def test_shm_full_mid_run_does_not_kill_the_engine():
    # 1. In a mount namespace of its own, /dev/shm is a 96 MiB tmpfs: the 32 MiB pool and
    #    the client's 16 MiB of KV fit; then a file takes every byte left.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    try:
        done = subprocess.run(["unshare", "-m", "sh", "-c",
                               f"mount -t tmpfs -o size=96M tmpfs /dev/shm && exec {sys.executable} -c '{SCRIPT}'"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    finally:  # an engine left behind by a run that failed lives in the namespace's tmpfs only
        subprocess.run(["pkill", "-f", f"engine --name shmfull{os.getpid()}"], capture_output=True)
    # 2. Saving 16 MiB into the pool still works (its pages were allocated at start), the
    #    engine answers and stops cleanly.
    assert "save 0 256" in done.stdout and "ping 0" in done.stdout, done.stdout + done.stderr
    assert "engine exit 0" in done.stdout, done.stdout + done.stderr


MID_PIN_SCRIPT = r"""
import os, sys, time
NAME = "shmpin" + str(os.getppid())
import numpy as np
from tools.engine_process import EngineProcess
from pegaflow.client.host_memory import HostKVBuffer, layer_records
from pegaflow.client.connection import EngineClient
from pegaflow.stats.engine_stats import read_stats
from pegaflow.platform.wire import encode_hashes
PAGE, BLOCKS = 64 << 10, 64           # one layer of 64 64-KiB pages: 4 MiB of KV
args = ("--max-clients", "2", "--slab-size", "1MiB", "--pin-chunk", "4MiB", "--pin-rate", "8MiB")
with EngineProcess(NAME, *args, pool_size="48MiB", start_timeout_s=30, log_level="INFO",
                   stderr_path=sys.argv[1]) as engine:
    kv = HostKVBuffer(PAGE * BLOCKS, "fullkv")
    kv.data[:] = 7
    # While the engine pins the rest of its pool, something else fills /dev/shm.
    fd = os.open("/dev/shm/filler", os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        while os.write(fd, bytes(1 << 20)):
            pass
    except OSError:  # no space left: full
        pass
    os.close(fd)
    deadline = time.monotonic() + 20
    while "pinning stopped" not in open(sys.argv[1]).read() and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = read_stats(NAME)
    print("ready", stats["pool_bytes_ready"], stats["pool_bytes_capacity"], flush=True)
    client = EngineClient.connect(NAME)
    client.register_region(0, kv.region_record(BLOCKS, PAGE, 1), layer_records([0], [0], [PAGE]))
    hashes = [i.to_bytes(4, "little") * 8 for i in range(BLOCKS)]
    done = client.wait(client.submit_save(1, np.arange(BLOCKS), encode_hashes(hashes)), 10)
    print("save", done.status, done.value, flush=True)
    client.close()
    kv.close()
    print("engine exit", engine.stop(), flush=True)
"""


@pytest.mark.skipif(not _can_unshare(), reason="needs root and unshare -m to mount a private tmpfs")
def test_shm_full_while_pinning_leaves_the_engine_serving_with_what_it_pinned(tmp_path):
    # 1. A 72 MiB /dev/shm: the 48 MiB pool (pinned 4 MiB at a time, 8 MiB a second), its
    #    rings and the client's 4 MiB of KV fit; once the engine serves, a file takes the rest.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    log = tmp_path / "engine.log"
    try:
        done = subprocess.run(["unshare", "-m", "sh", "-c",
                               f"mount -t tmpfs -o size=72M tmpfs /dev/shm && exec {sys.executable} "
                               f"-c '{MID_PIN_SCRIPT}' {log}"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    finally:
        subprocess.run(["pkill", "-f", f"engine --name shmpin{os.getpid()}"], capture_output=True)
    out = done.stdout + done.stderr + log.read_text()
    # 2. The pinning stopped short with the numbers logged, the engine stayed up at that pool,
    #    a save into it went through, and it stopped cleanly.
    assert "ERROR engine.memory.pinning: pool: pinning stopped at" in out and "/dev/shm cannot hold" in out, out
    ready, capacity = (int(v) for v in done.stdout.split("ready ", 1)[1].split()[:2])
    assert 4 << 20 <= ready < capacity == 48 << 20, out
    assert "save 0 64" in done.stdout and "engine exit 0" in done.stdout, out
