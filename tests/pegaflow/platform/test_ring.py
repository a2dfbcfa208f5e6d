"""pegaflow/platform/ring.py: SPSC rings, alone and with the payload arena and the doorbell, as a
client and the engine use them (the arena's own tests: test_arena.py; the doorbell's: test_waits.py).

Scenarios run single-threaded against a model, across threads, and across processes
over posix shared memory; hypothesis picks ring sizes, burst/pause patterns and
payload sizes.  Every record a producer writes has all its fields derived from its
``command_id``, so a consumer can tell a torn or misplaced record from a good one.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from pegaflow.platform import shm
from pegaflow.platform.arena import PayloadArena
from pegaflow.platform.errors import RingEmptyError, RingFullError
from pegaflow.platform.ring import RingConsumer, RingProducer, reset_slots
from pegaflow.platform.waits import Doorbell
from pegaflow.platform.wire import SUBMISSION
from tests.pegaflow.platform.ring_records import (
    MASK16,
    MASK32,
    MASK64,
    WAIT_S,
    doorbell_semaphore,
    fields_of,
    is_consistent,
    new_ring,
    new_slots,
    pattern,
    record_for,
)
from tests.spawn import start_child, stop_child

FLAG_BYTES = 64  # a shared segment starts with the consumer's sleeping flag, then the slots
ROLE_WAIT_S = 20.0  # a traffic role's every wait (a lost wake-up waits for it and fails)
_names = itertools.count()


# -- one thread, against a model ------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(num_slots=st.integers(2, 8), ops=st.lists(st.booleans(), max_size=200))
def test_ring_try_put_try_get_match_a_bounded_fifo(num_slots, ops):
    producer, consumer = new_ring(num_slots)
    model: deque[int] = deque()
    next_k = 0
    for is_put in ops:
        if is_put:
            # 1. A put succeeds exactly when the model has room (full and empty differ).
            assert producer.try_put_fields(fields_of(record_for(next_k))) == (len(model) < num_slots)
            if len(model) < num_slots:
                model.append(next_k)
                next_k += 1
        else:
            # 2. A get returns the oldest record, intact, or None exactly when empty.
            record = consumer.try_get()
            if not model:
                assert record is None
            else:
                assert record is not None and record["command_id"] == model.popleft()
                assert is_consistent(record)
        # 3. is_ready tells the truth, and positions never wrap (they count records).
        assert consumer.is_ready() == bool(model)
        assert producer.position - consumer.position == len(model)


def test_ring_record_round_trips_through_numpy_fields():
    producer, consumer = new_ring(2)
    # 1. Publish a record with every field near its type's limit.
    big = (0, MASK64, MASK16, MASK16 - 1, MASK16 - 2, MASK16 - 3, MASK32, MASK32 - 1,
           MASK64 - 1, MASK64 - 2, MASK32 - 2, MASK32 - 3, MASK64 - 3)
    assert producer.try_put_fields(fields_of(big))
    # 2. numpy reads each field at its wire offset with the value written.
    row = producer.slots[0]
    for name, value in zip(SUBMISSION.names[1:], big[1:]):
        assert int(row[name]) == value, name
    # 3. The consumer gets the same values by name.
    record = consumer.try_get()
    assert tuple(record)[1:] == big[1:]


def test_ring_taken_record_is_a_private_copy():
    producer, consumer = new_ring(2)
    # 1. Take record 0; then the producer reuses its slot twice over (two more laps).
    assert producer.try_put_fields(fields_of(record_for(0)))
    first = consumer.try_get()
    for k in (1, 2, 3):
        assert producer.try_put_fields(fields_of(record_for(k)))
        assert consumer.try_get()["command_id"] == k
    # 2. The record taken first is unchanged.
    assert first["command_id"] == 0 and is_consistent(first)


# -- torn slots -----------------------------------------------------------------------------


def test_ring_fields_written_without_seq_are_invisible():
    slots = new_slots(4)
    consumer = RingConsumer(slots)
    # 1. Write every field of slot 0 except seq, as a producer preempted before publishing.
    values = record_for(5)
    for name, value in zip(SUBMISSION.names[1:], values[1:]):
        slots[name][0] = value
    # 2. The consumer sees nothing.
    assert not consumer.is_ready() and consumer.try_get() is None
    # 3. Publishing seq (position 0 -> 1) makes the whole record visible at once.
    slots["seq"][0] = 1
    record = consumer.try_get()
    assert record["command_id"] == 5 and is_consistent(record)


def test_ring_stale_seq_from_an_earlier_lap_is_invisible():
    producer, consumer = new_ring(2)
    # 1. Two laps around a 2-slot ring.
    for k in range(4):
        assert producer.try_put_fields(fields_of(record_for(k)))
        assert consumer.try_get()["command_id"] == k
    # 2. A slot whose seq says "published" for an old lap is not a new record.
    producer.slots["seq"][0] = 1  # what position 0 looked like, long ago
    assert consumer.try_get() is None


class _PreemptedPacker:
    """Writes a record in two halves and lets ``between`` run in the middle."""

    def __init__(self, packer, between):
        self.packer = packer
        self.between = between
        self.size = packer.size

    def pack_into(self, buf, offset, *values):
        full = bytearray(self.packer.size)
        self.packer.pack_into(full, 0, *values)
        half = self.packer.size // 2
        buf[offset:offset + half] = full[:half]
        self.between()
        buf[offset + half:offset + self.packer.size] = full[half:]

    def __getattr__(self, name):
        return getattr(self.packer, name)


def test_ring_consumer_never_sees_a_half_written_record():
    producer, consumer = new_ring(4)
    seen_mid_write = []
    # 1. The producer is "preempted" halfway through writing each record's bytes.
    producer.packer = _PreemptedPacker(producer.packer, lambda: seen_mid_write.append(consumer.try_get()))
    for k in range(10):
        assert producer.try_put_fields(fields_of(record_for(k)))
        # 2. After the put, the record is complete.
        record = consumer.try_get()
        assert record["command_id"] == k and is_consistent(record)
    # 3. While half written, it was never visible.
    assert seen_mid_write == [None] * 10


# -- deadlines ------------------------------------------------------------------------------


def test_ring_put_on_full_ring_raises_ring_full_after_deadline():
    producer, consumer = new_ring(4)
    for k in range(4):
        producer.put_fields(fields_of(record_for(k)), 1.0)
    # 1. A fifth put waits for its deadline and then raises.
    start = time.monotonic()
    with pytest.raises(RingFullError):
        producer.put_fields(fields_of(record_for(4)), 0.05)
    assert time.monotonic() - start >= 0.05  # it waited for its deadline (and then gave up)
    # 2. Nothing was overwritten: the four records come out in order, then nothing.
    assert [consumer.try_get()["command_id"] for _ in range(4)] == [0, 1, 2, 3]
    assert consumer.try_get() is None


@pytest.mark.parametrize("with_semaphore", [False, True], ids=["nap", "semaphore"])
def test_ring_get_on_empty_ring_raises_ring_empty_after_deadline(with_semaphore):
    with doorbell_semaphore() as (sem, flag):
        bell = Doorbell(sem, flag) if with_semaphore else None
        consumer = RingConsumer(new_slots(4), bell)
        start = time.monotonic()
        with pytest.raises(RingEmptyError):
            consumer.get(0.05)
        assert time.monotonic() - start >= 0.05  # it waited for its deadline (and then gave up)


def test_ring_blocked_put_completes_when_consumer_makes_room():
    producer, consumer = new_ring(2)
    producer.put_fields(fields_of(record_for(0)), 1.0)
    producer.put_fields(fields_of(record_for(1)), 1.0)
    # 1. A consumer thread takes one record after 50 ms.
    taker = threading.Timer(0.05, consumer.try_get)
    taker.start()
    # 2. The producer, blocked on the full ring, gets through (a put that found no room
    #    by its deadline would raise RingFullError).
    producer.put_fields(fields_of(record_for(2)), WAIT_S)
    taker.join()


# -- across threads and processes -----------------------------------------------------------


@dataclass(frozen=True)
class Traffic:
    """One side's part of a cross-thread or cross-process run."""

    num_slots: int
    arena_bytes: int
    count: int
    max_payload: int  # payload bytes of record k cycle through 0..max_payload
    pause_every: int
    pause_s: float


