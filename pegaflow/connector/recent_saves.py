"""What this rank's SAVEs sent in the last steps, for when a load fails on another rank.

With tensor or pipeline parallelism every rank's forward computes from every rank's KV:
a load that fails on one rank makes the others compute (and save) from its bad pages too.
The failing rank keeps those saves to itself (``Taint``); the others learn of the failure
only when the scheduler reports it, one step later (two with asynchronous scheduling, and
one more per pipeline stage in flight), and must then have the engine forget what they
stored meanwhile.  This keeps the SAVEs of that many steps (request id and hash records).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from pegaflow.wire import HASH

RECENT_SAVE_STEPS = 3  # the step that read bad pages, the one planned before it was known, margin


class RecentSaves:
    def __init__(self, pipeline_stages: int = 1):
        self._steps: deque[list[tuple[int, np.ndarray]]] = deque(
            maxlen=max(RECENT_SAVE_STEPS, pipeline_stages + 2))

    def __len__(self) -> int:
        """Steps held."""
        return len(self._steps)

    def new_step(self) -> None:
        self._steps.append([])

    def sent(self, request_id: int, records: np.ndarray) -> None:
        """This step's SAVE ``request_id`` went out with these HASH records."""
        if self._steps:
            self._steps[-1].append((request_id, records))

    def take(self) -> tuple[np.ndarray, int] | None:
        """Every hash of the steps held and the first of their SAVEs' request ids (None if
        they sent none); the window starts over."""
        sent = [save for step in self._steps for save in step]
        self._steps.clear()
        if not sent:
            return None
        hashes = np.concatenate([r for _, r in sent], dtype=HASH)  # dtype=: keeps HASH's padding
        return hashes, min(request_id for request_id, _ in sent)
