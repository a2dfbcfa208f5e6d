"""Which of a step's saves must not go out because they would store garbage.

A block whose load failed holds garbage until vLLM recomputes it, and so does whatever a
request computed while reading it: such a request may be the one whose load failed, or
another that vLLM's own prefix cache gave the same blocks.  Their saves are held back
until the scheduler has seen the failure (it then rewinds and replans those requests'
saves, and says so with ``rewound_block_ids`` in a later step's metadata).  Steps
scheduled before that, as asynchronous scheduling does, keep dropping them.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class Taint:
    def __init__(self) -> None:
        self._blocks: set[int] = set()            # blocks whose load failed
        self._reqs: dict[str, set[int]] = {}      # request id -> the failed blocks it read

    def failed_load(self, req_id: str, block_ids) -> None:
        self._blocks.update(block_ids)
        self._reqs.setdefault(req_id, set()).update(block_ids)

    def acknowledge(self, rewound_block_ids) -> None:
        """The scheduler has seen these failures: every request that held one of them is
        rewound and its saves replanned from the recomputed blocks on."""
        if not rewound_block_ids or not (self._blocks or self._reqs):
            return
        self._blocks.difference_update(rewound_block_ids)
        for req_id in [r for r, blocks in self._reqs.items() if not blocks.isdisjoint(rewound_block_ids)]:
            del self._reqs[req_id]

    def clean(self, saves: list) -> list:
        """The saves that neither belong to a tainted request nor hold a tainted block; the
        requests of the others become tainted in turn (they read those blocks)."""
        blocks, reqs = self._blocks, self._reqs
        if not blocks and not reqs:
            return saves
        kept = []
        for spec in saves:
            if spec.req_id in reqs:
                continue
            read = blocks.intersection(spec.block_ids)
            if read:
                reqs[spec.req_id] = read
                continue
            kept.append(spec)
        if len(kept) < len(saves):
            logger.warning("pegaflow: %d saves held back: their requests read blocks whose load "
                           "failed (vLLM recomputes them)", len(saves) - len(kept))
        return kept
