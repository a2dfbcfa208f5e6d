"""Single-producer single-consumer rings of fixed records, and the payload arena.

Layout of one client's ring segment (``ring.<slot>``, created by the engine)::

    0                     64                  64+64n             64+112n          end
    | RING_HEADER         | SUBMISSION x n    | COMPLETION x n   | arena (A bytes) |
                           client -> engine    engine -> client   client -> engine

Every record starts with a ``seq`` word (Vyukov style).  Position ``p`` (a monotonically
increasing counter; slot ``p % n``) is free for the producer when ``seq == p``, published
when ``seq == p + 1`` and handed back by the consumer as ``seq = p + n``.  The producer
writes every other field before ``seq``, so a consumer never sees a torn record; the
consumer copies the record out before handing the slot back.  Full and empty differ
because positions never wrap.

Variable-length payload (hashes, block ids) goes into the arena, allocated by the
producer in submission order and reclaimed in the same order once the consumer has
handed back the submission's slot (the engine copies the payload out on dequeue).

Waits spin for ``spin_s`` and then sleep on a ``posix_ipc.Semaphore`` doorbell that the
producer posts after every publish; every wait has a deadline and ends in a typed error.
"""

from __future__ import annotations

import collections
import struct
import threading
import time
from collections import deque

import numpy as np
import posix_ipc

from pegaflow.errors import PayloadTooLargeError, RingEmptyError, RingFullError
from pegaflow.wire import COMPLETION, RING_HEADER, SUBMISSION

ARENA_ALIGN = 64
DEFAULT_SPIN_S = 50e-6


def ring_segment_bytes(ring_slots: int, arena_bytes: int) -> int:
    return (RING_HEADER.itemsize + ring_slots * (SUBMISSION.itemsize + COMPLETION.itemsize)
            + arena_bytes)


def reset_slots(slots: np.ndarray) -> None:
    """Make every slot free for lap 0 (the creator does this; so does a reclaim)."""
    slots[:] = np.zeros(1, dtype=slots.dtype)
    slots["seq"] = np.arange(len(slots), dtype=np.uint64)


_fence_lock = threading.Lock()


def fence() -> None:
    """A full memory barrier (a locked instruction): orders our store before our next load."""
    _fence_lock.acquire()
    _fence_lock.release()


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
        if self.sem is None:
            return
        if self.sleeping is not None:
            fence()
            if not self.sleeping[0]:
                return
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


def _struct_of(dtype: np.dtype) -> struct.Struct:
    """A ``struct.Struct`` with the same layout as a wire dtype (checked byte for byte)."""
    codes = {np.dtype("<u8"): "Q", np.dtype("<u4"): "I", np.dtype("<u2"): "H",
             np.dtype("<i8"): "q", np.dtype("<i4"): "i", np.dtype("u1"): "B"}
    fmt, at = "<", 0
    for name in dtype.names:
        field_dtype, offset = dtype.fields[name][:2]
        fmt += "x" * (offset - at) + codes[field_dtype]
        at = offset + field_dtype.itemsize
    fmt += "x" * (dtype.itemsize - at)
    packer = struct.Struct(fmt)
    assert packer.size == dtype.itemsize, f"struct layout of {dtype} is off"
    return packer


def record_type(dtype: np.dtype) -> type:
    """A named tuple of a wire dtype's fields that also answers ``rec["field"]``."""
    base = collections.namedtuple(f"Record{len(dtype.names)}", dtype.names)

    def __getitem__(self, key):
        return getattr(self, key) if isinstance(key, str) else tuple.__getitem__(self, key)
    return type(base.__name__, (base,), {"__slots__": (), "__getitem__": __getitem__})


class _RingView:
    """Raw access to a ring's records: seq words and whole records through ``struct``."""

    def __init__(self, slots: np.ndarray):
        self.slots = slots
        self.num_slots = len(slots)
        self.itemsize = slots.dtype.itemsize
        self.buf = memoryview(slots.view(np.uint8).reshape(-1))
        self.packer = _struct_of(slots.dtype)
        self.make = record_type(slots.dtype)._make
        self.seq_codec = struct.Struct("<Q")

    def seq(self, index: int) -> int:
        return self.seq_codec.unpack_from(self.buf, index * self.itemsize)[0]

    def set_seq(self, index: int, value: int) -> None:
        self.seq_codec.pack_into(self.buf, index * self.itemsize, value)


