"""One attached client as the engine sees it (``engine/clients/client.py``): its answers
published in order, queued behind a full completion ring and flushed in that order; held back
once too many are queued; complete once every layer 0..n-1 is registered."""

from __future__ import annotations

import numpy as np

from engine.clients import client as client_module
from engine.clients.client import ClientState
from engine.copy.base import LayerPlacement
from pegaflow.platform.ring import RingConsumer, RingProducer, RingSegmentView, reset_slots
from pegaflow.platform.wire import COMPLETION, SUBMISSION, Opcode, Status

NUM_SLOTS = 4


class _Memory:
    """A ring segment in process memory (what a client maps from /dev/shm)."""

    def __init__(self, size: int):
        self.buf, self.name = np.zeros(size, np.uint8), "mem"

    def array(self, dtype, count, offset=0):
        return np.frombuffer(self.buf, dtype, count, offset)


def _client() -> tuple[ClientState, RingConsumer]:
    """A client whose completion ring holds NUM_SLOTS answers, and the reader of that ring."""
    view = RingSegmentView(_Memory(64 + NUM_SLOTS * (SUBMISSION.itemsize + COMPLETION.itemsize) + 4096),
                           NUM_SLOTS, 4096)
    reset_slots(view.submissions)
    reset_slots(view.completions)
    state = ClientState(0, view, RingConsumer(view.submissions), RingProducer(view.completions))
    return state, RingConsumer(view.completions)


def _read_ids(reader: RingConsumer) -> list[int]:
    ids = []
    while (record := reader.try_get_values()) is not None:
        ids.append(int(record[1]))  # (seq, command_id, ...)
    return ids


def test_client_answers_past_a_full_ring_are_queued_and_flushed_in_order():
    state, reader = _client()
    # 1. Six answers into a ring of four: four published, two queued, in order.
    for command_id in range(1, 7):
        state.answer(command_id, Opcode.PING, Status.OK)
    assert len(state.backlog) == 2
    # 2. Nothing flushes while the ring is still full.
    assert state.flush() is False and len(state.backlog) == 2
    # 3. The client reads two: the queue goes out behind them, in order.
    assert _read_ids(reader) == [1, 2, 3, 4]
    assert state.flush() is True and not state.backlog
    assert _read_ids(reader) == [5, 6]


def test_client_answer_behind_a_queue_waits_its_turn_even_with_room():
    state, reader = _client()
    for command_id in range(1, 6):  # one queued
        state.answer(command_id, Opcode.PING, Status.OK)
    assert _read_ids(reader) == [1, 2, 3, 4]  # room again, the queue not flushed yet
    # A new answer now goes behind the queued one, never ahead of it.
    state.answer(6, Opcode.PING, Status.OK)
    assert state.flush() is True
    assert _read_ids(reader) == [5, 6]


def test_client_is_held_back_once_its_unread_answers_reach_the_bound(monkeypatch):
    monkeypatch.setattr(client_module, "MAX_UNREAD_ANSWERS", 3)
    state, _ = _client()
    for command_id in range(NUM_SLOTS + 2):
        state.answer(command_id, Opcode.PING, Status.OK)
    assert len(state.backlog) == 2 and not state.is_held_back
    state.answer(99, Opcode.PING, Status.OK)
    assert state.is_held_back


def test_client_is_complete_only_with_every_layer_from_zero():
    state, _ = _client()
    assert not state.is_complete()  # no layer yet
    state.layers = {1: LayerPlacement(0, 0, 0, 4096)}
    assert not state.is_complete()  # layer 0 missing
    state.layers[0] = LayerPlacement(0, 0, 0, 4096)
    state.page_bytes = 4096
    assert state.is_complete() and state.entry_bytes == 2 * 4096
