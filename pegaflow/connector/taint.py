"""Which of a step's saves must not go out because they would store garbage.

A block whose load failed holds garbage until vLLM recomputes it, and so does whatever a
request computed while reading it: such a request may be the one whose load failed, or
another that vLLM's own prefix cache gave the same blocks in the same step.  Their saves
are dropped for ``TAINT_STEPS`` steps: the failing one and the next, which asynchronous
scheduling may have planned before vLLM learned of the failure.  After that vLLM
recomputes, and the scheduler plans those blocks' saves again.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

TAINT_STEPS = 2


class Taint:
    def __init__(self) -> None:
        self._blocks: dict[int, int] = {}  # block id -> steps it still taints
        self._reqs: dict[str, int] = {}    # request id -> steps it is still tainted

    def next_step(self) -> None:
        for tainted in (self._blocks, self._reqs):
            for key in [k for k, left in tainted.items() if left <= 1]:
                del tainted[key]
            for key in tainted:
                tainted[key] -= 1

    def failed_load(self, req_id: str, block_ids) -> None:
        self._blocks.update(dict.fromkeys(block_ids, TAINT_STEPS))
        self._reqs[req_id] = TAINT_STEPS

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
            if any(b in blocks for b in spec.block_ids):
                reqs[spec.req_id] = TAINT_STEPS
                continue
            kept.append(spec)
        if len(kept) < len(saves):
            logger.warning("pegaflow: %d saves dropped: their requests read blocks whose load "
                           "failed (vLLM recomputes them)", len(saves) - len(kept))
        return kept