class RingProducer(_RingView):
    def __init__(self, slots: np.ndarray, doorbell: Doorbell | None = None):
        super().__init__(slots)
        self.position = 0
        self.doorbell = doorbell or Doorbell(None)

    def is_consumed(self, position: int) -> bool:
        """Whether the consumer has taken the record published at ``position``."""
        return self.seq(position % self.num_slots) >= position + self.num_slots

    def try_put(self, record) -> bool:
        """Publish one record (a tuple in field order, or a numpy record; its ``seq`` is
        ignored) if a slot is free; never blocks."""
        p = self.position
        i = p % self.num_slots
        if self.seq(i) != p:
            return False
        values = record.item() if isinstance(record, np.void) else record
        self.packer.pack_into(self.buf, i * self.itemsize, p, *values[1:])
        self.set_seq(i, p + 1)
        self.position = p + 1
        self.doorbell.ring()
        return True

    def put(self, record, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pause = 1e-6
        while not self.try_put(record):
            if time.monotonic() >= deadline:
                raise RingFullError(f"ring full for {timeout_s:.3f}s ({self.num_slots} slots)")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)


class RingConsumer(_RingView):
    def __init__(self, slots: np.ndarray, doorbell: Doorbell | None = None):
        super().__init__(slots)
        self.position = 0
        self.doorbell = doorbell or Doorbell(None)

    def is_ready(self) -> bool:
        return self.seq(self.position % self.num_slots) == self.position + 1

    def try_peek(self):
        """The next record (a private copy, as a named tuple) if one is published, without
        handing its slot back: the producer may reuse the record's payload only after
        ``release``.  Never blocks."""
        i = self.position % self.num_slots
        if self.seq(i) != self.position + 1:
            return None
        return self.make(self.packer.unpack_from(self.buf, i * self.itemsize))

    def release(self) -> None:
        """Hand the peeked slot (and with it the record's payload) back to the producer."""
        c = self.position
        self.set_seq(c % self.num_slots, c + self.num_slots)
        self.position = c + 1

    def try_get(self):
        """Take one record (a private copy, as a named tuple) if one is published; never blocks."""
        record = self.try_peek()
        if record is not None:
            self.release()
        return record

    def get(self, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        record = self.try_get()
        while record is None:
            wait_until(self.is_ready, self.doorbell, deadline)
            record = self.try_get()
            if record is None and time.monotonic() >= deadline:
                raise RingEmptyError(f"nothing arrived within {timeout_s:.3f}s")
        return record


def wait_until(is_ready, doorbell: Doorbell, deadline: float) -> bool:
    """Spin on ``is_ready`` for the doorbell's spin time, then sleep on it until ``deadline``."""
    spin_end = min(deadline, time.monotonic() + doorbell.spin_s)
    while time.monotonic() < spin_end:
        if is_ready():
            return True
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
        deadline = time.monotonic() + timeout_s
        pause = 1e-6
        while (offset := self.try_alloc(num_bytes)) is None:
            if time.monotonic() >= deadline:
                raise RingFullError(f"payload arena full for {timeout_s:.3f}s")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
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


class RingSegmentView:
    """The four parts of one ``ring.<slot>`` segment as numpy views."""

    def __init__(self, segment, ring_slots: int, arena_bytes: int):
        at = 0
        self.header = segment.array(RING_HEADER, 1, at)
        at += RING_HEADER.itemsize
        self.submissions = segment.array(SUBMISSION, ring_slots, at)
        at += ring_slots * SUBMISSION.itemsize
        self.completions = segment.array(COMPLETION, ring_slots, at)
        at += ring_slots * COMPLETION.itemsize
        self.arena = segment.array(np.uint8, arena_bytes, at)
        flag_at = RING_HEADER.fields["client_sleeping"][1]
        self.client_sleeping = memoryview(self.header.view(np.uint8)[flag_at:flag_at + 4]).cast("I")
