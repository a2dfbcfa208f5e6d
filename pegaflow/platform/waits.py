"""Waiting on shared memory: the memory fence around seq words, the doorbell a producer
rings after publishing, and the two waits built on them (``sleep_until`` for what a
doorbell announces, ``poll_until`` for what nobody announces).
"""

from __future__ import annotations

import platform
import threading
import time

import posix_ipc

DEFAULT_SPIN_S = 50e-6

# x86 keeps stores in order and loads in order (TSO): a record written before its seq word
# is seen before it.  Elsewhere (aarch64, e.g. Grace Hopper) ``fence()`` goes between the
# record and its seq word on both sides; from Python that is a lock round trip (atomic
# read-modify-writes), which orders in practice but is not formally a full fence there:
# x86 is the platform these rings are tested on.
WEAK_MEMORY_ORDER = platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686")

_fence_lock = threading.Lock()
_fence_acquire, _fence_release = _fence_lock.acquire, _fence_lock.release


def fence() -> None:
    """A lock round trip: on x86 a locked instruction, a full barrier that orders our store
    before our next load (see WEAK_MEMORY_ORDER for other CPUs)."""
    _fence_acquire()
    _fence_release()


class Doorbell:
    """Wake a sleeping consumer without a system call when it is awake.

    The consumer spins first; before sleeping on the semaphore it raises ``sleeping``
    (a word in shared memory), fences, and re-checks its ring.  The producer publishes,
    fences, and posts the semaphore only if ``sleeping`` is raised.  Either the consumer
    sees the record or the producer sees the flag, so no wake-up is lost.
    """

    def __init__(self, sem: posix_ipc.Semaphore | None, sleeping: memoryview | None = None,
                 spin_s: float = DEFAULT_SPIN_S):
        self.sem = sem
        self.sleeping = sleeping
        self.spin_s = spin_s

    def ring(self) -> None:
        """Call after publishing: posts the semaphore only if the consumer sleeps."""
        sleeping = self.sleeping
        if sleeping is not None:
            _fence_acquire()  # fence(), inlined: our publish before our read of the flag
            _fence_release()
            if not sleeping[0]:
                return
        if self.sem is not None:
            self.sem.release()

    def drain(self) -> None:
        """Drop pending wake-ups; call before re-checking the ring and sleeping."""
        if self.sem is None:
            return
        try:
            while True:
                self.sem.acquire(0)
        except posix_ipc.BusyError:
            return

    def set_sleeping(self, is_sleeping: bool) -> None:
        if self.sleeping is not None:
            self.sleeping[0] = int(is_sleeping)
            if is_sleeping:
                fence()

    def sleep(self, timeout_s: float) -> None:
        """Sleep until rung or ``timeout_s``; without a semaphore, a short nap."""
        if timeout_s <= 0:
            return
        if self.sem is None:
            time.sleep(min(timeout_s, 1e-3))
            return
        try:
            self.sem.acquire(timeout_s)
        except (posix_ipc.BusyError, posix_ipc.SignalError):
            return  # timed out, or a signal arrived: the caller re-checks its state


def poll_until(attempt, timeout_s: float, first_pause_s: float = 1e-6, max_pause_s: float = 1e-3):
    """``attempt()`` until it returns something other than None (returned), or None once
    ``timeout_s`` has passed; the pauses between attempts double up to ``max_pause_s``.
    For waits nobody rings a doorbell for (a free ring slot, arena space, a slot state)."""
    deadline = time.monotonic() + timeout_s
    pause = first_pause_s
    while (result := attempt()) is None:
        if time.monotonic() >= deadline:
            return None
        time.sleep(pause)
        pause = min(pause * 2, max_pause_s)
    return result


def sleep_until(is_ready, doorbell: Doorbell, deadline: float) -> bool:
    """Sleep on the doorbell until ``is_ready`` (True) or ``deadline`` (False)."""
    while True:
        doorbell.drain()
        doorbell.set_sleeping(True)
        if is_ready():
            doorbell.set_sleeping(False)
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            doorbell.set_sleeping(False)
            return False
        doorbell.sleep(remaining)
        doorbell.set_sleeping(False)
        if time.monotonic() >= deadline:  # woken by the deadline: one last look, no re-arming
            return is_ready()
