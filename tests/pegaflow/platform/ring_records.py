"""Records of the ring tests (test_ring.py, test_arena.py, test_waits.py): every field of a
record a function of its ``command_id``, so a consumer can tell a torn or misplaced one from a
good one; a payload's bytes a function of its tag."""

from __future__ import annotations

import itertools
import os
from contextlib import contextmanager

import numpy as np

from pegaflow.platform import shm
from pegaflow.platform.ring import RingConsumer, RingProducer, reset_slots
from pegaflow.platform.wire import SUBMISSION

MASK16, MASK32, MASK64 = 2**16 - 1, 2**32 - 1, 2**64 - 1
WAIT_S = 30.0  # how long a test waits on what should happen in milliseconds


def record_for(k: int, arg: int = 0) -> tuple:
    """A SUBMISSION tuple (field order) whose every field is a function of ``k``."""
    return (0, k, k & MASK16, (k >> 3) & MASK16, (k * 3) & MASK16, (k * 5) & MASK16,
            (k * 7) & MASK32, (k * 11) & MASK32, (k * 0x9E3779B97F4A7C15) & MASK64,
            ~k & MASK64, (k * 13) & MASK32, (k * 17) & MASK32, arg)


def fields_of(record) -> tuple:
    """A record (a tuple in field order, or a numpy record) as the producer takes it: its
    fields after ``seq``."""
    return (record.item() if isinstance(record, np.void) else tuple(record))[1:]


def is_consistent(record) -> bool:
    """Whether every field but seq, the payload's place (fields 9, 10) and arg matches its
    command id."""
    fields, expected = tuple(record), record_for(record["command_id"])
    return fields[1:9] + fields[11:12] == expected[1:9] + expected[11:12]


def new_slots(num_slots: int) -> np.ndarray:
    slots = np.zeros(num_slots, dtype=SUBMISSION)
    reset_slots(slots)
    return slots


def new_ring(num_slots: int) -> tuple[RingProducer, RingConsumer]:
    slots = new_slots(num_slots)
    return RingProducer(slots), RingConsumer(slots)


def pattern(tag: int, num_bytes: int) -> np.ndarray:
    return ((np.arange(num_bytes, dtype=np.int64) * 31 + tag) % 251).astype(np.uint8)


_bells = itertools.count()


@contextmanager
def doorbell_semaphore():
    """A fresh posix semaphore and a sleeping-flag word, removed afterwards."""
    name = shm.ipc_name(f"t{os.getpid()}_bell{next(_bells)}", "bell")
    sem = shm.create_semaphore(name)
    flag = memoryview(np.zeros(1, dtype=np.uint32).view(np.uint8)).cast("I")
    try:
        yield sem, flag
    finally:
        sem.close()
        shm.unlink_semaphore(name)
