"""The remote store's client: the few Mooncake Store calls the tier makes, behind one small
class (a test's fake store has the same methods).

    put(names, ptrs, sizes)   -> one code per object: 0 stored (or already there), < 0 failed
    get(names, ptrs, sizes)   -> one code per object: its length fetched, < 0 failed/missing
    put_parts / get_parts     the same, each object from (into) several buffers, in order
    exists(names)             -> one code per object: 1 held, 0 not, < 0 the call failed
    remove(names)             -> one code per object
    register(ptr, size)       memory the calls read from or write into, once each
    close()

Every call blocks (a stopped master: up to the store's 30 s RPC timeout), so only the
tier's worker threads make them.  The setup is tried first in a child process
(``probe.py``): bounded by ``--remote-start-timeout``, stopped by SIGTERM, its log kept out
of the engine's.  ``mooncake`` is imported here alone, only with ``--remote mooncake``:
without the package the engine refuses to start with a RemoteTierError.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import tempfile
import time

from pegaflow.platform.errors import RemoteTierError

from .probe import check_master, last_line, probe_setup

logger = logging.getLogger(__name__)

LOCAL_BUFFER_BYTES = 16 << 20  # the store's own staging buffer (our calls use registered memory)
ALREADY_EXISTS = -706  # OBJECT_ALREADY_EXISTS: a put of a block some engine published first
NOT_FOUND = -704       # OBJECT_NOT_FOUND


@contextlib.contextmanager
def stderr_kept_apart():
    """File descriptor 2 (where the store's C++ client logs) into a file for the block's
    time; yields a list that holds what was written once the block ends.  The engine's own
    log is not written meanwhile: the store's calls hold the GIL."""
    said: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile("w+") as log:
        os.dup2(log.fileno(), 2)
        try:
            yield said
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            log.seek(0)
            said.append(log.read())


def local_address(master: str) -> str:
    """This host's address on the route to ``master`` (host:port): what others reach it at."""
    host, _, port = master.rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, int(port)))  # (UDP: nothing is sent)
        except OSError as exc:
            raise RemoteTierError(f"--remote-master {master}: no route ({exc.strerror})") from exc
        return probe.getsockname()[0]


class MooncakeStore:
    def __init__(self, config) -> None:
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # the store's own INFO lines: not the engine's log
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except ImportError as exc:
            raise RemoteTierError(
                "--remote mooncake needs the mooncake-transfer-engine package (pip install -e "
                f"'.[remote]', or mooncake-transfer-engine-non-cuda on a host without CUDA): {exc}") from None
        self.host = config.remote_host or local_address(config.remote_master)
        timeout_s = config.remote_start_timeout_s
        logger.info("remote store: trying its master at %s (at most %g s, --remote-start-timeout)",
                    config.remote_master, timeout_s)
        deadline = time.monotonic() + timeout_s  # one budget for both steps, as the flag says
        check_master(config.remote_master, timeout_s)
        try:
            probe_setup([self.host, config.remote_metadata, 0, LOCAL_BUFFER_BYTES, config.remote_protocol,
                         config.remote_device, config.remote_master], timeout_s, deadline)
        except RemoteTierError as exc:
            raise RemoteTierError(f"{exc}; are the master at {config.remote_master} and the metadata "
                                  f"server at {config.remote_metadata} up, and {self.host} this host's "
                                  f"address?") from None
        self._store = MooncakeDistributedStore()
        self._replicas = ReplicateConfig()
        with stderr_kept_apart() as said:  # the store's own log lines: DEBUG, not the engine's log
            code = self._store.setup(self.host, config.remote_metadata, config.remote_segment_bytes,
                                     LOCAL_BUFFER_BYTES, config.remote_protocol, config.remote_device,
                                     config.remote_master)
        if said:
            logger.debug("remote store's client, at setup:\n%s", said[0].rstrip())
        if code != 0:
            last = last_line(said[0]) if said else ""
            raise RemoteTierError(f"--remote mooncake: the store's setup failed (code {code}"
                                  + (f"; its client said: {last})" if last else ")"))

        if config.remote_segment_bytes:  # its blocks in its own segment: a put is a local copy,
            self._replicas.preferred_segment = self._store.get_hostname()  # and they go with it

    def register(self, ptr: int, size: int) -> None:
        code = self._store.register_buffer(ptr, size)
        if code != 0:
            raise RemoteTierError(f"--remote mooncake: registering {size} bytes failed (code {code})")

    def put(self, names: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        codes = self._store.batch_put_from(names, ptrs, sizes, self._replicas)
        return [0 if code == ALREADY_EXISTS else code for code in codes]

    def get(self, names: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        return list(self._store.batch_get_into(names, ptrs, sizes))

    def put_parts(self, names: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        codes = self._store.batch_put_from_multi_buffers(names, ptrs, sizes, self._replicas)
        return [0 if code == ALREADY_EXISTS else code for code in codes]

    def get_parts(self, names: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        return list(self._store.batch_get_into_multi_buffers(names, ptrs, sizes))

    def exists(self, names: list[str]) -> list[int]:
        return list(self._store.batch_is_exist(names))

    def remove(self, names: list[str]) -> list[int]:
        """Forced: a block computed from bad data must go even within the store's lease."""
        return list(self._store.batch_remove(names, True))

    def close(self) -> None:
        code = self._store.close()
        if code != 0:
            logger.warning("remote store: close answered code %d", code)