def payload_bytes_of(k: int, max_payload: int) -> int:
    return (k * 7919) % (max_payload + 1) if max_payload else 0


def produce(producer: RingProducer, payloads: PayloadArena, t: Traffic) -> int:
    for k in range(t.count):
        num_bytes, offset = payload_bytes_of(k, t.max_payload), 0
        if num_bytes:
            offset = payloads.alloc(num_bytes, ROLE_WAIT_S)
            payloads.write(offset, [pattern(k, num_bytes)])
        rec = list(record_for(k, time.monotonic_ns()))
        rec[9], rec[10] = offset, num_bytes  # payload_offset, payload_bytes
        position = producer.position
        producer.put_fields(fields_of(tuple(rec)), ROLE_WAIT_S)
        payloads.mark_sent(position)
        if t.pause_every and k % t.pause_every == t.pause_every - 1:
            time.sleep(t.pause_s)
    return t.count


def peek(consumer: RingConsumer, timeout_s: float):
    """The next record without handing its slot back, waiting up to ``timeout_s``; a wait
    that ends at its deadline (a wake-up lost: the record was there, no doorbell said so)
    raises as nothing arriving does."""
    deadline = time.monotonic() + timeout_s
    while (record := consumer.try_peek()) is None:
        if not consumer.wait(deadline) or time.monotonic() >= deadline:
            raise RingEmptyError(f"nothing arrived, or no wake-up said so, within {timeout_s}s")
    return record


