"""pegaflow/platform/arena.py: payloads beside a ring's records stay intact and never overlap,
wrap and are reclaimed in order, aligned; a full arena waits to its deadline, one too large
for it is refused at once."""

from __future__ import annotations

import time
from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pegaflow.platform.arena import ARENA_ALIGN, PayloadArena
from pegaflow.platform.errors import PayloadTooLargeError, RingFullError
from tests.pegaflow.platform.ring_records import fields_of, new_ring, pattern, record_for


class ArenaPair:
    """A producer with its arena, and a consumer that reads each payload on dequeue."""

    def __init__(self, arena_bytes: int, num_slots: int):
        self.arena = np.zeros(arena_bytes, dtype=np.uint8)
        self.producer, self.consumer = new_ring(num_slots)
        self.payloads = PayloadArena(self.arena, self.producer)
        self.next_tag = 0

    def try_send(self, num_bytes: int) -> int | None:
        """Allocate, fill and publish a payload; its offset, or None if the arena is full."""
        offset = self.payloads.try_alloc(num_bytes)
        if offset is None:
            return None
        tag = self.next_tag
        self.next_tag += 1
        self.payloads.write(offset, [pattern(tag, num_bytes)])
        position = self.producer.position
        rec = list(record_for(tag))
        rec[9], rec[10] = offset, num_bytes  # payload_offset, payload_bytes
        assert self.producer.try_put_fields(fields_of(tuple(rec)))
        self.payloads.mark_sent(position)
        return offset

    def receive(self) -> tuple[int, int, bool]:
        """(offset, bytes, intact) of the next record's payload."""
        record = self.consumer.try_get()
        offset, num_bytes = record["payload_offset"], record["payload_bytes"]
        payload = self.arena[offset:offset + num_bytes]
        return offset, num_bytes, bool((payload == pattern(record["command_id"], num_bytes)).all())


@st.composite
def arena_ops(draw):
    arena_bytes = draw(st.sampled_from([256, 1024, 4096]))
    sizes = st.integers(1, arena_bytes).map(lambda n: ("send", n))
    ops = draw(st.lists(st.one_of(sizes, st.just(("recv", 0))), max_size=120))
    return arena_bytes, draw(st.integers(2, 8)), ops


@settings(max_examples=150, deadline=None)
@given(case=arena_ops())
def test_arena_payloads_stay_intact_and_never_overlap(case):
    arena_bytes, num_slots, ops = case
    pair = ArenaPair(arena_bytes, num_slots)
    live: deque[tuple[int, int]] = deque()  # (offset, bytes) sent and not yet received
    for kind, num_bytes in ops:
        if kind == "recv":
            if live:
                # 1. Each payload comes back intact, in order.
                offset, got_bytes, is_intact = pair.receive()
                assert (offset, got_bytes) == live.popleft() and is_intact
            continue
        if len(live) == num_slots:
            continue  # the ring itself is full; covered by the FIFO test
        offset = pair.try_send(num_bytes)
        if offset is None:
            # 2. Refusing is only allowed while something is still outstanding.
            assert live, f"an empty {arena_bytes}-byte arena refused {num_bytes} bytes"
            continue
        # 3. A new payload lies inside the arena and overlaps no outstanding one.
        assert 0 <= offset and offset + num_bytes <= arena_bytes
        assert all(offset + num_bytes <= o or o + n <= offset for o, n in live)
        live.append((offset, num_bytes))


def test_arena_empty_arena_accepts_any_payload_that_fits():
    pair = ArenaPair(4096, 4)
    # 1. Send and receive 2048 bytes: the arena is empty again, its head mid-way.
    assert pair.try_send(2048) == 0
    assert pair.receive()[2]
    # 2. 2112 bytes fit an empty 4096-byte arena (at offset 0), so they must be accepted.
    assert pair.try_send(2112) is not None


def test_arena_wraps_around_and_reclaims_in_order():
    pair = ArenaPair(1024, 8)
    # 1. Three 320-byte payloads (aligned to 64): 960 bytes in use, 64 left at the end.
    assert [pair.try_send(320) for _ in range(3)] == [0, 320, 640]
    # 2. 320 more bytes do not fit until the first payload is taken...
    assert pair.try_send(320) is None
    assert pair.receive() == (0, 320, True)
    # 3. ...and then they wrap to the start, into exactly the bytes given back.
    assert pair.try_send(320) == 0
    # 4. 640 bytes do not fit until the second one is taken too.
    assert pair.try_send(640) is None
    assert pair.receive() == (320, 320, True)
    assert pair.try_send(320) == 320
    # 5. Every payload still outstanding reads back intact.
    assert [pair.receive()[2] for _ in range(3)] == [True, True, True]


def test_arena_allocations_are_aligned():
    pair = ArenaPair(4096, 8)
    offsets = [pair.try_send(n) for n in (1, 63, 64, 65, 200)]
    assert all(o % ARENA_ALIGN == 0 for o in offsets)
    assert offsets == [0, 64, 128, 192, 320]


def test_arena_alloc_on_full_arena_raises_ring_full_after_deadline():
    pair = ArenaPair(1024, 4)
    assert pair.try_send(1024) == 0
    start = time.monotonic()
    with pytest.raises(RingFullError):
        pair.payloads.alloc(64, 0.05)
    assert time.monotonic() - start >= 0.05  # it waited for its deadline (and then gave up)


def test_arena_payload_larger_than_arena_raises_payload_too_large_at_once():
    pair = ArenaPair(1024, 4)
    # 1. 1025 bytes can never fit a 1024-byte arena: refused at once, not at the deadline
    #    (an hour: a wait for it would never end within the test).
    with pytest.raises(PayloadTooLargeError):
        pair.payloads.alloc(1025, 3600.0)
    # 2. Exactly the arena's size is fine.
    assert pair.try_send(1024) == 0


def test_arena_peeked_record_keeps_its_payload_until_release():
    pair = ArenaPair(1024, 4)
    assert pair.try_send(1024) == 0
    # 1. Peeking shows the record (twice: the same one) but hands nothing back.
    first, again = pair.consumer.try_peek(), pair.consumer.try_peek()
    assert first == again and first["payload_bytes"] == 1024
    assert not pair.producer.is_consumed(0)
    assert pair.payloads.try_alloc(64) is None
    # 2. Release hands back the slot and, with it, the payload's bytes.
    pair.consumer.release()
    assert pair.producer.is_consumed(0) and pair.consumer.try_peek() is None
    assert pair.payloads.try_alloc(1024) == 0
