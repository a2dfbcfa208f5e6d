"""The payload arena of a client's ring segment: variable-length payload (hashes, block
ids), allocated by the producer in submission order and reclaimed in the same order once
the consumer has handed back the submission's slot (the engine copies the payload out on
dequeue).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from pegaflow.platform.errors import PayloadTooLargeError, RingFullError
from pegaflow.platform.ring import RingProducer
from pegaflow.platform.waits import poll_until

ARENA_ALIGN = 64


class PayloadArena:
    """The producer's allocator over the arena: in-order allocation and reclaim."""

    def __init__(self, arena: np.ndarray, producer: RingProducer):
        self.arena = arena
        self.num_bytes = len(arena)
        self.producer = producer
        self.head = 0
        self.tail = 0
        self._pending: deque[tuple[int, int]] = deque()  # (ring position, arena head after)

    def _reclaim(self) -> None:
        while self._pending and self.producer.is_consumed(self._pending[0][0]):
            self.tail = self._pending.popleft()[1]

    def try_alloc(self, num_bytes: int) -> int | None:
        """Offset of ``num_bytes`` free bytes, or None while the engine still reads them."""
        size = -(-num_bytes // ARENA_ALIGN) * ARENA_ALIGN
        if size > self.num_bytes:
            raise PayloadTooLargeError(
                f"payload of {num_bytes} bytes exceeds the {self.num_bytes}-byte arena")
        self._reclaim()
        if self.head == self.tail and not self._pending:
            # Empty: start the next payload at the arena's beginning, so any size that fits does.
            self.head = self.tail = -(-self.head // self.num_bytes) * self.num_bytes
        start = self.head
        if start % self.num_bytes + size > self.num_bytes:
            start += self.num_bytes - start % self.num_bytes
        if start + size - self.tail > self.num_bytes:
            return None
        self.head = start + size
        return start % self.num_bytes

    def alloc(self, num_bytes: int, timeout_s: float) -> int:
        offset = self.try_alloc(num_bytes)  # the usual case, without building a retry
        if offset is None:
            offset = poll_until(lambda: self.try_alloc(num_bytes), timeout_s)
        if offset is None:
            raise RingFullError(f"payload arena full for {timeout_s:.3f}s")
        return offset

    def write(self, offset: int, parts: list[np.ndarray]) -> int:
        """Copy arrays back to back at ``offset``; returns the bytes written."""
        at = offset
        for part in parts:
            raw = np.ascontiguousarray(part).view(np.uint8).reshape(-1)
            self.arena[at:at + len(raw)] = raw
            at += len(raw)
        return at - offset

    def mark_sent(self, position: int) -> None:
        """Tie the bytes allocated so far to the submission published at ``position``."""
        self._pending.append((position, self.head))
