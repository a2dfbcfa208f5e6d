"""Letting go of a client's driver handles: never raising, and for a gone client never on the
engine's thread.

A client killed while the GPU still runs its work (or while an engine stream waits on one of
its IPC events, a held SAVE's gate: ``held_saves.py``) leaves handles whose release the driver
may refuse (an error of the dead context) or hold up: ``cuIpcCloseMemHandle`` unmaps, and an
unmap may wait for GPU work that never ends.  Neither may keep its slot from being reclaimed
or hold up the engine's one thread (every other client's commands) or its stop.  So:

    release_logged(steps, why)  each ``(release, handle)`` run, even if another fails; a
                                ``CudaError`` logged with ``why``, never raised (the handle is
                                let go either way: there is nothing to retry)
    Releaser.submit(steps, why) the same on a thread of its own, not waited for (a gone
                                client's handles)
    Releaser.close(wait_s)      waits at most ``wait_s`` for what was handed over; what is
                                still running is logged and left to the process exit
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

from pegaflow.platform.errors import CudaError

logger = logging.getLogger(__name__)

Steps = Sequence[tuple[Callable[[object], object], object]]


def release_logged(steps: Steps, why: str) -> int:
    """Run every step; returns how many failed (each logged with ``why``)."""
    num_failed = 0
    for release, handle in steps:
        try:
            release(handle)
        except CudaError as exc:
            num_failed += 1
            logger.error("%s: %s failed (%s); the handle is let go anyway", why,
                         getattr(release, "__name__", "a release"), exc)
    return num_failed


class Releaser:
    """One daemon thread that runs handed-over releases in order (started at the first)."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self.running: str | None = None  # the ``why`` of the steps running now, for the logs
        self._lock = threading.Lock()
        self.num_pending = 0  # handed over, not yet done (counted under ``_lock``: two threads)

    def submit(self, steps: Steps, why: str) -> None:
        if not steps:
            return
        with self._lock:
            self.num_pending += 1
        self._queue.put((list(steps), why))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pegaflow-releaser", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            steps, self.running = item
            release_logged(steps, self.running)
            self.running = None
            with self._lock:
                self.num_pending -= 1

    def close(self, wait_s: float) -> bool:
        """True once everything handed over is done (within ``wait_s``); False: the rest is
        logged and abandoned (the thread is a daemon: the process exit ends it)."""
        if self._thread is None:
            return True
        self._queue.put(None)
        deadline = time.monotonic() + wait_s
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if not self._thread.is_alive():
            self._thread = None
            return True
        logger.error("releasing a gone client's handles did not end within %.1f s (%d left, now: %s); "
                     "left to the process exit", wait_s, self.num_pending, self.running)
        return False
