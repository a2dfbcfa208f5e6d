"""Single-producer single-consumer rings of fixed records (the arena is ``arena.py``, the
waits ``waits.py``).

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

Seq words are read and written through a native ``memoryview`` of 64-bit words: one
aligned load or store each (atomic, unlike ``struct``'s byte-wise little-endian codec)
and the cheapest access Python has, which is what a spinning wait does in its loop.
"""

from __future__ import annotations

import collections
import functools
import struct
import sys
import time

import numpy as np

from pegaflow.platform.errors import RingEmptyError, RingFullError
from pegaflow.platform.waits import WEAK_MEMORY_ORDER, Doorbell, fence, poll_until, sleep_until
from pegaflow.platform.wire import COMPLETION, RING_HEADER, SUBMISSION

if sys.byteorder != "little":
    raise ImportError("pegaflow's rings read their little-endian seq words as native integers")


def ring_segment_bytes(ring_slots: int, arena_bytes: int) -> int:
    return (RING_HEADER.itemsize + ring_slots * (SUBMISSION.itemsize + COMPLETION.itemsize)
            + arena_bytes)


def reset_slots(slots: np.ndarray) -> None:
    """Make every slot free for lap 0 (the creator does this; so does a reclaim)."""
    slots[:] = np.zeros(1, dtype=slots.dtype)
    slots["seq"] = np.arange(len(slots), dtype=np.uint64)


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
    """Raw access to a ring's records: seq words through ``words``, whole records through
    ``struct``.  Slot ``i``'s seq is ``words[i * stride]`` (records are 8-byte multiples)."""

    def __init__(self, slots: np.ndarray):
        self.slots = slots
        self.num_slots = len(slots)
        itemsize = slots.dtype.itemsize
        assert slots.dtype.fields["seq"][1] == 0 and itemsize % 8 == 0, "seq must lead"
        self.buf = memoryview(slots.view(np.uint8).reshape(-1))
        self.words = self.buf.cast("Q")
        self.stride = itemsize // 8
        self.packer = _struct_of(slots.dtype)
        # Speed (the ring and the codec are the control path's only two places for it):
        # a record is built once per command, by tuple.__new__ straight away, the named
        # tuple's _make less its length check (unpack_from always yields every field):
        # ~160 ns against ~300 ns for the named tuple's own constructor (timeit, the 2-core
        # development machine, Python 3.11).
        self.make = functools.partial(tuple.__new__, record_type(slots.dtype))

    def seq(self, index: int) -> int:
        return self.words[index * self.stride]


class RingProducer(_RingView):
    def __init__(self, slots: np.ndarray, doorbell: Doorbell | None = None):
        super().__init__(slots)
        self.position = 0
        self.doorbell = doorbell or Doorbell(None)

    def is_consumed(self, position: int) -> bool:
        """Whether the consumer has taken the record published at ``position``."""
        return self.seq(position % self.num_slots) >= position + self.num_slots

    def has_room(self) -> bool:
        """Whether the next ``try_put_fields`` finds a free slot."""
        p = self.position
        return self.words[p % self.num_slots * self.stride] == p

    def try_put_fields(self, fields: tuple) -> bool:
        """Publish one record, given as its fields after ``seq``, if a slot is free; never blocks."""
        p = self.position
        at = p % self.num_slots * self.stride
        words = self.words
        if words[at] != p:
            return False
        self.packer.pack_into(self.buf, at * 8, p, *fields)  # seq stays p: not yet visible
        if WEAK_MEMORY_ORDER:
            fence()  # the record (and its payload) before the seq word that publishes it
        words[at] = p + 1
        self.position = p + 1
        self.doorbell.ring()
        return True

    def put_fields(self, fields: tuple, timeout_s: float) -> None:
        """``try_put_fields`` until it succeeds; RingFullError after ``timeout_s``."""
        if poll_until(lambda: self.try_put_fields(fields) or None, timeout_s) is None:
            raise RingFullError(f"ring full for {timeout_s:.3f}s ({self.num_slots} slots)")