def consume(consumer: RingConsumer, arena: np.ndarray, t: Traffic) -> dict:
    """Peek each record, check it and its payload, then release it (as the engine does)."""
    bad = []
    for k in range(t.count):
        record = peek(consumer, ROLE_WAIT_S)
        offset, num_bytes = record["payload_offset"], record["payload_bytes"]
        is_payload_ok = (num_bytes == payload_bytes_of(k, t.max_payload) and
                         (arena[offset:offset + num_bytes] == pattern(k, num_bytes)).all())
        consumer.release()
        if record["command_id"] != k or not is_consistent(record) or not is_payload_ok:
            bad.append((k, tuple(record)))
        if t.pause_every and k % t.pause_every == t.pause_every - 1:
            time.sleep(t.pause_s)
    return {"num_bad": len(bad), "bad": bad[:5]}


def segment_bytes(t: Traffic) -> int:
    return FLAG_BYTES + t.num_slots * SUBMISSION.itemsize + t.arena_bytes


@contextmanager
def shared_ring(t: Traffic):
    """A ring in a posix segment (flag word, slots, arena) with its doorbell semaphore."""
    base = f"t{os.getpid()}_ring{next(_names)}"
    seg_name, sem_name = shm.ipc_name(base, "ring"), shm.ipc_name(base, "bell")
    segment = shm.create_segment(seg_name, segment_bytes(t))
    sem = shm.create_semaphore(sem_name)
    try:
        reset_slots(segment.array(SUBMISSION, t.num_slots, FLAG_BYTES))
        yield seg_name, sem_name
    finally:
        sem.close()
        shm.unlink_semaphore(sem_name)
        segment.close()
        segment.unlink()


def run_role(seg_name: str, sem_name: str, role: str, t: Traffic):
    """Attach to a ``shared_ring`` in this thread or process and play ``role`` on it."""
    segment = shm.attach_segment(seg_name)
    slots = segment.array(SUBMISSION, t.num_slots, FLAG_BYTES)
    arena = segment.array(np.uint8, t.arena_bytes, FLAG_BYTES + t.num_slots * SUBMISSION.itemsize)
    bell = Doorbell(shm.attach_semaphore(sem_name), memoryview(segment.array(np.uint8, 4, 0)).cast("I"))
    try:
        if role == "produce":
            producer = RingProducer(slots, bell)
            return produce(producer, PayloadArena(arena, producer), t)
        return consume(RingConsumer(slots, bell), arena, t)
    finally:
        bell.sem.close()
        segment.close()  # views still alive keep the mapping until they are collected


def ring_worker(conn) -> None:
    """A long-lived child process: plays one side of a ring per request."""
    while (job := conn.recv()) is not None:
        try:
            conn.send(("ok", run_role(*job)))
        except Exception as exc:  # report it to the test instead of dying silently
            conn.send(("error", repr(exc)))


