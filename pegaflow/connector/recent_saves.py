"""What this rank's SAVEs sent in the last steps, for when a load fails on another rank.

With tensor or pipeline parallelism every rank's forward computes from every rank's KV:
a load that fails on one rank makes the others compute (and save) from its bad pages too.
The failing rank keeps those saves to itself (``Taint``); the others learn of the failure
only when the scheduler reports it, one step later (two with asynchronous scheduling, and
one more per pipeline stage in flight), and must then have the engine forget what they
stored meanwhile.  This keeps the SAVEs of that many steps (command id and hash records).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import NamedTuple

import numpy as np

from pegaflow.platform.errors import PegaflowError
from pegaflow.platform.wire import HASH

logger = logging.getLogger(__name__)

RECENT_SAVE_STEPS = 3  # the step that read bad pages, the one planned before it was known, margin


class SentHashes(NamedTuple):
    command_id: int  # the engine's id of the SAVE
    records: np.ndarray  # its HASH records


class StoredSince(NamedTuple):
    hashes: np.ndarray  # HASH records of every SAVE held
    since_command: int  # the first of their command ids


class RecentSaves:
    def __init__(self, pipeline_stages: int = 1):
        self._steps: deque[list[SentHashes]] = deque(
            maxlen=max(RECENT_SAVE_STEPS, pipeline_stages + 2))

    def __len__(self) -> int:
        """Steps held."""
        return len(self._steps)

    def new_step(self) -> None:
        self._steps.append([])

    def sent(self, command_id: int, records: np.ndarray) -> None:
        """This step's SAVE ``command_id`` went out with these HASH records."""
        if self._steps:
            self._steps[-1].append(SentHashes(command_id, records))

    def take(self) -> StoredSince | None:
        """Every hash of the steps held and the first of their SAVEs' command ids (None if
        they sent none); the window starts over."""
        sent = [save for step in self._steps for save in step]
        self._steps.clear()
        if not sent:
            return None
        hashes = np.concatenate([s.records for s in sent], dtype=HASH)  # dtype=: keeps HASH's padding
        return StoredSince(hashes, min(s.command_id for s in sent))

    def drop_stored(self, client, namespace: int, rank: int) -> PegaflowError | None:
        """A load failed on some rank in a recent step: the engine forgets what this rank's
        SAVEs of the steps held stored, over ``client``, the connection that sent them (None:
        gone; never a new one, the engine takes DROPs of the writer only), before this
        step's saves recompute the rewound blocks.  A lookup needs every rank's blocks (MLA's
        one shared copy: every rank's vote), so such a block was served meanwhile only if
        the failing rank held (or vouched for) it already.  The error that broke the
        connection, if one did."""
        num_steps = len(self)
        taken = self.take()
        if taken is None:
            return None
        hashes, since_command = taken
        if client is None:
            logger.warning("pegaflow worker rank %d: a load failed on some rank, but the link "
                           "that stored this rank's last %d saves (%d blocks) is gone: they "
                           "cannot be dropped", rank, num_steps, len(hashes))
            return None
        logger.warning("pegaflow worker rank %d: a load failed on some rank; dropping the "
                       "blocks this rank stored in the last %d steps (%d sent; computed from "
                       "its pages)", rank, num_steps, len(hashes))
        try:  # the engine drops only what these SAVEs stored, not what they deduplicated
            client.drop_nowait(namespace, hashes, since_command)
        except PegaflowError as exc:
            return exc
        return None
