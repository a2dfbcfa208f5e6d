"""LOOKUPs that wait for blocks another client is still saving (``engine/commands/lookup_waits.py``).

A "producer" client saves blocks layer by layer (its later layers are the saves still in
flight); a "consumer" client looks the prefix up meanwhile, as a decode vLLM does right
after its prefill vLLM answered.  The engine must answer with the whole prefix once the
saves land, and with the READY part only once the wait's deadline has passed.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from engine.blocks.entries import Entry
from engine.commands.lookup_waits import ABANDONED_WRITE_S, WaitingLookup, WaitingLookups, unread_marks, writing_stop
from pegaflow.platform.ring import RingConsumer, RingProducer, reset_slots
from pegaflow.platform.wire import SUBMISSION, Opcode

NAMESPACE = 0x5A7E
NUM_LAYERS = 4
WAIT_DEADLINE_S = 60.0  # how long a test waits for an answer it is owed (generous)


def _submit_lookup_read(kv, hashes, wait_ms=None) -> int:
    """Submit a LOOKUP and return its request id once the engine has read it off the ring
    (it answered it then, or parked it)."""
    position = kv.client._producer.position
    request_id = kv.client.submit_lookup(NAMESPACE, hashes, wait_ms=wait_ms)
    deadline = time.monotonic() + WAIT_DEADLINE_S
    while not kv.client._producer.is_consumed(position):
        assert time.monotonic() < deadline, "the engine never read the LOOKUP"
        time.sleep(1e-3)
    return request_id


def _save_layers(kv, block_ids, hashes, layers) -> None:
    for layer in layers:
        assert kv.save(NAMESPACE, block_ids, hashes, layer=layer).is_ok


def _blocks_being_written(engine_factory, kv_client, rng, make_hashes, wait_ms: int, num_ready: int,
                          num_writing: int):
    """An engine waiting ``wait_ms`` (--lookup-wait-ms), a producer that stored ``num_ready``
    blocks whole and only layer 0 of the next ``num_writing`` (their other layers: saves still
    in flight), and a consumer.  Returns (engine, producer, consumer, hashes, pages filled)."""
    engine = engine_factory(extra=("--lookup-wait-ms", str(wait_ms)))
    producer, consumer = kv_client(engine), kv_client(engine)
    num_blocks = num_ready + num_writing
    hashes = make_hashes(num_blocks)
    expected = producer.fill(rng, range(num_blocks))
    _save_layers(producer, range(num_ready), hashes[:num_ready], range(NUM_LAYERS))
    _save_layers(producer, range(num_ready, num_blocks), hashes[num_ready:], [0])
    return engine, producer, consumer, hashes, expected


def test_waiting_lookup_sent_while_saves_in_flight_is_answered_with_whole_prefix(
        engine_factory, kv_client, rng, make_hashes):
    # 1. The producer stores the first two blocks whole, and only layer 0 of the other four:
    #    their other layers are the saves still in flight.
    engine, producer, consumer, hashes, expected = _blocks_being_written(
        engine_factory, kv_client, rng, make_hashes, wait_ms=10_000, num_ready=2, num_writing=4)
    # 2. The consumer looks the whole prefix up; the engine has read the LOOKUP (a
    #    LOOKUP answered at once would say 2 here).
    request_id = _submit_lookup_read(consumer, hashes)
    # 3. The rest of the layers land; the LOOKUP is answered with all six blocks.
    _save_layers(producer, range(2, 6), hashes[2:], range(1, NUM_LAYERS))
    found = consumer.client.wait(request_id, WAIT_DEADLINE_S)
    assert found.is_ok and found.result.num_hit_blocks == 6
    # 4. Its lease serves every byte the producer saved.
    consumer.pages[:, 10:16] = 0
    assert consumer.load(NAMESPACE, range(10, 16), hashes, lease_id=found.result.lease_id).is_ok
    np.testing.assert_array_equal(consumer.pages[:, 10:16], expected)
    stats = engine.wait_stats(lambda s: s["lookup_waits"] == 1)
    assert stats["lookup_wait_blocks"] == 4 and stats["lookup_wait_timeouts"] == 0


def test_waiting_lookup_past_its_deadline_is_answered_with_ready_part(engine_factory, kv_client,
                                                                      rng, make_hashes):
    # 1. Three blocks READY, two with layer 0 only: their other layers never come.
    engine, producer, consumer, hashes, _ = _blocks_being_written(
        engine_factory, kv_client, rng, make_hashes, wait_ms=30, num_ready=3, num_writing=2)
    # 2. The LOOKUP waits up to the engine's --lookup-wait-ms, then gets the READY part.
    found = consumer.client.wait(_submit_lookup_read(consumer, hashes), WAIT_DEADLINE_S)
    assert found.is_ok and found.result.num_hit_blocks == 3
    stats = engine.wait_stats(lambda s: s["lookup_wait_timeouts"] == 1)
    assert stats["lookup_waits"] == 1 and stats["lookup_wait_blocks"] == 0
    assert stats["lookup_wait_ns"] >= 30e6  # it did wait (a lower bound, never an upper one)
    # 3. A LOOKUP that asks for its own wait (the connector's save_wait_ms) gets it: a
    #    longer one sees the blocks land.
    request_id = _submit_lookup_read(consumer, hashes, wait_ms=10_000)
    _save_layers(producer, range(3, 5), hashes[3:], range(1, NUM_LAYERS))
    assert consumer.client.wait(request_id, WAIT_DEADLINE_S).result.num_hit_blocks == 5


def test_waiting_lookup_with_wait_off_is_answered_at_once(engine_factory, kv_client, rng, make_hashes):
    engine, _, consumer, hashes, _ = _blocks_being_written(
        engine_factory, kv_client, rng, make_hashes, wait_ms=0, num_ready=0, num_writing=2)
    # With the wait off, a block being written is a miss: the READY prefix (none) at once.
    assert consumer.client.lookup(NAMESPACE, hashes, timeout_s=WAIT_DEADLINE_S).num_hit_blocks == 0
    assert engine.fresh_stats()["lookup_waits"] == 0


def test_waiting_lookup_of_detaching_client_lets_it_go(engine_factory, kv_client, rng, make_hashes):
    engine, producer, consumer, hashes, _ = _blocks_being_written(
        engine_factory, kv_client, rng, make_hashes, wait_ms=10_000, num_ready=0, num_writing=2)
    _submit_lookup_read(consumer, hashes)
    # A client that goes away while its LOOKUP waits is let go (its DETACH answered, no
    # hang: an unanswered DETACH raises here), and its slot freed.
    consumer.client.call(Opcode.DETACH, timeout_s=WAIT_DEADLINE_S)
    consumer.client.close(detach=False)
    engine.wait_stats(lambda s: s["clients_attached"] == 1)
    # The producer's blocks still land and are found.
    _save_layers(producer, range(2), hashes, range(1, NUM_LAYERS))
    assert producer.num_hits(NAMESPACE, hashes) == 2


# -- the parts, without a process ----------------------------------------------------------


class _Index:
    def __init__(self):
        self.entries, self.writing = {}, {}

    def add(self, key, is_ready: bool) -> Entry:
        entry = Entry(0, 16, 0b1111, owner_slot=1, started_at=time.monotonic(),
                      done_mask=0b1111 if is_ready else 0b0001)
        self.entries[key] = entry
        if not is_ready:
            self.writing[key] = entry
        return entry


class _Client:
    def __init__(self, ring: RingConsumer | None = None):
        self.is_attached, self.num_inflight, self.submissions = True, 0, ring


def _ring(num_slots: int = 8) -> tuple[RingProducer, RingConsumer]:
    slots = np.zeros(num_slots, dtype=SUBMISSION)
    reset_slots(slots)
    return RingProducer(slots), RingConsumer(slots)


def test_writing_stop_tells_where_and_why_a_prefix_stops():
    index = _Index()
    keys = [(1, bytes([i])) for i in range(4)]
    now = time.monotonic()
    index.add(keys[0], True)
    assert writing_stop(index, keys, now) == (1, "absent")
    entry = index.add(keys[1], False)
    assert writing_stop(index, keys, now) == (1, "writing")
    # Begun long ago with no copy filling it: abandoned (its other layers never came), not
    # waited for; while a copy fills it, it is waited for however old.
    assert writing_stop(index, keys, now + 2 * ABANDONED_WRITE_S) == (1, "other")
    entry.pending_mask = 0b0010
    assert writing_stop(index, keys, now + 2 * ABANDONED_WRITE_S) == (1, "writing")
    entry.is_doomed = True  # dropped while written: it never becomes READY
    assert writing_stop(index, keys, now) == (1, "other")
    assert writing_stop(index, keys[:1], now) == (1, "end")


def test_waiting_lookup_catches_up_with_rings_read_after_it(rng):
    # 1. Another client published two commands the engine has not read yet (a SAVE of the
    #    prefix among them); the LOOKUP finds no entry for its next key.
    index, answered = _Index(), []
    producer, ring = _ring()
    for _ in range(2):
        assert producer.try_put_fields(tuple(np.zeros(1, SUBMISSION)[0].item())[1:])
    saver, asker = _Client(ring), _Client()
    keys = [(1, b"a"), (1, b"b")]
    marks = unread_marks([saver, asker], asker)
    assert [(c, end) for c, end in marks] == [(saver, 2)]
    waiting = WaitingLookups(index, answered.append)
    now = time.monotonic()
    waiting.park(WaitingLookup(asker, None, keys, now + 60, now, 0, marks))
    # 2. Not answered while the saver's commands are unread, even though nothing is written.
    assert waiting.resume(now) == 0 and asker.num_inflight == 1
    ring.try_get()
    assert waiting.resume(now) == 0
    # 3. The second command (the SAVE) is read: its blocks are being written, so it waits on.
    index.add(keys[0], False)
    ring.try_get()
    assert waiting.resume(now) == 0
    # 4. They land: answered.
    index.entries[keys[0]].done_mask = 0b1111
    del index.writing[keys[0]]
    assert waiting.resume(now) == 1 and answered and asker.num_inflight == 0


def test_ring_num_published_counts_unread_records():
    producer, consumer = _ring(4)
    record = tuple(np.zeros(1, SUBMISSION)[0].item())[1:]
    assert consumer.num_published() == 0
    for _ in range(4):
        assert producer.try_put_fields(record)
    assert consumer.num_published() == 4
    consumer.try_get()
    assert consumer.num_published() == 3
    assert producer.try_put_fields(record)  # wraps around
    assert consumer.num_published() == 4


@pytest.mark.parametrize("is_attached", [True, False])
def test_waiting_lookup_past_deadline_or_gone_is_answered(is_attached):
    index, answered = _Index(), []
    keys = [(1, b"a")]
    index.add(keys[0], False)
    waiting, asker = WaitingLookups(index, answered.append), _Client()
    now = time.monotonic()
    waiting.park(WaitingLookup(asker, None, keys, now + 60, now, 0))
    asker.is_attached = is_attached
    assert waiting.resume(now + (0 if not is_attached else 61)) == 1 and len(answered) == 1
