"""Readying the pool while the engine serves: faulted in and pinned a chunk at a time, the
first chunk before clients are accepted, the others on a thread of their own.

    pinner = PoolPinner(segment, backend, chunk_bytes, num_threads, rate_bytes)
    pinner.pin_first()      the first chunk, on the caller's thread (raises on failure)
    pinner.start(wake)      the others, in address order, on the pinning thread
    pinner.progress         a PinProgress, replaced (never changed) after each chunk
    pinner.stop()           at shutdown: the thread ends after the step under way, joined

The pinning thread faults the pool's memory in (``fault_in``, on ``num_threads`` threads
of its own) and calls the backend's ``pin_range``, nothing else: the PagePool and the
index are the dispatcher's.  After each chunk it publishes a new ``PinProgress`` (one
reference stored, atomic under the GIL) and calls ``wake`` (the engine's doorbell); the
dispatcher takes it in when it next looks and grows the usable pool (``EngineServer``).
Chunk k + 1 is faulted in while chunk k is pinned.  A chunk that cannot be faulted in or
pinned (a full /dev/shm, a registration refused) ends the pinning, logged with the
numbers: the pool stays at what was pinned, and the engine serves on.  Progress is
logged every 10 %, and at the end the rate.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from pegaflow.platform import shm
from pegaflow.platform.errors import PegaflowError
from pegaflow.platform.values import format_size

from ..copy.base import CopyBackend
from . import fault_in

logger = logging.getLogger(__name__)

STOP_WAIT_S = 30.0  # a chunk's step (its faults, one registration) ends well within this


@dataclass(frozen=True, slots=True)
class PinProgress:
    ready_bytes: int = 0        # the pool's first bytes faulted in and pinned
    is_finished: bool = False   # nothing more comes: the whole pool, a failure, or a stop
    error: str | None = None    # why the pinning ended short of the pool
    elapsed_ns: int = 0         # from the first chunk's start to this publication


class PoolPinner:
    def __init__(self, segment: shm.Segment, backend: CopyBackend, chunk_bytes: int,
                 num_threads: int, rate_bytes: int = 0):
        """``chunk_bytes``: whole slabs (the pool's end may cut the last chunk short);
        ``rate_bytes``: the most bytes a second the pinning thread takes (0: no limit)."""
        self.segment, self.backend = segment, backend
        self.chunk_bytes = min(chunk_bytes, segment.size)
        self.num_threads = max(1, num_threads)
        self.rate_bytes = rate_bytes
        self.progress = PinProgress()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake: Callable[[], None] = lambda: None
        self._started = 0.0
        self._fault_wait_s = self._pin_s = 0.0  # the pinning thread's time in each
        self._method = fault_in.method()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def chunks(self) -> list[tuple[int, int]]:
        size = self.segment.size
        return [(s, min(self.chunk_bytes, size - s)) for s in range(0, size, self.chunk_bytes)]

    def pin_first(self) -> None:
        """Fault in and pin the first chunk now; a PegaflowError if that fails."""
        self._started = time.perf_counter()
        fault_in.advise_huge_pages(self.segment)
        self._method = fault_in.fault_in(self.segment, 0, self.chunk_bytes, self.num_threads)
        self.backend.pin_range(0, self.chunk_bytes)
        self._publish(self.chunk_bytes)
        if not self.progress.is_finished:
            logger.info("pool: first %s pinned in %.2f s; the other %s in the background "
                        "(%d threads, fault-in by %s)", format_size(self.chunk_bytes),
                        time.perf_counter() - self._started,
                        format_size(self.segment.size - self.chunk_bytes), self.num_threads,
                        self._method)

    def start(self, wake: Callable[[], None] = lambda: None) -> None:
        """Pin the other chunks on a thread; ``wake()`` after each (from that thread)."""
        if self.progress.is_finished:
            return
        self._wake = wake
        self._thread = threading.Thread(target=self._run, name="pegaflow-pin", daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """Have the pinning thread end after its step under way (without waiting for it)."""
        self._stop.set()

    def stop(self, timeout_s: float = STOP_WAIT_S) -> bool:
        """End the pinning thread after its step under way; whether it ended in time."""
        self._stop.set()
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error("the pool's pinning thread did not stop within %.0f s", timeout_s)
            return False
        return True

    def _run(self) -> None:
        chunks = self.chunks()[1:]
        try:
            with ThreadPoolExecutor(self.num_threads, thread_name_prefix="pegaflow-fault") as pool:
                faults = self._fault(pool, *chunks[0])
                for i, (start, num_bytes) in enumerate(chunks):
                    waited = time.perf_counter()
                    self._method = [f.result() for f in faults][-1]
                    self._fault_wait_s += time.perf_counter() - waited
                    if self._stop.is_set():
                        return
                    faults = self._fault(pool, *chunks[i + 1]) if i + 1 < len(chunks) else []
                    pinned = time.perf_counter()
                    self.backend.pin_range(start, num_bytes)
                    self._pin_s += time.perf_counter() - pinned
                    self._publish(start + num_bytes)
                    self._wake()
                    self._pace(start + num_bytes)
        except PegaflowError as exc:
            self._fail(str(exc))
        except Exception as exc:  # boundary of a thread: the engine serves on with its pool
            logger.exception("pinning the pool")
            self._fail(f"{type(exc).__name__}: {exc}")

    def _fault(self, pool: ThreadPoolExecutor, start: int, num_bytes: int) -> list[Future]:
        return [pool.submit(fault_in.fault_range, self.segment, *part)
                for part in fault_in.split(start, num_bytes, self.num_threads)]

    def _pace(self, done_bytes: int) -> None:
        """With a rate limit, wait (or until stopped) until ``done_bytes`` are due."""
        if self.rate_bytes:
            due = self._started + (done_bytes - self.chunk_bytes) / self.rate_bytes
            self._stop.wait(max(0.0, due - time.perf_counter()))

    def _publish(self, ready_bytes: int) -> None:
        size, before = self.segment.size, self.progress.ready_bytes
        elapsed = time.perf_counter() - self._started
        self.progress = PinProgress(ready_bytes, ready_bytes >= size, None, int(elapsed * 1e9))
        if ready_bytes >= size:
            self._log_done(elapsed)
        elif before and ready_bytes * 10 // size > before * 10 // size:  # every 10 %
            logger.info("pool: %s / %s pinned (%d %%), %.1f GB/s so far", format_size(ready_bytes),
                        format_size(size), ready_bytes * 100 // size, ready_bytes / elapsed / 1e9)

    def _log_done(self, elapsed: float) -> None:
        size, huge = self.segment.size, fault_in.huge_page_bytes(self.segment)
        logger.info("pool: %s pinned in %.2f s, %.1f GB/s (fault-in by %s on %d threads, "
                    "%s in 2 MiB pages; the pinning thread waited %.2f s for faults, %.2f s "
                    "pinning)", format_size(size), elapsed, size / elapsed / 1e9, self._method,
                    self.num_threads, "none" if not huge else format_size(huge),
                    self._fault_wait_s, self._pin_s)

    def _fail(self, why: str) -> None:
        done = self.progress
        logger.error("pool: pinning stopped at %s of %s: %s; the engine serves with the %s "
                     "pinned", format_size(done.ready_bytes), format_size(self.segment.size),
                     why, format_size(done.ready_bytes))
        self.progress = PinProgress(done.ready_bytes, True, why, done.elapsed_ns)
        self._wake()