class RingConsumer(_RingView):
    """The consumer keeps the word index of its next record's seq (``_at``) and the value
    that seq has once the record is published (``_ready``, position + 1)."""

    def __init__(self, slots: np.ndarray, doorbell: Doorbell | None = None):
        super().__init__(slots)
        self._at = 0
        self._ready = 1
        self.doorbell = doorbell or Doorbell(None)

    @property
    def position(self) -> int:
        return self._ready - 1

    def is_ready(self) -> bool:
        return self.words[self._at] == self._ready

    def num_published(self) -> int:
        """How many records are published and not taken yet (a scan of their seq words)."""
        words, stride, n, first = self.words, self.stride, self.num_slots, self._ready - 1
        count = 0
        while count < n and words[(first + count) % n * stride] == first + count + 1:
            count += 1
        return count

    def try_peek(self):
        """The next record (a private copy, as a named tuple) if one is published, without
        handing its slot back: the producer may reuse the record's payload only after
        ``release``.  Never blocks."""
        values = self.try_peek_values()
        return None if values is None else self.make(values)

    def try_peek_values(self) -> tuple | None:
        """``try_peek`` as a plain tuple in field order (no named tuple built per record)."""
        at = self._at
        if self.words[at] != self._ready:
            return None
        if WEAK_MEMORY_ORDER:
            fence()  # the seq word before the record it publishes
        return self.packer.unpack_from(self.buf, at * 8)

    def release(self) -> None:
        """Hand the peeked slot (and with it the record's payload) back to the producer."""
        ready = self._ready  # position + 1
        if WEAK_MEMORY_ORDER:
            fence()  # our reads of the record and payload before the slot is handed back
        self.words[self._at] = ready - 1 + self.num_slots
        self._at = ready % self.num_slots * self.stride
        self._ready = ready + 1

    def try_get(self):
        """Take one record (a private copy, as a named tuple) if one is published; never blocks."""
        record = self.try_peek()
        if record is not None:
            self.release()
        return record

    def try_get_values(self) -> tuple | None:
        """``try_get`` as a plain tuple in field order (for a caller that builds its own
        object from it: no named tuple in between)."""
        if self.words[self._at] != self._ready:
            return None
        return self.get_values(0.0)

    def get_values(self, deadline: float) -> tuple | None:
        """``try_get_values``, waiting for a record until ``deadline`` (see ``wait``); None
        after it."""
        at, ready = self._at, self._ready
        words = self.words
        if words[at] != ready and not self.wait(deadline):
            return None
        if WEAK_MEMORY_ORDER:
            fence()  # the seq word before the record it publishes
        values = self.packer.unpack_from(self.buf, at * 8)
        if WEAK_MEMORY_ORDER:
            fence()  # our read of the record before the slot is handed back
        words[at] = ready - 1 + self.num_slots  # release(), inlined
        self._at = ready % self.num_slots * self.stride
        self._ready = ready + 1
        return values

    def wait(self, deadline: float) -> bool:
        """Until a record is published (True) or ``deadline`` (False): spin on the seq word
        for the doorbell's spin time, then sleep on the doorbell."""
        words, at, ready = self.words, self._at, self._ready
        if words[at] == ready:
            return True
        monotonic = time.monotonic
        spin_end = min(deadline, monotonic() + self.doorbell.spin_s)
        while words[at] != ready:
            if monotonic() >= spin_end:
                return sleep_until(self.is_ready, self.doorbell, deadline)
        return True

    def get(self, timeout_s: float):
        record = self.try_get()
        if record is not None:
            return record
        deadline = time.monotonic() + timeout_s
        while (record := self.try_get()) is None:
            if not self.wait(deadline):
                raise RingEmptyError(f"nothing arrived within {timeout_s:.3f}s")
        return record


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
        raw = self.header.view(np.uint8)

        def word(name: str) -> memoryview:  # one u4 field of the header, read without numpy
            at = RING_HEADER.fields[name][1]
            return memoryview(raw[at:at + 4]).cast("I")
        self.client_sleeping = word("client_sleeping")
        self.revoked = word("revoked")
        self.client_closed = word("client_closed")
