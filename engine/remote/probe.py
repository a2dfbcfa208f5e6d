"""The remote store tried before the engine sets it up: bounded, stoppable, and quiet.

Mooncake's ``setup`` holds the GIL for as long as it runs, and with no master to answer it
retries for about 90 s (20 tries, two lines of its own log each): nothing in the engine's
process can bound it, nor stop on SIGTERM meanwhile.  So the same setup (no memory of its
own: a segment of 0) is first tried in a child process::

    check_master(master, timeout_s)   a TCP connection to the master's port: refused at once
                                      when nothing listens there
    probe_setup(..., timeout_s)       the child's setup; killed at the deadline, or when
                                      SIGTERM or SIGINT waits (the engine blocks both while
                                      it starts); its log kept out of ours (DEBUG only),
                                      its last line quoted in the error

Only when the child's setup succeeds does the engine make its own (a few ms with the master
up).  ``python -m`` of this module is the child.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pegaflow.platform.errors import RemoteTierError, StartInterruptedError

logger = logging.getLogger(__name__)

POLL_S = 0.02
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})
_PR_SET_PDEATHSIG = 1
_GLOG_PREFIX = re.compile(r"^[IWEF]\d{4} [\d:.]+\s+\d+ [\w.]+:\d+\] ")


def check_master(master: str, timeout_s: float) -> None:
    """RemoteTierError unless something accepts a TCP connection at ``master`` (host:port)
    within ``timeout_s``; StartInterruptedError on a stop signal meanwhile."""
    host, _, port = master.rpartition(":")
    deadline = time.monotonic() + timeout_s
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setblocking(False)
            error = sock.connect_ex(address)
            while error in (errno.EINPROGRESS, errno.EAGAIN):
                if _stop_pending():
                    raise StartInterruptedError("a stop signal came while the remote master was tried")
                if time.monotonic() >= deadline:
                    raise RemoteTierError(f"--remote-master {master}: no connection within {timeout_s:g} s "
                                          f"(--remote-start-timeout): is mooncake_master running there?")
                if select.select([], [sock], [], POLL_S)[1]:
                    error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    except OSError as exc:
        error, why = exc.errno, exc.strerror or str(exc)
    else:
        why = os.strerror(error) if error else ""
    if error:
        raise RemoteTierError(f"--remote-master {master}: cannot connect ({why}): is mooncake_master "
                              f"running there?")


def probe_setup(setup_args: list, timeout_s: float, deadline: float | None = None) -> None:
    """Run the store's setup with ``setup_args`` in a child process until ``deadline``
    (monotonic; default ``timeout_s`` from now, the budget an error names); RemoteTierError
    when it fails or is late, StartInterruptedError on a stop signal."""
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([sys.executable, "-m", __spec__.name, str(os.getpid()), json.dumps(setup_args)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                                env=_child_env())
        deadline = time.monotonic() + timeout_s if deadline is None else deadline
        try:
            while proc.poll() is None and time.monotonic() < deadline and not _stop_pending():
                time.sleep(POLL_S)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        log.seek(0)
        said = log.read()
    if said:
        logger.debug("remote store's client, trying the setup:\n%s", said.rstrip())
    if _stop_pending():
        raise StartInterruptedError("a stop signal came while the remote store was being set up")
    if proc.returncode == 0:
        return
    last = last_line(said)
    quoted = f" (its client said: {last})" if last else ""
    if proc.returncode == -signal.SIGKILL:
        raise RemoteTierError(f"--remote mooncake: the store's setup did not finish within {timeout_s:g} s "
                              f"(--remote-start-timeout){quoted}")
    raise RemoteTierError(f"--remote mooncake: the store's setup failed{quoted}")


def last_line(text: str) -> str:
    """The last line of the client's log, without its glog prefix (time, thread, file)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return _GLOG_PREFIX.sub("", lines[-1]) if lines else ""


def _stop_pending() -> bool:
    return bool(STOP_SIGNALS & signal.sigpending())


def _child_env() -> dict:
    """This process's environment, with the directory that holds our package first on the
    path (so that ``python -m`` finds this module from any working directory)."""
    top = sys.modules[__spec__.name.split(".")[0]]
    root = str(Path(top.__file__).resolve().parent.parent)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}


def _die_with_parent(parent_pid: int) -> None:
    """Be killed when the engine dies (SIGKILLed while it waits): a setup retrying a silent
    master would otherwise go on for minutes, an orphan."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # it died before that took hold
        os._exit(1)


def _child(parent_pid: int, setup_args: list) -> int:
    _die_with_parent(parent_pid)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # (blocked by the starting engine)
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    from mooncake.store import MooncakeDistributedStore
    code = MooncakeDistributedStore().setup(*setup_args)
    os._exit(0 if code == 0 else 1)  # no close: it holds no memory of its own, and close takes a second


if __name__ == "__main__":
    sys.exit(_child(int(sys.argv[1]), json.loads(sys.argv[2])))
