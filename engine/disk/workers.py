"""The disk tier's I/O threads: each takes a job (read or write one block file), does the
file I/O and the checksum, and queues a DiskDone for the main thread to poll.

Nothing here touches the store's index: results are applied by ``DiskStore.poll`` on the
engine's thread.  ``wake`` (the engine's doorbell) is called after each result is queued.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..blocks.entries import Key
from ..threads import join_within
from . import blockfile

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class DiskDone:
    token: int
    key: Key
    is_read: bool
    error: str | None
    is_corrupt: bool
    num_bytes: int  # data bytes moved: 0 on error
    elapsed_ns: int


@dataclass(slots=True)
class DiskJob:
    token: int
    key: Key
    is_read: bool
    path: str  # the block file (a string: named on the engine thread)
    buf: memoryview
    num_layers: int = 0


class IoWorkers:
    def __init__(self, num_threads: int, wake: Callable[[], None] | None = None) -> None:
        self._wake = wake
        # (0 read | 1 write | 2 stop, sequence, job): a lookup's reads, which a LOAD waits on,
        # go before the writes of blocks on their way out of the pool
        self._jobs: queue.PriorityQueue[tuple[int, int, DiskJob | None]] = queue.PriorityQueue()
        self._sequence = itertools.count()
        self._results: collections.deque[DiskDone] = collections.deque()
        self._errnos_seen: set[int] = set()
        self._errnos_lock = threading.Lock()
        self._threads = [threading.Thread(target=self._work, name=f"pegaflow-disk-{i}", daemon=True)
                         for i in range(num_threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, job: DiskJob) -> None:
        self._jobs.put((0 if job.is_read else 1, next(self._sequence), job))

    def has_results(self) -> bool:
        return bool(self._results)

    def take_results(self):
        """The results queued so far, oldest first (never blocks)."""
        while self._results:
            yield self._results.popleft()

    def close(self, timeout_s: float, drop_queued: bool = False) -> bool:
        """Stop the threads once the queued jobs end (or, ``drop_queued``, once those under way
        end: the rest never run), waiting at most ``timeout_s``; whether they all stopped."""
        num_dropped = 0
        while drop_queued:
            try:
                self._jobs.get_nowait()
            except queue.Empty:
                break
            num_dropped += 1
        for _ in self._threads:
            self._jobs.put((2, next(self._sequence), None))
        num_alive = join_within(self._threads, timeout_s)
        if num_alive:
            logger.warning("%d disk workers still busy %.1f s after close", num_alive, timeout_s)
        if num_dropped:
            logger.info("disk tier: %d queued reads and writes dropped at close", num_dropped)
        return num_alive == 0

    def _work(self) -> None:
        while (job := self._jobs.get()[2]) is not None:
            self._results.append(self._run(job))
            if self._wake is not None:
                self._wake()

    def _run(self, job: DiskJob) -> DiskDone:
        start_ns = time.perf_counter_ns()
        error, is_corrupt = None, False
        try:
            if job.is_read:
                error = blockfile.read_block(job.path, job.key, job.buf)
                is_corrupt = error is not None
            else:
                blockfile.write_block(job.path, job.key, job.buf, job.num_layers)
        except OSError as exc:
            error = str(exc)
            self.log_os_error(exc, "read" if job.is_read else "write")
        except Exception as exc:  # a worker's boundary: the main thread must still get its answer
            logger.exception("disk %s of %s failed", "read" if job.is_read else "write", job.path)
            error = repr(exc)
        num_bytes = job.buf.nbytes if error is None else 0
        return DiskDone(job.token, job.key, job.is_read, error, is_corrupt, num_bytes,
                        time.perf_counter_ns() - start_ns)

    def log_os_error(self, exc: OSError, action: str) -> None:
        """The first error of each errno at WARNING, the rest at DEBUG (they are counted)."""
        with self._errnos_lock:
            is_first = exc.errno not in self._errnos_seen
            self._errnos_seen.add(exc.errno)
        logger.log(logging.WARNING if is_first else logging.DEBUG,
                   "disk %s failed: %s (further errors of errno %s are logged at DEBUG)", action, exc, exc.errno)
