"""engine.commands.dispatcher: records decoded once and routed to their handlers, bad input
refused, exactly one answer per command, a DETACH after its copies, refused setup logged.

Most tests talk to an engine process only through its rings (``KVClient`` in conftest) and
read its counters through the stats segment, exactly as vLLM's connector and
``pegaflow-stat`` would; the rest drive a Dispatcher in process (``held_dispatcher``).
SAVE and LOAD themselves: ``test_transfers.py`` and ``test_transfers_engine.py``.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import pytest

import pegaflow.client.connection
import pegaflow.platform.protocol.codec
from pegaflow.client.host_memory import HostKVBuffer, layer_major_records, layer_records
from pegaflow.platform.errors import CommandError
from pegaflow.platform.wire import BLOCK_ID, HASH, HASH_BYTES, Opcode, Status, encode_hashes
from tests.engine.commands.held_dispatcher import held_dispatcher, save_payload, store_blocks

NAMESPACE = 0x7E57
OTHER_NAMESPACE = 0x7E58


def test_dispatcher_lookup_returns_contiguous_prefix_only(shared_engine, kv_client, rng, make_hashes):
    kv = kv_client(shared_engine)
    stored = make_hashes(4)
    # 1. Store 4 blocks.
    kv.fill(rng, range(4))
    assert kv.save(NAMESPACE, range(4), stored).value == 4
    # 2. A gap after two hits ends the prefix, even though the blocks after it are stored.
    assert kv.num_hits(NAMESPACE, stored[:2] + make_hashes(1) + stored[2:]) == 2
    # 3. A miss first means no hit at all, and no lease.
    found = kv.client.lookup(NAMESPACE, make_hashes(1) + stored)
    assert (found.num_hit_blocks, found.lease_id) == (0, 0)


def test_dispatcher_other_namespace_never_hits(shared_engine, kv_client, rng, make_hashes):
    kv = kv_client(shared_engine)
    hashes = make_hashes(4)
    # 1. Store 4 blocks under NAMESPACE.
    in_first = kv.fill(rng, range(4))
    assert kv.save(NAMESPACE, range(4), hashes).value == 4
    # 2. The same hashes under OTHER_NAMESPACE: no hit, no lease, and a LOAD is MISSING_BLOCK.
    found = kv.client.lookup(OTHER_NAMESPACE, hashes)
    assert (found.num_hit_blocks, found.lease_id) == (0, 0)
    missing = kv.load(OTHER_NAMESPACE, range(8, 12), hashes)
    assert missing.status == Status.MISSING_BLOCK
    # 3. Saving them under OTHER_NAMESPACE stores new entries (not a dedup of the first).
    in_second = kv.fill(rng, range(4, 8))
    saved = kv.save(OTHER_NAMESPACE, range(4, 8), hashes)
    assert (saved.value, saved.value2) == (4, 0)
    # 4. Each namespace loads its own bytes.
    assert kv.load(NAMESPACE, range(8, 12), hashes).is_ok
    assert kv.load(OTHER_NAMESPACE, range(12, 16), hashes).is_ok
    np.testing.assert_array_equal(kv.pages[:, 8:12], in_first)
    np.testing.assert_array_equal(kv.pages[:, 12:16], in_second)


def test_dispatcher_short_hash_is_not_its_zero_padded_long_form(shared_engine, kv_client, rng):
    kv = kv_client(shared_engine)
    short = rng.bytes(16)
    # 1. Store a block under a 16-byte hash.
    kv.fill(rng, [0])
    assert kv.save(NAMESPACE, [0], [short]).value == 1
    # 2. The 32-byte hash with the same first 16 bytes and zeros after is another block.
    assert kv.num_hits(NAMESPACE, [short + bytes(16)]) == 0
    assert kv.num_hits(NAMESPACE, [short]) == 1


def test_dispatcher_pipelined_commands_get_exactly_one_completion_each(shared_engine, kv_client, make_hashes):
    kv = kv_client(shared_engine)
    # 1. Submit 300 commands without waiting for any answer, mixing OK and error answers.
    request_ids = []
    for i in range(300):
        if i % 3 == 0:
            request_ids.append(kv.client.submit(Opcode.PING))
        elif i % 3 == 1:
            request_ids.append(kv.client.submit(Opcode.LOOKUP, payload=[encode_hashes(make_hashes(2))],
                                                num_items=2, namespace=NAMESPACE))
        else:
            request_ids.append(kv.client.release(10**9 + i))  # UNKNOWN_LEASE
    # 2. Every request id comes back exactly once, none other.
    seen = []
    deadline = time.monotonic() + 10.0
    while len(seen) < len(request_ids) and time.monotonic() < deadline:
        seen += [c.command_id for c in kv.client.poll()]
        time.sleep(1e-3)
    assert sorted(seen) == sorted(request_ids)
    # 3. Nothing more arrives afterwards.
    assert kv.client.wait(kv.client.submit(Opcode.PING)).is_ok
    assert kv.client.poll() == []


# -- bad input: each gets its status, changes nothing, and the engine stays up -------------


def _assert_still_serving(engine, client, status: Status, errors_before: list[int]) -> None:
    """PING works (nothing in flight), and the stats counted exactly one more error of ``status``."""
    assert client.ping() == 0
    errors = engine.wait_stats(lambda s: s["errors_by_status"][status] >= errors_before[status] + 1)
    assert errors["errors_by_status"][status] == errors_before[status] + 1
    assert engine.proc.poll() is None


def test_dispatcher_unknown_opcode_answers_bad_opcode_and_stays_up(shared_engine, kv_client):
    kv = kv_client(shared_engine)
    before = shared_engine.stats()["errors_by_status"]
    # 1. Publish opcode 999 through the ring, bypassing the client's decoding of the answer.
    request_id = kv.submit_raw(opcode=999)
    # 2. The engine answers exactly that request with BAD_OPCODE.
    done = kv.take_raw(request_id)
    assert (int(done["opcode"]), int(done["status"])) == (999, Status.BAD_OPCODE)
    # 3. It still serves, and counted the error.
    _assert_still_serving(shared_engine, kv.client, Status.BAD_OPCODE, before)


def test_dispatcher_unknown_opcode_reaches_client_as_bad_opcode_completion(shared_engine, kv_client):
    kv = kv_client(shared_engine)
    # 1. Submit opcode 999 through the public client API and wait for its answer.
    request_id = kv.client.submit(999)
    # 2. The client hands back a BAD_OPCODE completion (it must not choke on decoding it).
    done = kv.client.wait(request_id)
    assert done.status == Status.BAD_OPCODE
    assert kv.client.ping() == 0


@pytest.mark.parametrize("block_id", [64, -1, 2**31 - 1])
@pytest.mark.parametrize("opcode", [Opcode.SAVE, Opcode.LOAD])
def test_dispatcher_block_id_out_of_range_answers_block_out_of_range(
        shared_engine, kv_client, rng, make_hashes, opcode, block_id):
    kv = kv_client(shared_engine)
    assert kv.NUM_BLOCKS == 64
    hashes = make_hashes(3)
    kv.fill(rng, range(3))
    if opcode == Opcode.LOAD:
        assert kv.save(NAMESPACE, range(3), hashes).value == 3
    before = shared_engine.stats()["errors_by_status"]
    # 1. Two valid block ids and one outside [0, NUM_BLOCKS).
    ids = [0, 1, block_id]
    request_id = (kv.client.submit_save(NAMESPACE, ids, hashes) if opcode == Opcode.SAVE
                  else kv.client.submit_load(NAMESPACE, ids, hashes))
    assert kv.client.wait(request_id).status == Status.BLOCK_OUT_OF_RANGE
    # 2. A rejected SAVE stored nothing, not even the blocks with valid ids.
    if opcode == Opcode.SAVE:
        assert kv.num_hits(NAMESPACE, hashes) == 0
    _assert_still_serving(shared_engine, kv.client, Status.BLOCK_OUT_OF_RANGE, before)


def test_dispatcher_wrong_version_field_answers_bad_version(shared_engine, kv_client, monkeypatch):
    kv = kv_client(shared_engine)
    before = shared_engine.stats()["errors_by_status"]
    # 1. The client writes the next wire version into the next SUBMISSION.
    codec = pegaflow.platform.protocol.codec
    monkeypatch.setattr(codec, "WIRE_VERSION", codec.WIRE_VERSION + 1)
    request_id = kv.client.submit(Opcode.PING)
    monkeypatch.undo()
    # 2. The engine answers BAD_VERSION and keeps serving commands of the right version.
    assert kv.client.wait(request_id).status == Status.BAD_VERSION
    _assert_still_serving(shared_engine, kv.client, Status.BAD_VERSION, before)


@pytest.mark.parametrize("offset_from_end", [8, 0, -(2**40)], ids=["straddles_end", "at_end", "far_past"])
def test_dispatcher_payload_past_arena_answers_bad_payload(shared_engine, kv_client, offset_from_end):
    kv = kv_client(shared_engine)
    arena_bytes = kv.client._arena.num_bytes
    before = shared_engine.stats()["errors_by_status"]
    # 1. A LOOKUP whose payload starts near (or at, or far past) the arena's end.
    offset = arena_bytes - offset_from_end
    request_id = kv.submit_raw(opcode=Opcode.LOOKUP, num_items=1, namespace=NAMESPACE,
                               payload_offset=offset, payload_bytes=HASH.itemsize)
    assert kv.client.wait(request_id).status == Status.BAD_PAYLOAD
    _assert_still_serving(shared_engine, kv.client, Status.BAD_PAYLOAD, before)


@pytest.mark.parametrize("length", [0, HASH_BYTES + 1, 255])
def test_dispatcher_hash_record_with_bad_length_answers_bad_payload(shared_engine, kv_client, make_hashes, length):
    kv = kv_client(shared_engine)
    before = shared_engine.stats()["errors_by_status"]
    # 1. Two good hash records and one whose length byte is out of 1..32.
    records = encode_hashes(make_hashes(3))
    records["length"][1] = length
    request_id = kv.client.submit(Opcode.LOOKUP, payload=[records], num_items=3, namespace=NAMESPACE)
    assert kv.client.wait(request_id).status == Status.BAD_PAYLOAD
    _assert_still_serving(shared_engine, kv.client, Status.BAD_PAYLOAD, before)


def test_dispatcher_num_items_disagreeing_with_payload_answers_bad_payload(shared_engine, kv_client, make_hashes):
    kv = kv_client(shared_engine)
    before = shared_engine.stats()["errors_by_status"]
    # 1. A SAVE of 2 block ids and 2 hashes that claims 3 items.
    ids = np.array([0, 1], dtype=BLOCK_ID)
    request_id = kv.client.submit(Opcode.SAVE, payload=[ids, encode_hashes(make_hashes(2))],
                                  num_items=3, namespace=NAMESPACE)
    assert kv.client.wait(request_id).status == Status.BAD_PAYLOAD
    _assert_still_serving(shared_engine, kv.client, Status.BAD_PAYLOAD, before)


def test_dispatcher_save_before_register_answers_unknown_region(shared_engine, make_hashes):
    client = shared_engine.connect()
    try:
        # 1. A client that registered no KV memory cannot save.
        done = client.wait(client.submit_save(NAMESPACE, [0], make_hashes(1)))
        assert done.status == Status.UNKNOWN_REGION
        assert client.ping() == 0
    finally:
        client.close()


def test_dispatcher_release_unknown_lease_answers_unknown_lease(shared_engine, kv_client):
    kv = kv_client(shared_engine)
    # 1. RELEASE of a lease that was never handed out.
    assert kv.release(123_456_789).status == Status.UNKNOWN_LEASE
    # 2. The typed error reaches a caller of ``call`` as CommandError with that status.
    with pytest.raises(CommandError) as info:
        kv.client.call(Opcode.RELEASE, arg=123_456_789)
    assert info.value.status == Status.UNKNOWN_LEASE


def test_dispatcher_register_page_larger_than_slab_answers_bad_argument(engine_factory, make_hashes):
    engine = engine_factory(pool_size="1MiB", slab_size="64KiB")
    client = engine.connect()
    page_bytes, num_blocks, num_layers = 32 << 10, 4, 4  # one entry = 128 KiB > 64 KiB slab
    kv = HostKVBuffer(page_bytes * num_blocks * num_layers, "tkv")
    try:
        before = engine.stats()["errors_by_status"]
        # 1. REGISTER a cache whose block (every layer of it) cannot fit one slab.
        layers = layer_major_records(num_layers, num_blocks, page_bytes)
        with pytest.raises(CommandError) as info:
            client.register_region(0, kv.region_record(num_blocks, page_bytes, num_layers), layers)
        # 2. It is the client's mistake, a typed BAD_ARGUMENT, not an INTERNAL error.
        assert info.value.status == Status.BAD_ARGUMENT
        _assert_still_serving(engine, client, Status.BAD_ARGUMENT, before)
    finally:
        client.close()
        kv.close()


def test_dispatcher_detach_waits_for_copies_then_frees_everything():
    # 1. A dispatcher whose backend holds every copy until released.
    from engine.copy.base import CopyDone
    h = held_dispatcher()
    dispatcher, client, backend, send, completions = h.dispatcher, h.client, h.backend, h.send, h.completions
    # 2. A SAVE is in flight when the client says DETACH.
    send(1, Opcode.SAVE, save_payload([1, 2], [b"a" * 32, b"b" * 32]), 2)
    send(2, Opcode.DETACH)
    # 3. No answer to DETACH yet, and its memory is still registered.
    assert completions.try_get() is None and backend.unregistered == []
    # 4. The copy ends: the SAVE is answered, then DETACH, and only then is the memory dropped.
    dispatcher.on_copy_done(CopyDone(backend.held.pop()))
    answers = [completions.try_get(), completions.try_get()]
    assert [(a.command_id, a.opcode) for a in answers] == [(1, Opcode.SAVE), (2, Opcode.DETACH)]
    assert backend.unregistered == [0] and client.num_inflight == 0


def test_dispatcher_refused_detach_leaves_the_client_attached(engine, kv_client, rng, make_hashes):
    kv = kv_client(engine)
    hashes = make_hashes(1)
    kv.fill(rng, [0])
    assert kv.save(NAMESPACE, [0], hashes).is_ok
    # 1. A DETACH of another wire version is refused: it changes nothing.
    request_id = kv.submit_raw(opcode=Opcode.DETACH, version=99)
    assert int(kv.take_raw(request_id)["status"]) == Status.BAD_VERSION
    # 2. After a housekeeping pass the client still holds its slot and its memory: a LOAD works.
    engine.fresh_stats()
    assert engine.stats()["clients_attached"] == 1
    found = kv.client.lookup(NAMESPACE, hashes)
    assert kv.load(NAMESPACE, [1], hashes, lease_id=found.lease_id).is_ok


def test_dispatcher_register_of_a_registered_region_id_is_refused(shared_engine, kv_client, rng,
                                                                  make_hashes):
    kv = kv_client(shared_engine)
    hashes = make_hashes(2)
    expected = kv.fill(rng, [0, 1])
    # 1. Region 0 again, other layers at other offsets: refused, nothing remapped.
    layers = layer_records([10, 11], [0, kv.PAGE_BYTES], [2 * kv.PAGE_BYTES] * 2)
    with pytest.raises(CommandError) as info:
        kv.client.register_region(0, kv.kv.region_record(2, kv.PAGE_BYTES, 2), layers)
    assert info.value.status == Status.BAD_ARGUMENT
    # 2. The first registration still holds: a round trip of every layer is exact.
    assert kv.save(NAMESPACE, [0, 1], hashes).is_ok
    kv.pages[:, [2, 3]] = 0
    assert kv.load(NAMESPACE, [2, 3], hashes).is_ok
    np.testing.assert_array_equal(kv.pages[:, [2, 3]], expected)


def test_dispatcher_detach_waiting_on_a_copy_is_answered_when_that_copy_ends():
    # 1. Client A's SAVE is in flight when A says DETACH: its answer waits for the copy.
    from engine.copy.base import CopyDone
    h = held_dispatcher()
    b = h.add_client(1)
    store_blocks(h, 1, [1], [b"y" * 32])  # something for B to load
    h.send(2, Opcode.SAVE, save_payload([2], [b"z" * 32]), 1)
    h.send(3, Opcode.DETACH)
    (save_token,) = h.backend.held
    assert h.completions.try_get() is None  # neither the SAVE nor the DETACH is answered yet
    # 2. B's fenced LOAD goes ahead as usual meanwhile (answered at once: its events fence
    #    the data) and leaves A's copy alone: A still waits, its memory still registered.
    b.send(4, Opcode.LOAD, save_payload([5], [b"y" * 32]), 1, event_index=0)
    assert b.completions.try_get().status == Status.OK
    assert h.completions.try_get() is None and h.backend.unregistered == []
    # 3. A's copy ends: its SAVE and DETACH are answered, and A's memory let go.
    h.backend.held.remove(save_token)
    h.dispatcher.on_copy_done(CopyDone(save_token))
    answers = []
    while (answer := h.completions.try_get()) is not None:
        answers.append((answer.command_id, answer.opcode))
    assert answers == [(2, Opcode.SAVE), (3, Opcode.DETACH)]
    assert h.backend.unregistered == [0] and h.client.num_inflight == 0
    for token in list(h.backend.held):
        h.dispatcher.on_copy_done(CopyDone(token))


@pytest.mark.parametrize("page_bytes, stride, what", [
    (1, None, "1-byte pages (a slab's free list of 64M entries)"),
    (2**63, 4096, "a page past int64"),
    (4096, 2**62, "a stride whose last page wraps around int64"),
])
def test_dispatcher_register_of_absurd_geometry_answers_bad_argument(engine_factory, page_bytes,
                                                                     stride, what):
    # A REGISTER whose page size or layer stride no KV cache has: a typed BAD_ARGUMENT (not
    # INTERNAL, not a stalled loop), and the engine goes on serving.
    engine = engine_factory(pool_size="4MiB", slab_size="1MiB")
    client = engine.connect()
    num_blocks = 4
    kv = HostKVBuffer(4096 * num_blocks, "tkv")
    try:
        before = engine.stats()["errors_by_status"]
        region = kv.region_record(num_blocks, 4096, 1)
        region["page_bytes"] = page_bytes
        layers = layer_records([0], [0], [stride or page_bytes])
        with pytest.raises(CommandError) as info:
            client.register_region(0, region, layers)
        assert info.value.status == Status.BAD_ARGUMENT, what
        _assert_still_serving(engine, client, Status.BAD_ARGUMENT, before)
    finally:
        client.close()
        kv.close()


def test_dispatcher_has_a_handler_for_every_opcode():
    # An opcode added to the wire's enum without a handler here fails (and the engine's
    # dispatcher refuses to start).
    h = held_dispatcher()
    assert set(h.dispatcher.handlers) == set(Opcode)


def test_dispatcher_refused_setup_commands_are_logged_once_per_client_and_opcode_per_interval(
        monkeypatch, caplog):
    # 1. A client sends 20 ATTACHes the engine refuses (voter 0 of 0 voters), another client
    #    one, and the first a refused REGISTER_EVENTS (a payload of no whole record).
    import engine.commands.dispatcher
    from engine.commands.slow_commands import REFUSAL_EVERY_S
    now = [100.0]
    monkeypatch.setattr(engine.commands.dispatcher, "monotonic", lambda: now[0])
    h = held_dispatcher()
    other = h.add_client(1)
    bad_attach = np.zeros(3, "<u8").view(np.uint8)
    with caplog.at_level(logging.WARNING, logger="engine"):
        for request_id in range(20):
            h.send(request_id, Opcode.ATTACH, bad_attach, arg=os.getpid())
        other.send(1, Opcode.ATTACH, bad_attach, arg=os.getpid())
        h.send(21, Opcode.REGISTER_EVENTS, np.zeros(3, np.uint8), num_items=1)
        # 2. One WARNING per client and opcode; every command answered all the same.
        lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(lines) == 3 and sum("ATTACH refused" in line for line in lines) == 2
        assert len(h.client.backlog) + h.completions.num_published() == 21
        # 3. Once the interval is over, the next refusal is logged, saying how many were not.
        now[0] += REFUSAL_EVERY_S
        h.send(22, Opcode.ATTACH, bad_attach, arg=os.getpid())
    assert len(caplog.records) == 4 and "19 more refused in the last 10 s" in caplog.records[-1].getMessage()
