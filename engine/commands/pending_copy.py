"""A SAVE or LOAD in flight (``PendingCopy``, and where its time went), and how a SAVE is
cut into chunks."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from pegaflow.platform.wire import Opcode

from ..clients.client import ClientState
from .received import Received

FIRST_CHUNK = 64
MAX_CHUNK = 1024


@dataclass(slots=True)
class PendingCopy:
    """One SAVE or LOAD command (a SAVE is copied in chunks so the first bytes move early)."""

    client: ClientState
    received: Received | None  # the command, until answered (``received.py``); then None
    opcode: Opcode
    layer_mask: int
    bytes_per_block: int
    lease_id: int = 0
    chain: list | None = None  # a SAVE's keys, head first: touched tail to head when done
    is_sealed: bool = False
    num_ops: int = 0
    num_blocks: int = 0
    num_deduped: int = 0
    num_dropped: int = 0
    error: str | None = None
    # While DEBUG is logged (is_timed), also when the first chunk and every chunk were
    # handed to the backend: where its time went.
    is_timed: bool = False
    first_issued_at: float = 0.0
    sealed_at: float = 0.0
    command_id: int = field(init=False)
    received_at: float = field(init=False)  # time.perf_counter() at receipt

    def __post_init__(self) -> None:
        self.command_id, self.received_at = self.received.command_id, self.received.received_at

    def log_timing(self, logger: logging.Logger) -> None:
        """Where a SAVE's or LOAD's time went, from its receipt (DEBUG, while ``is_timed``)."""
        done = time.perf_counter()

        def since(mark: float) -> float:
            return (mark - self.received_at) * 1e3 if mark else float("nan")

        num_bytes = self.num_blocks * self.bytes_per_block
        logger.debug("slot %d: %s of %d blocks (%.1f MB): first copy handed to the backend "
                     "after %.2f ms, all after %.2f ms, done after %.2f ms (%.1f GB/s)%s",
                     self.client.slot, self.opcode.name, self.num_blocks, num_bytes / 1e6,
                     since(self.first_issued_at), since(self.sealed_at), since(done),
                     num_bytes / max(done - self.received_at, 1e-9) / 1e9,
                     f"; {self.error}" if self.error else "")


def chunk_bounds(num_items: int):
    """[0, 64), then chunks doubling up to 1024, then the last 64 on their own.

    A SAVE's bookkeeping and copy issue for each chunk hide behind the copy of the chunk
    before, so a chunk may be at most about twice the one before it without the GPU
    waiting (docs/benchmarks.md, "Figures behind the engine's constants").  A short
    first chunk starts the copies early and a short last chunk keeps the bookkeeping after
    the final copy short.
    """
    tail = max(num_items - FIRST_CHUNK, min(num_items, FIRST_CHUNK))
    start, size = 0, FIRST_CHUNK
    while start < tail:
        end = min(tail, start + size)
        yield start, end
        start, size = end, min(size * 2, MAX_CHUNK)
    if start < num_items:
        yield start, num_items
