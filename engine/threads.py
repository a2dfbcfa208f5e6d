"""Worker threads' end: every thread joined within one deadline, not one deadline each."""

from __future__ import annotations

import threading
import time


def join_within(threads: list[threading.Thread], timeout_s: float) -> int:
    """Join ``threads`` within ``timeout_s`` in all; returns how many are still alive."""
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return sum(thread.is_alive() for thread in threads)
