"""A SAVE or LOAD in flight (``PendingCopy``), how a SAVE is cut into chunks, and the index
keys a command names."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pegaflow.platform.errors import CommandError
from pegaflow.platform.wire import Opcode, Status, hash_keys

from .clients import ClientState
from .entries import Key

ANSWERED_LATER = object()  # a handler's status when the answer goes out later (its copies end)

FIRST_CHUNK = 64
MAX_CHUNK = 1024


def command_keys(rec, records: np.ndarray) -> list[Key]:
    """The index keys (namespace, hash) of a command's HASH records."""
    namespace = rec.namespace
    if (records["length"] == 0).any() or (records["length"] > 32).any():
        raise CommandError(Status.BAD_PAYLOAD, "a hash record has a bad length")
    return [(namespace, key) for key in hash_keys(records)]


@dataclass(slots=True)
class PendingCopy:
    """One SAVE or LOAD command (a SAVE is copied in chunks so the first bytes move early)."""

    client: ClientState
    request_id: int
    opcode: Opcode
    layer_mask: int
    bytes_per_block: int
    lease_id: int = 0
    chain: list | None = None  # a SAVE's keys, head first: touched tail to head when done
    is_answered: bool = False
    is_sealed: bool = False
    num_ops: int = 0
    num_blocks: int = 0
    num_deduped: int = 0
    num_dropped: int = 0
    error: str | None = None
    received_at: float = 0.0  # time.perf_counter() at receipt: the latency histograms
    # While DEBUG is logged (is_timed), also when the first chunk and every chunk were
    # handed to the backend: where its time went.
    is_timed: bool = False
    first_issued_at: float = 0.0
    sealed_at: float = 0.0


def chunk_bounds(num_items: int):
    """[0, 64), then chunks doubling up to 1024, then the last 64 on their own.

    A SAVE's bookkeeping and copy issue for each chunk hide behind the copy of the chunk
    before: on the H200 test machine a block's copy takes ~40 us on the GPU and ~20 us of
    the dispatcher (bookkeeping ~3, issuing 32 page copies ~16), so a chunk may be at
    most about twice the one before it without the GPU waiting (grown 4x, 64 then 256,
    the second chunk's bookkeeping left the GPU idle).  A short first chunk starts the
    copies early and a short last chunk keeps the bookkeeping after the final copy short.
    """
    tail = max(num_items - FIRST_CHUNK, min(num_items, FIRST_CHUNK))
    start, size = 0, FIRST_CHUNK
    while start < tail:
        end = min(tail, start + size)
        yield start, end
        start, size = end, min(size * 2, MAX_CHUNK)
    if start < num_items:
        yield start, num_items