@pytest.fixture(scope="module")
def worker():
    parent, proc = start_child(ring_worker)
    yield parent
    stop_child(parent, proc, 10)


@st.composite
def traffic(draw) -> tuple[Traffic, Traffic]:
    """(producer side, consumer side): same ring, each with its own pauses."""
    arena_bytes = draw(st.sampled_from([1024, 4096]))
    shared = dict(num_slots=draw(st.integers(2, 16)), arena_bytes=arena_bytes,
                  count=draw(st.integers(1, 600)),
                  # at most half the arena: bigger payloads meet the empty-arena refusal
                  # that test_arena_empty_arena_accepts_any_payload_that_fits pins down
                  max_payload=draw(st.sampled_from([0, 64, arena_bytes // 2])),
                  pause_s=draw(st.sampled_from([2e-4, 2e-3])))
    return (Traffic(pause_every=draw(st.sampled_from([0, 7, 50])), **shared),
            Traffic(pause_every=draw(st.sampled_from([0, 5, 40])), **shared))


def check_consumed(result: dict) -> None:
    # Every record arrived once, in order, intact with its payload (and none waited for a
    # lost wake-up: ``peek`` raises at the deadline such a one waits for).
    assert result["num_bad"] == 0, result["bad"]


# No shrinking for the cross-thread and cross-process runs: a failing example can wait out a
# 20 s deadline, and shrinking would replay that for minutes; the first failure is reported.
NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)


@settings(max_examples=12, deadline=None, phases=NO_SHRINK)
@given(sides=traffic())
def test_ring_threads_deliver_every_record_and_payload_in_order(sides):
    producer_side, consumer_side = sides
    with shared_ring(producer_side) as (seg_name, sem_name):
        # 1. A producer thread with its own pauses (the ring runs empty)...
        producer = threading.Thread(target=run_role, args=(seg_name, sem_name, "produce", producer_side))
        producer.start()
        try:
            # 2. ...and a consumer here with its own pauses (the ring and arena run full).
            result = run_role(seg_name, sem_name, "consume", consumer_side)
        finally:
            producer.join(10)
        assert not producer.is_alive()
        check_consumed(result)


@settings(max_examples=8, deadline=None, phases=NO_SHRINK)
@given(sides=traffic(), worker_role=st.sampled_from(["produce", "consume"]))
def test_ring_processes_deliver_every_record_and_payload_in_order(worker, sides, worker_role):
    producer_side, consumer_side = sides
    with shared_ring(producer_side) as (seg_name, sem_name):
        # 1. The other process plays one side of the ring, this one the other side.
        my_role = "consume" if worker_role == "produce" else "produce"
        sides = {"produce": producer_side, "consume": consumer_side}
        worker.send((seg_name, sem_name, worker_role, sides[worker_role]))
        try:
            mine = run_role(seg_name, sem_name, my_role, sides[my_role])
        finally:  # always collect the worker's answer, so the next example starts in step
            assert worker.poll(30), "the worker process did not finish"
            status, theirs = worker.recv()
        assert status == "ok", theirs
        # 2. Whoever consumed saw every record once, in order, intact, with its payload.
        check_consumed(mine if worker_role == "produce" else theirs)


def test_ring_with_weak_memory_order_fences_still_delivers_in_order(monkeypatch):
    # The aarch64 path (fences around every seq word), run here: across two threads every
    # record arrives once, in order, intact, through try_get and get_values alike.
    import pegaflow.platform.ring as ring
    monkeypatch.setattr(ring, "WEAK_MEMORY_ORDER", True)
    producer, consumer = new_ring(4)
    count = 2000

    def produce():
        for k in range(count):
            producer.put_fields(fields_of(record_for(k)), timeout_s=10.0)

    thread = threading.Thread(target=produce)
    thread.start()
    got = []
    deadline = time.monotonic() + 10.0
    while len(got) < count and time.monotonic() < deadline:
        if len(got) % 2:
            record = consumer.try_get()
            if record is not None:
                assert is_consistent(record)
                got.append(record["command_id"])
        else:
            values = consumer.get_values(time.monotonic() + 1.0)
            if values is not None:
                assert is_consistent(consumer.make(values))
                got.append(values[1])
    thread.join(10.0)
    assert got == list(range(count))
