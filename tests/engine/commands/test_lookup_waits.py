"""LOOKUPs that wait for blocks another client is still saving (``engine/commands/lookup_waits.py``).

A "producer" client saves blocks layer by layer (its later layers are the saves still in
flight); a "consumer" client looks the prefix up meanwhile, as a decode vLLM does right
after its prefill vLLM answered.  The engine must answer with the whole prefix once the
saves land, and with the READY part only once the wait's deadline has passed.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

from engine.blocks.entries import Entry
from engine.commands.lookup_waits import (
    ABANDONED_WRITE_S,
    Parked,
    WaitingLookup,
    WaitingLookups,
    unread_marks,
    writing_stop,
)
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


def test_waiting_lookup_past_the_per_client_bound_is_answered_wait_refused(engine_factory, kv_client, rng,
                                                                          make_hashes):
    # 1. Block 0 is whole, block 1 has layer 0 only; the consumer parks as many LOOKUPs of both
    #    as one client may (MAX_WAITING_PER_CLIENT).
    from engine.commands.lookup_waits import MAX_WAITING_PER_CLIENT
    from pegaflow.platform.wire import Status
    engine, producer, consumer, hashes, _ = _blocks_being_written(
        engine_factory, kv_client, rng, make_hashes, wait_ms=10_000, num_ready=1, num_writing=1)
    parked = [consumer.client.submit_lookup(NAMESPACE, hashes) for _ in range(MAX_WAITING_PER_CLIENT)]
    # 2. One more is answered at once, under its typed status: WAIT_REFUSED, with the READY
    #    prefix leased as an OK answer's, and counted.
    refused = consumer.client.wait(consumer.client.submit_lookup(NAMESPACE, hashes), WAIT_DEADLINE_S)
    assert refused.status is Status.WAIT_REFUSED and refused.is_ok
    assert refused.result.num_hit_blocks == 1 and refused.result.lease_id
    assert consumer.client.wait(consumer.client.release(refused.result.lease_id), WAIT_DEADLINE_S).status == Status.OK
    assert engine.wait_stats(lambda s: s["lookup_waits_refused"] == 1)["lookup_waits"] == 0
    # 3. The parked ones are answered OK with both blocks once the save lands.
    _save_layers(producer, [1], hashes[1:], range(1, NUM_LAYERS))
    answers = [consumer.client.wait(command_id, WAIT_DEADLINE_S) for command_id in parked]
    assert {(a.status, a.result.num_hit_blocks) for a in answers} == {(Status.OK, 2)}


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


def test_waiting_lookup_does_not_wait_for_a_client_that_reads_no_answers(engine_factory, kv_client, rng,
                                                                         make_hashes):
    # 1. A client sends PINGs and reads none of the answers: past its completion ring and the
    #    engine's cap of queued answers, the engine reads none of its commands.  Its last
    #    command, a SAVE of the namespace, stays unread for good.
    from engine.clients.client import MAX_UNREAD_ANSWERS
    engine = engine_factory(extra=("--ring-slots", "16", "--lookup-wait-ms", "10000"))
    stuck, consumer = kv_client(engine), kv_client(engine)
    for _ in range(16 + MAX_UNREAD_ANSWERS + 8):
        stuck.client.submit(Opcode.PING, timeout_s=WAIT_DEADLINE_S)
    stuck.client.submit_save(NAMESPACE, [0], make_hashes(1))
    # 2. Another client's LOOKUP that misses is answered at once, not after its 10 s wait:
    #    the SAVE it might have waited for will not be read before then.
    started = time.monotonic()
    found = consumer.client.lookup(NAMESPACE, make_hashes(4), timeout_s=WAIT_DEADLINE_S)
    assert found.num_hit_blocks == 0 and time.monotonic() - started < 5.0


def _save_layer_zero_then_wait(conn, engine_name: str, hashes: list[bytes]) -> None:
    """A child that saves layer 0 of ``hashes`` (its other layers: a save in flight), says
    so (with its KV buffer's name, which it cannot unlink once killed) and waits to be killed."""
    from tests.engine.conftest import KVClient
    kv = KVClient(engine_name)
    kv.fill(np.random.default_rng(0), range(len(hashes)))
    assert kv.save(NAMESPACE, range(len(hashes)), hashes, layer=0).is_ok
    conn.send(kv.kv.name)
    conn.recv()


def test_waiting_lookup_of_a_saver_killed_mid_save_is_answered_at_its_reclaim(engine_factory, kv_client,
                                                                              make_hashes):
    # 1. A saver process stores layer 0 of two blocks, then is killed before the other layers.
    from pegaflow.platform import shm
    from tests.spawn import start_child
    engine = engine_factory(extra=("--lookup-wait-ms", "10000"))
    consumer, hashes = kv_client(engine), make_hashes(2)
    conn, saver = start_child(_save_layer_zero_then_wait, engine.name, hashes)
    kv_name = None
    try:
        assert conn.poll(WAIT_DEADLINE_S), "the saver never saved"
        kv_name = conn.recv()
        saved_at = time.monotonic()
        # 2. A LOOKUP of the two waits for them (up to 10 s) ...
        request_id = _submit_lookup_read(consumer, hashes)
        saver.kill()
        saver.join(WAIT_DEADLINE_S)
    finally:
        if saver.is_alive():
            saver.kill()
        if kv_name is not None:
            shm.unlink_segment(kv_name)
    # 3. ... and is answered once the engine reclaims the dead saver (its housekeeping, every
    #    second while blocks are half written), while idle: before the half-written blocks
    #    would count as abandoned, and long before its 10 s deadline.
    found = consumer.client.wait(request_id, WAIT_DEADLINE_S)
    assert found.is_ok and found.result.num_hit_blocks == 0
    assert time.monotonic() - saved_at < ABANDONED_WRITE_S - 1.5, time.monotonic() - saved_at
    stats = engine.wait_stats(lambda s: s["lookup_waits"] == 1)
    assert stats["lookup_wait_timeouts"] == 0


@pytest.mark.slow
def test_waiting_lookup_of_a_block_saved_one_layer_of_four_is_answered_when_abandoned(
        engine_factory, kv_client, rng, make_hashes):
    # 1. A producer saves layer 0 of a block and never the rest (it stays attached).
    engine, _, consumer, hashes, _ = _blocks_being_written(
        engine_factory, kv_client, rng, make_hashes, wait_ms=10_000, num_ready=1, num_writing=1)
    saved_at = time.monotonic()
    # 2. A LOOKUP waiting for it is answered when it counts as abandoned (5 s after it began),
    #    the engine idle meanwhile: not at its 10 s deadline.
    found = consumer.client.wait(_submit_lookup_read(consumer, hashes), WAIT_DEADLINE_S)
    assert found.is_ok and found.result.num_hit_blocks == 1
    assert time.monotonic() - saved_at < ABANDONED_WRITE_S + 3.0
    stats = engine.wait_stats(lambda s: s["lookup_waits"] == 1)
    assert stats["lookup_wait_timeouts"] == 0 and stats["lookup_wait_ns"] >= 4e9


# -- the parts, without a process ----------------------------------------------------------


class _Index:
    def __init__(self):
        self.entries, self.writing = {}, {}

    def add(self, key, is_ready: bool, started_at: float | None = None) -> Entry:
        entry = Entry(0, 16, 0b1111, owner_slot=1, started_at=time.monotonic() if started_at is None else started_at,
                      done_mask=0b1111 if is_ready else 0b0001)
        self.entries[key] = entry
        if not is_ready:
            self.writing[key] = entry
        return entry


class _Client:
    _uids = iter(range(1, 1 << 20))

    def __init__(self, ring: RingConsumer | None = None):
        self.is_attached, self.num_inflight, self.submissions = True, 0, ring
        self.uid, self.is_held_back = next(self._uids), False


class _Stats:
    def __init__(self):
        self.counts = {}

    def add(self, name, amount=1):
        self.counts[name] = self.counts.get(name, 0) + amount


def _waiting(index, answered: list, is_issuing=lambda client, namespace: False) -> WaitingLookups:
    return WaitingLookups(index, answered.append, _Stats(), is_issuing)


def _ring(num_slots: int = 8) -> tuple[RingProducer, RingConsumer]:
    slots = np.zeros(num_slots, dtype=SUBMISSION)
    reset_slots(slots)
    return RingProducer(slots), RingConsumer(slots)


def _publish(producer: RingProducer, opcode: Opcode, namespace: int) -> None:
    record = np.zeros(1, SUBMISSION)[0]
    record["opcode"], record["namespace"] = opcode, namespace
    assert producer.try_put_fields(record.item()[1:])


def _received(client):
    return SimpleNamespace(client=client)


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


@pytest.mark.parametrize("kind", ["complete", "promoting"])
def test_writing_stop_a_doomed_block_is_never_usable(kind):
    # A block a client DROPped while it was in use (doomed) is never served: complete, or
    # being read back from disk, the prefix stops at it all the same.
    index = _Index()
    keys = [(1, b"a"), (1, b"b")]
    index.add(keys[0], True)
    entry = index.add(keys[1], kind == "complete")
    entry.is_promoting = kind == "promoting"
    assert writing_stop(index, keys, time.monotonic()) == (2, "end")  # not doomed: usable
    entry.is_doomed = True
    assert writing_stop(index, keys, time.monotonic()) == (1, "other")


def test_waiting_lookup_parks_on_the_block_it_stops_at_not_the_next():
    # 1. Block 0 READY, block 1 being written, block 2 unknown: a LOOKUP of the three
    #    stops at block 1 (its READY prefix is 1) and waits for it.
    index, answered = _Index(), []
    keys = [(1, b"a"), (1, b"b"), (1, b"c")]
    index.add(keys[0], True)
    index.add(keys[1], False)
    waiting, asker = _waiting(index, answered), _Client()
    assert waiting.try_park(_received(asker), keys, 1, 60.0, [asker]) is Parked.YES
    # 2. Block 1 unknown, block 2 being written, nobody else with commands unread: a LOOKUP
    #    that stops at block 1 is answered at once (block 2 is past where it stops).
    index.entries.clear()
    index.writing.clear()
    index.add(keys[0], True)
    index.add(keys[2], False)
    assert waiting.try_park(_received(asker), keys, 1, 60.0, [asker]) is Parked.NO
    assert len(waiting.items) == 1 and asker.num_inflight == 1


def test_waiting_lookup_is_answered_at_its_deadline_exactly():
    index, answered = _Index(), []
    keys = [(1, b"a")]
    index.add(keys[0], False)
    waiting, asker = _waiting(index, answered), _Client()
    now = time.monotonic()
    waiting.park(WaitingLookup(asker, None, keys, now + 1.0, now, 0))
    assert waiting.resume(now + 1.0 - 1e-6) == 0
    assert waiting.resume(now + 1.0) == 1 and answered[0].is_late  # (its deadline is due: late)


def test_waiting_lookup_wakes_when_the_block_it_waits_for_counts_as_abandoned():
    # 1. A block saved one layer of four, nothing in flight: the LOOKUP's next look is due when
    #    it counts as abandoned, well before its 60 s deadline (so the idle loop wakes for it).
    index, answered = _Index(), []
    keys = [(1, b"a")]
    started = time.monotonic()
    index.add(keys[0], False, started_at=started)
    waiting, asker = _waiting(index, answered), _Client()
    assert waiting.try_park(_received(asker), keys, 0, 60.0, [asker]) is Parked.YES
    assert waiting.next_deadline() == started + ABANDONED_WRITE_S
    # 2. Then it is answered (not late: the wait was over, nobody writes the block).
    assert waiting.resume(started + ABANDONED_WRITE_S - 0.5) == 0
    assert waiting.resume(started + ABANDONED_WRITE_S) == 1 and not answered[0].is_late
    # 3. While a copy fills the block, it is not abandoned: the deadline is the next look.
    index.entries[keys[0]].pending_mask = 0b0010
    assert waiting.try_park(_received(asker), keys, 0, 60.0, [asker]) is Parked.YES
    assert waiting.next_deadline() == waiting.items[0].deadline


def test_unread_marks_follow_only_unread_saves_of_the_namespace_of_clients_read():
    # 1. Three other clients with commands unread: a LOOKUP and a PING; a SAVE of another
    #    namespace; a SAVE of this namespace followed by a PING.
    rings = [_ring() for _ in range(4)]
    for opcode, namespace in [(Opcode.LOOKUP, 1), (Opcode.PING, 0)]:
        _publish(rings[0][0], opcode, namespace)
    _publish(rings[1][0], Opcode.SAVE, 2)
    _publish(rings[2][0], Opcode.SAVE, 1)
    _publish(rings[2][0], Opcode.PING, 0)
    asker, quiet, other_namespace, saver = _Client(), _Client(rings[0][1]), _Client(rings[1][1]), _Client(rings[2][1])
    clients = [asker, quiet, other_namespace, saver]
    # 2. Only the saver is followed, up to just past its SAVE (not its PING after it).
    assert unread_marks(clients, asker, 1, lambda c, n: False) == [(saver, 1)]
    # 3. A client still issuing a SAVE of the namespace (in slices) is followed too.
    issuing = _Client(rings[3][1])
    assert unread_marks([issuing], asker, 1, lambda c, n: c is issuing and n == 1) == [(issuing, 0)]
    # 4. A client whose commands the engine does not read (it reads no answers) is not.
    saver.is_held_back = True
    assert unread_marks(clients, asker, 1, lambda c, n: False) == []


def test_waiting_lookup_catches_up_with_rings_read_after_it(rng):
    # 1. Another client published two commands the engine has not read yet (a SAVE of the
    #    prefix's namespace last); the LOOKUP finds no entry for its next key.
    index, answered = _Index(), []
    producer, ring = _ring()
    _publish(producer, Opcode.PING, 0)
    _publish(producer, Opcode.SAVE, 1)
    saver, asker = _Client(ring), _Client()
    keys = [(1, b"a"), (1, b"b")]
    waiting = _waiting(index, answered)
    assert waiting.try_park(_received(asker), keys, 0, 60.0, [saver, asker]) is Parked.YES
    assert waiting.items[0].catch_up == [(saver, 2)]
    now = time.monotonic()
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


def test_waiting_lookup_stops_following_a_client_the_engine_stopped_reading():
    # A client with a SAVE unread stops reading its answers (the engine then reads none of
    # its commands): the LOOKUP following it is answered at once, not at its deadline.
    index, answered = _Index(), []
    producer, ring = _ring()
    _publish(producer, Opcode.SAVE, 1)
    stuck, asker = _Client(ring), _Client()
    waiting = _waiting(index, answered)
    assert waiting.try_park(_received(asker), [(1, b"a")], 0, 60.0, [stuck, asker]) is Parked.YES
    assert waiting.resume(time.monotonic()) == 0
    stuck.is_held_back = True
    assert waiting.resume(time.monotonic()) == 1 and not answered[0].is_late


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


@pytest.mark.parametrize("bound", ["per-client", "per-client-keys", "total", "total-keys"])
def test_waiting_lookups_past_their_bound_are_answered_at_once_and_counted(bound, monkeypatch):
    # 1. Small bounds: two LOOKUPs of one client, three of every client; six hashes of one
    #    client, eight of every client.
    import engine.commands.lookup_waits as module
    monkeypatch.setattr(module, "MAX_WAITING_PER_CLIENT", 2)
    monkeypatch.setattr(module, "MAX_WAITING", 3)
    monkeypatch.setattr(module, "MAX_WAITING_KEYS_PER_CLIENT", 6)
    monkeypatch.setattr(module, "MAX_WAITING_KEYS", 8)
    index, answered = _Index(), []
    writing = (1, b"w")
    index.add(writing, False)
    waiting, one, two, three = _waiting(index, answered), _Client(), _Client(), _Client()

    def park(client, num_keys=1) -> str:
        return waiting.try_park(_received(client), [writing] + [(1, b"x")] * (num_keys - 1), 0, 60.0, []).name
    # 2. Up to the bound each LOOKUP waits; the next one past it is not parked but refused
    #    (answered now, the caller's, under WAIT_REFUSED), and counted.
    if bound == "per-client":
        assert [park(one), park(one), park(one), park(two)] == ["YES", "YES", "REFUSED", "YES"]
    elif bound == "per-client-keys":
        assert [park(one, 5), park(one, 2), park(one, 1), park(two, 2)] == ["YES", "REFUSED", "YES", "YES"]
    elif bound == "total":
        assert [park(one), park(two), park(three), park(three)] == ["YES", "YES", "YES", "REFUSED"]
    else:
        assert [park(one, 4), park(two, 4), park(three, 1)] == ["YES", "YES", "REFUSED"]
    assert waiting.stats.counts == {"lookup_waits_refused": 1}
    # 3. Once the parked ones are answered, there is room again, and nothing is left counted.
    index.entries[writing].done_mask = 0b1111
    del index.writing[writing]
    assert waiting.resume(time.monotonic()) == len(answered) and waiting.num_keys == 0 and not waiting.by_client
    index.add(writing, False)
    assert park(one) == "YES"


@pytest.mark.parametrize("is_attached", [True, False])
def test_waiting_lookup_past_deadline_or_gone_is_answered(is_attached):
    index, answered = _Index(), []
    keys = [(1, b"a")]
    index.add(keys[0], False)
    waiting, asker = _waiting(index, answered), _Client()
    now = time.monotonic()
    waiting.park(WaitingLookup(asker, None, keys, now + 60, now, 0))
    asker.is_attached = is_attached
    assert waiting.resume(now + (0 if not is_attached else 61)) == 1 and len(answered) == 1
