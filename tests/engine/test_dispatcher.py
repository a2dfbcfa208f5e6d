"""The dispatcher through a real engine process: SAVE/LOAD/LOOKUP semantics and bad input.

Every test talks to the engine only through its rings (``KVClient`` in conftest) and
reads its counters through the stats segment, exactly as vLLM's connector and
``pegaflow-stat`` would.
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
from pegaflow.platform.wire import BLOCK_ID, HASH, HASH_BYTES, CommandFlag, Opcode, Status, encode_hashes, hash_keys

NAMESPACE = 0x7E57
OTHER_NAMESPACE = 0x7E58


def test_dispatcher_save_then_load_is_byte_exact(shared_engine, kv_client, rng, make_hashes):
    kv = kv_client(shared_engine)
    hashes = make_hashes(16)
    src = np.arange(16)
    dst = np.arange(32, 48)
    # 1. Save 16 blocks of random bytes: all 16 are stored, none deduped or dropped.
    expected = kv.fill(rng, src)
    saved = kv.save(NAMESPACE, src, hashes)
    assert (saved.status, saved.value, saved.value2, saved.value3) == (Status.OK, 16, 0, 0)
    # 2. Look them up: the whole prefix hits and a lease is handed out.
    found = kv.client.lookup(NAMESPACE, hashes)
    assert found.num_hit_blocks == 16 and found.lease_id != 0
    # 3. Poison other blocks, load into them, and compare every byte of every layer.
    kv.pages[:, dst] = 0xA5
    loaded = kv.load(NAMESPACE, dst, hashes, lease_id=found.lease_id)
    assert loaded.is_ok and loaded.value == 16
    np.testing.assert_array_equal(kv.pages[:, dst], expected)
    # 4. The source blocks were not touched by the load.
    np.testing.assert_array_equal(kv.pages[:, src], expected)


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


def test_dispatcher_save_same_hashes_twice_stores_once(engine, kv_client, rng, make_hashes):
    kv = kv_client(engine)
    hashes = make_hashes(8)
    # 1. Save 8 blocks; the pool now holds 8 entries.
    first = kv.fill(rng, range(8))
    assert kv.save(NAMESPACE, range(8), hashes).value == 8
    engine.wait_stats(lambda s: s["pool_blocks_used"] == 8 and s["blocks_saved"] == 8)
    # 2. Save the same hashes again from other blocks with other bytes: all 8 are dedup.
    kv.fill(rng, range(8, 16))
    again = kv.save(NAMESPACE, range(8, 16), hashes)
    assert (again.status, again.value, again.value2, again.value3) == (Status.OK, 0, 8, 0)
    # 3. Nothing new was stored or counted as saved (gauges from a later housekeeping pass);
    #    the dedup counter moved by 8.
    after = engine.fresh_stats()
    assert after["pool_blocks_used"] == 8 and after["blocks_saved"] == 8
    assert after["save_dedup_blocks"] == 8
    # 4. The first copy is the one that stays.
    assert kv.load(NAMESPACE, range(16, 24), hashes).is_ok
    np.testing.assert_array_equal(kv.pages[:, 16:24], first)


def test_dispatcher_save_duplicate_hash_within_one_command_stores_once(engine, kv_client, rng, make_hashes):
    kv = kv_client(engine)
    [h] = make_hashes(1)
    # 1. One SAVE names the same hash for two blocks: one is stored, one is dedup.
    kv.fill(rng, range(2))
    saved = kv.save(NAMESPACE, [0, 1], [h, h])
    assert (saved.value, saved.value2) == (1, 1)
    engine.wait_stats(lambda s: s["pool_blocks_used"] == 1 and s["blocks_saved"] == 1)


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


def test_dispatcher_block_visible_only_when_every_layer_saved(shared_engine, kv_client, rng, make_hashes):
    kv = kv_client(shared_engine)
    hashes = make_hashes(2)
    expected = kv.fill(rng, [0, 1])
    # 1. Save layer by layer; until the last layer is in, lookups do not see the blocks.
    for layer in range(kv.NUM_LAYERS - 1):
        assert kv.save(NAMESPACE, [0, 1], hashes, layer=layer).is_ok
        assert kv.num_hits(NAMESPACE, hashes) == 0
        assert kv.load(NAMESPACE, [8, 9], hashes).status == Status.MISSING_BLOCK
    # 2. The last layer makes both visible, with every layer's bytes.
    assert kv.save(NAMESPACE, [0, 1], hashes, layer=kv.NUM_LAYERS - 1).is_ok
    assert kv.num_hits(NAMESPACE, hashes) == 2
    assert kv.load(NAMESPACE, [8, 9], hashes).is_ok
    np.testing.assert_array_equal(kv.pages[:, [8, 9]], expected)


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


def test_dispatcher_refused_load_releases_its_lease(engine, kv_client, rng, make_hashes):
    kv = kv_client(engine)
    hashes = make_hashes(3)
    kv.fill(rng, range(3))
    assert kv.save(NAMESPACE, range(3), hashes).value == 3
    # 1. A lookup leases the three blocks; the LOAD meant to use the lease is refused.
    found = kv.client.lookup(NAMESPACE, hashes)
    assert found.num_hit_blocks == 3 and engine.stats()["leases_active"] == 1
    bad = kv.client.submit_load(NAMESPACE, [0, 1, kv.NUM_BLOCKS], hashes, lease_id=found.lease_id)
    assert kv.client.wait(bad).status == Status.BLOCK_OUT_OF_RANGE
    # 2. The lease died with it: nothing stays pinned until the lease's expiry.
    assert engine.stats()["leases_active"] == 0
    assert kv.release(found.lease_id).status == Status.UNKNOWN_LEASE


def test_dispatcher_lease_of_one_vllm_instance_is_refused_to_another(engine, kv_client, rng, make_hashes):
    # 1. A scheduler of instance 7 looks up three stored blocks and holds their lease.
    saver = kv_client(engine)
    hashes = make_hashes(3)
    saver.fill(rng, range(3))
    assert saver.save(NAMESPACE, range(3), hashes).value == 3
    scheduler, other, worker = kv_client(engine, 7), kv_client(engine, 8), kv_client(engine, 7)
    lease = scheduler.client.lookup(NAMESPACE, hashes).lease_id
    # 2. A client of instance 8 (a buggy vLLM that kept a stale id) can neither release it
    #    nor load with it; the lease lives on.
    assert other.release(lease).status == Status.UNKNOWN_LEASE
    bad = other.client.submit_load(NAMESPACE, [0, 1, 2], hashes, lease_id=lease)
    assert other.client.wait(bad).status == Status.UNKNOWN_LEASE
    assert engine.stats()["leases_active"] == 1
    # 3. A worker of instance 7 loads with it (the scheduler-to-worker handoff), ending it.
    done = worker.client.wait(worker.client.submit_load(NAMESPACE, [3, 4, 5], hashes, lease_id=lease))
    assert done.is_ok and engine.stats()["leases_active"] == 0


def _held_dispatcher(refuse: bool = False):
    """A dispatcher on one in-memory client (one layer of 16 blocks, 4 IPC events) whose
    backend holds every copy until the test ends it with ``on_copy_done`` (or, with
    ``refuse``, refuses every copy at submit, as the CUDA backend refuses an op that fails
    its checks)."""
    from types import SimpleNamespace

    from engine.clients import ClientState
    from engine.copy.base import CopyBackend, LayerPlacement
    from engine.dispatcher import Dispatcher
    from engine.index import BlockIndex
    from engine.pool import PagePool
    from engine.stats import StatsWriter
    from pegaflow.platform.ring import RingConsumer, RingProducer, RingSegmentView, record_type, reset_slots
    from pegaflow.platform.wire import ALL_LAYERS, COMPLETION, NO_EVENT, STATS, SUBMISSION, WIRE_VERSION

    class HeldBackend(CopyBackend):
        name = "held"

        def __init__(self):
            self.held, self.unregistered, self.ops = [], [], {}

        def open_pool(self, pool): pass
        def register_region(self, *args): pass
        def register_events(self, *args): pass
        def unregister_client(self, slot): self.unregistered.append(slot)
        def submit(self, op):
            self.ops[op.token] = op
            if refuse:
                raise CommandError(Status.BLOCK_OUT_OF_RANGE, "refused at submit")
            self.held.append(op.token)
        def num_inflight(self): return len(self.held)

        def poll(self):
            return []

    class Segment:
        def __init__(self, size): self.buf, self.name = np.zeros(size, np.uint8), "mem"
        def array(self, dtype, count, offset=0): return np.frombuffer(self.buf, dtype, count, offset)

    backend = HeldBackend()
    dispatcher = Dispatcher(BlockIndex(PagePool(1 << 20, 1 << 20), 60.0), backend,
                            StatsWriter(np.zeros(1, STATS)))
    dispatcher.transfers.issuing.slice_s = float("inf")  # no loop here to issue the rest later
    make = record_type(SUBMISSION)

    def add_client(slot: int) -> SimpleNamespace:
        """Another in-memory client of the same dispatcher (same geometry, own ring)."""
        num_slots, arena = 8, 1 << 16
        view = RingSegmentView(Segment(64 + num_slots * (SUBMISSION.itemsize + COMPLETION.itemsize)
                                       + arena), num_slots, arena)
        reset_slots(view.submissions)
        reset_slots(view.completions)
        client = ClientState(slot, view, RingConsumer(view.submissions), RingProducer(view.completions),
                             pid=os.getpid(), is_attached=True)
        client.layers = {0: LayerPlacement(0, 0, 0, 4096)}
        client.region_blocks, client.page_bytes, client.num_events = {0: 16}, 4096, 4

        def send(request_id, opcode, payload=np.zeros(0, np.uint8), num_items=0,
                 event_index=NO_EVENT, flags=0, arg=0, layer=ALL_LAYERS, namespace=7):
            view.arena[:payload.nbytes] = payload.view(np.uint8)
            rec = make(0, request_id, opcode, flags, layer, 0, num_items, event_index, namespace, 0,
                       payload.nbytes, WIRE_VERSION, arg)
            dispatcher.handle(client, rec, dispatcher.read_payload(client, rec))

        return SimpleNamespace(client=client, view=view, send=send,
                               completions=RingConsumer(view.completions))

    first = add_client(0)
    return SimpleNamespace(dispatcher=dispatcher, backend=backend, add_client=add_client,
                           client=first.client, view=first.view, send=first.send,
                           completions=first.completions)


def _save_payload(ids, hashes: list[bytes]) -> np.ndarray:
    return np.concatenate([np.asarray(ids, np.int32).view(np.uint8), encode_hashes(hashes).view(np.uint8)])


def test_dispatcher_detach_waits_for_copies_then_frees_everything():
    # 1. A dispatcher whose backend holds every copy until released.
    from engine.copy.base import CopyDone
    h = _held_dispatcher()
    dispatcher, client, backend, send, completions = h.dispatcher, h.client, h.backend, h.send, h.completions
    # 2. A SAVE is in flight when the client says DETACH.
    send(1, Opcode.SAVE, _save_payload([1, 2], [b"a" * 32, b"b" * 32]), 2)
    send(2, Opcode.DETACH)
    # 3. No answer to DETACH yet, and its memory is still registered.
    assert completions.try_get() is None and backend.unregistered == []
    # 4. The copy ends: the SAVE is answered, then DETACH, and only then is the memory dropped.
    dispatcher.on_copy_done(CopyDone(backend.held.pop()))
    answers = [completions.try_get(), completions.try_get()]
    assert [(a.request_id, a.opcode) for a in answers] == [(1, Opcode.SAVE), (2, Opcode.DETACH)]
    assert backend.unregistered == [0] and client.num_inflight == 0


def test_dispatcher_revoked_saves_store_nothing():
    # 1. A SAVE is in flight; then the client revokes its saves (it stopped waiting and may
    #    reuse the blocks): the copy ends, but nothing is stored and the SAVE fails.
    from engine.copy.base import CopyDone
    h = _held_dispatcher()
    hashes = [b"r" * 32, b"s" * 32]
    h.send(1, Opcode.SAVE, _save_payload([3, 4], hashes), 2)
    h.view.header["revoked"] = 1
    h.dispatcher.on_copy_done(CopyDone(h.backend.held.pop()))
    answer = h.completions.try_get()
    assert (answer.request_id, answer.status) == (1, Status.COPY_FAILED)
    keys = [(7, k) for k in hash_keys(encode_hashes(hashes))]
    assert all(h.dispatcher.index.get_ready(k) is None for k in keys)
    assert h.dispatcher.index.pool.num_entries == 0
    # 2. A SAVE that arrives after the revocation is refused without a copy.
    h.send(2, Opcode.SAVE, _save_payload([5], [b"t" * 32]), 1)
    answer = h.completions.try_get()
    assert (answer.request_id, answer.status) == (2, Status.BAD_ARGUMENT) and h.backend.held == []


def test_dispatcher_client_that_revoked_its_copies_gets_none_started(shared_engine, kv_client, rng,
                                                                   make_hashes):
    kv = kv_client(shared_engine)
    stored, hashes = make_hashes(1), make_hashes(2)
    kv.fill(rng, [0, 1, 2])
    assert kv.save(NAMESPACE, [2], stored).is_ok
    # 1. The client revokes its copies through its ring segment: a SAVE is refused...
    kv.client.revoke()
    assert kv.save(NAMESPACE, [0, 1], hashes).status == Status.BAD_ARGUMENT
    # 2. ...and so is a LOAD: it would overwrite blocks vLLM may have given to others.
    kv.pages[:, 3] = 0x77
    assert kv.load(NAMESPACE, [3], stored).status == Status.BAD_ARGUMENT
    assert (kv.pages[:, 3] == 0x77).all()
    # 3. Nothing new was stored; the client still answers pings (it is about to detach).
    assert kv.num_hits(NAMESPACE, hashes) == 0
    assert kv.client.ping() == 0


def _stored(h, request_id: int, ids, hashes) -> None:
    """SAVE ``hashes`` from ``ids`` and let the held copy finish."""
    from engine.copy.base import CopyDone
    h.send(request_id, Opcode.SAVE, _save_payload(ids, hashes), len(ids))
    for token in list(h.backend.held):
        h.backend.held.remove(token)
        h.dispatcher.on_copy_done(CopyDone(token))
    assert h.completions.try_get().status == Status.OK


def test_dispatcher_fenced_load_is_answered_at_issue_once():
    # 1. Blocks stored; a LOAD fenced by the client's events (event_index) is answered OK as
    #    soon as its copy is issued: the events, not the answer, tell the client's GPU.
    from engine.copy.base import CopyDone
    h = _held_dispatcher()
    hashes = [b"f" * 32, b"g" * 32]
    _stored(h, 1, [1, 2], hashes)
    h.send(2, Opcode.LOAD, _save_payload([5, 6], hashes), 2, event_index=0)
    answer = h.completions.try_get()
    assert (answer.request_id, answer.opcode, answer.status) == (2, Opcode.LOAD, Status.OK)
    assert len(h.backend.held) == 1
    # 2. The copy ends: no second answer, and the entries are no longer pinned.
    h.dispatcher.on_copy_done(CopyDone(h.backend.held.pop()))
    assert h.completions.try_get() is None
    keys = [(7, k) for k in hash_keys(encode_hashes(hashes))]
    assert [h.dispatcher.index.entries[k].refs for k in keys] == [0, 0]


def test_dispatcher_fenced_load_refused_at_submit_is_not_answered_ok():
    # A copy the backend refuses at submit must not be answered OK: the client would wait
    # on events nobody records.
    h = _held_dispatcher(refuse=True)
    hashes = [b"h" * 32]
    keys = [(7, k) for k in hash_keys(encode_hashes(hashes))]
    h.dispatcher.index.reserve_many(keys, 4096, 1, 0)  # stored, without a copy
    h.dispatcher.index.mark_layers_done(keys, 1)
    h.send(3, Opcode.LOAD, _save_payload([5], hashes), 1, event_index=0)
    answer = h.completions.try_get()
    assert (answer.request_id, answer.status) == (3, Status.COPY_FAILED)
    assert h.completions.try_get() is None
    # Nothing of it stays in flight or pinned.
    assert h.client.num_inflight == 0 and h.dispatcher.pending == {}
    assert h.dispatcher.index.entries[keys[0]].refs == 0


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


def test_dispatcher_fault_in_the_middle_of_a_save_leaves_no_marks(monkeypatch):
    # 1. Chunks of 2 blocks; the backend takes the first chunk and fails (a bug, not a
    #    refusal) on the second.
    import engine.pending
    from engine.copy.base import CopyDone
    monkeypatch.setattr(engine.pending, "FIRST_CHUNK", 2)
    h = _held_dispatcher()
    submit = h.backend.submit

    def failing_submit(op):
        if h.backend.held:
            raise RuntimeError("backend bug")
        submit(op)

    monkeypatch.setattr(h.backend, "submit", failing_submit)
    hashes = [bytes([65 + i]) * 32 for i in range(6)]
    keys = [(7, k) for k in hash_keys(encode_hashes(hashes))]
    # 2. The fault reaches the caller (the server answers the command INTERNAL).
    with pytest.raises(RuntimeError, match="backend bug"):
        h.send(1, Opcode.SAVE, _save_payload(range(6), hashes), 6)
    # 3. The failed chunk's entries are gone (not left "on their way"), the third chunk was
    #    never reserved; the first chunk's copy is still in flight.
    index = h.dispatcher.index
    assert [k in index.entries for k in keys] == [True, True, False, False, False, False]
    assert h.client.num_inflight == 1
    # 4. It ends: its blocks are stored, and no second answer is written for the command.
    h.dispatcher.on_copy_done(CopyDone(h.backend.held.pop()))
    assert h.completions.try_get() is None
    assert [index.get_ready(k) is not None for k in keys[:2]] == [True, True]
    assert h.client.num_inflight == 0 and h.dispatcher.pending == {}
    # 5. The blocks of the failed chunk can be saved again: they are not deduped.
    monkeypatch.setattr(h.backend, "submit", submit)
    _stored(h, 2, [2, 3], hashes[2:4])
    assert [index.get_ready(k) is not None for k in keys[2:4]] == [True, True]


def test_dispatcher_fault_at_load_submit_unpins_and_releases_the_lease(monkeypatch):
    # 1. Two blocks stored and looked up (a lease pins them); the backend fails at the LOAD.
    h = _held_dispatcher()
    hashes = [b"u" * 32, b"v" * 32]
    keys = [(7, k) for k in hash_keys(encode_hashes(hashes))]
    _stored(h, 1, [1, 2], hashes)
    num_hits, lease_id = h.dispatcher.index.lookup(0, keys)
    assert num_hits == 2 and lease_id

    def failing_submit(op):
        raise RuntimeError("backend bug")

    monkeypatch.setattr(h.backend, "submit", failing_submit)
    with pytest.raises(RuntimeError, match="backend bug"):
        h.send(2, Opcode.LOAD, _save_payload([5, 6], hashes), 2, flags=CommandFlag.RELEASE_LEASE,
               arg=lease_id)
    # 2. Nothing stays pinned, the lease is gone, and no answer was written by the dispatcher.
    assert [h.dispatcher.index.entries[k].refs for k in keys] == [0, 0]
    assert lease_id not in h.dispatcher.index.leases
    assert h.completions.try_get() is None and h.client.num_inflight == 0


def test_dispatcher_after_client_load_waits_for_the_clients_last_event():
    from engine.copy.base import CopyDone
    # 1. A LOAD flagged AFTER_CLIENT: its copy waits for the last event of the client's
    #    pool (4 events: index 3), which the client recorded where its stream stood.
    h = _held_dispatcher()
    hashes = [b"w" * 32]
    _stored(h, 1, [1], hashes)
    h.send(2, Opcode.LOAD, _save_payload([5], hashes), 1, flags=CommandFlag.AFTER_CLIENT)
    (token,) = h.backend.held
    assert h.backend.ops[token].wait_event == 3 and h.backend.ops[token].direction.name == "LOAD"
    # 2. Without the flag, no wait.
    h.dispatcher.on_copy_done(CopyDone(token))
    h.send(3, Opcode.LOAD, _save_payload([6], hashes), 1)
    assert h.backend.ops[h.backend.held[-1]].wait_event is None


def test_dispatcher_after_client_load_without_events_is_refused():
    # A client that registered no events cannot be waited on: BAD_ARGUMENT, nothing copied.
    h = _held_dispatcher()
    hashes = [b"x" * 32]
    _stored(h, 1, [1], hashes)
    h.client.num_events = 0
    h.send(2, Opcode.LOAD, _save_payload([5], hashes), 1, flags=CommandFlag.AFTER_CLIENT)
    answer = h.completions.try_get()
    assert (answer.request_id, answer.status) == (2, Status.BAD_ARGUMENT) and h.backend.held == []
    # The stored block is not left pinned (it could never be evicted).
    keys = [(7, k) for k in hash_keys(encode_hashes(hashes))]
    assert h.dispatcher.index.entries[keys[0]].refs == 0


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
    h = _held_dispatcher()
    b = h.add_client(1)
    _stored(h, 1, [1], [b"y" * 32])  # something for B to load
    h.send(2, Opcode.SAVE, _save_payload([2], [b"z" * 32]), 1)
    h.send(3, Opcode.DETACH)
    (save_token,) = h.backend.held
    assert h.completions.try_get() is None  # neither the SAVE nor the DETACH is answered yet
    # 2. B's fenced LOAD goes ahead as usual meanwhile (answered at once: its events fence
    #    the data) and leaves A's copy alone: A still waits, its memory still registered.
    b.send(4, Opcode.LOAD, _save_payload([5], [b"y" * 32]), 1, event_index=0)
    assert b.completions.try_get().status == Status.OK
    assert h.completions.try_get() is None and h.backend.unregistered == []
    # 3. A's copy ends: its SAVE and DETACH are answered, and A's memory let go.
    h.backend.held.remove(save_token)
    h.dispatcher.on_copy_done(CopyDone(save_token))
    answers = []
    while (answer := h.completions.try_get()) is not None:
        answers.append((answer.request_id, answer.opcode))
    assert answers == [(2, Opcode.SAVE), (3, Opcode.DETACH)]
    assert h.backend.unregistered == [0] and h.client.num_inflight == 0
    for token in list(h.backend.held):
        h.dispatcher.on_copy_done(CopyDone(token))


def test_dispatcher_full_pool_evicts_a_saved_chain_from_its_tail(engine_factory, kv_client, rng,
                                                                 make_hashes):
    # 1. A pool of 16 entries; a 16-block chain saved in one SAVE fills it.
    engine = engine_factory(pool_size="256KiB", slab_size="64KiB")
    kv = kv_client(engine)
    chain = make_hashes(16)
    kv.fill(rng, range(17))
    assert kv.save(NAMESPACE, range(16), chain).value == 16
    # 2. One more block evicts the chain's last block, not its first: 15 blocks still hit
    #    (a lookup stops at the first miss: without its head the chain would be lost whole).
    assert kv.save(NAMESPACE, [16], make_hashes(1)).value == 1
    assert kv.num_hits(NAMESPACE, chain) == 15


def test_dispatcher_debug_log_says_where_a_saves_time_went(caplog):
    # 1. DEBUG logging on; a SAVE of two blocks whose copy ends when released.
    from engine.copy.base import CopyDone
    h = _held_dispatcher()
    with caplog.at_level(logging.DEBUG, logger="engine.transfers"):
        h.send(1, Opcode.SAVE, _save_payload([1, 2], [b"t" * 32, b"u" * 32]), 2)
        assert "SAVE of" not in caplog.text  # not done yet
        h.dispatcher.on_copy_done(CopyDone(h.backend.held.pop()))
    # 2. One line at its end: blocks, bytes, and each mark since it was received.
    [line] = [r.getMessage() for r in caplog.records if "SAVE of" in r.getMessage()]
    assert line.startswith("slot 0: SAVE of 2 blocks (0.0 MB): first copy handed to the backend after ")
    assert "all after " in line and "done after " in line and "nan" not in line


def test_dispatcher_save_sharing_a_layer_in_flight_leaves_the_block_to_it():
    # 1. Two clients of a two-layer geometry; the first saves layer 0 of a block (held).
    from engine.copy.base import LayerPlacement
    h = _held_dispatcher()
    second = h.add_client(1)
    for c in (h.client, second.client):
        c.layers = {0: LayerPlacement(0, 0, 0, 4096), 1: LayerPlacement(1, 0, 16 * 4096, 4096)}
    block = [b"k" * 32]
    h.send(1, Opcode.SAVE, _save_payload([3], block), 1, layer=0)
    [first_op] = h.backend.held
    # 2. The second saves every layer of it: layer 0 is in flight, so it copies nothing.
    second.send(2, Opcode.SAVE, _save_payload([5], block), 1)
    assert h.backend.held == [first_op]
    answer = second.completions.try_get()
    assert (answer.request_id, answer.status, answer.value2) == (2, Status.OK, 1)  # deduplicated


@pytest.mark.parametrize("loaded", [[0, 1, 2], [1, 2], [0, 2]], ids=["whole", "run", "not-a-run"])
def test_dispatcher_load_takes_over_its_lookups_lease(loaded):
    # 1. Three blocks stored and leased by a lookup.
    from engine.copy.base import CopyDone
    from pegaflow.client.completion import completion_of as _completion
    h = _held_dispatcher()
    hashes = [bytes([i + 1]) * 32 for i in range(3)]
    h.send(1, Opcode.SAVE, _save_payload([1, 2, 3], hashes), 3)
    h.dispatcher.on_copy_done(CopyDone(h.backend.held.pop()))
    h.send(2, Opcode.LOOKUP, encode_hashes(hashes).view(np.uint8), 3)
    answers = [_completion(h.completions.try_get()) for _ in range(2)]
    lease_id = answers[1].value2
    assert answers[1].value == 3 and lease_id in h.dispatcher.index.leases
    entries = list(h.dispatcher.index.entries.values())  # in the order saved
    # 2. A LOAD that names the lease: while its copy runs, each loaded block is pinned once
    #    (a run of the lease's blocks: the lease's pins, the lease gone, the others free;
    #    otherwise its own pins beside the lease's, the lease kept until the load ends).
    h.send(3, Opcode.LOAD, _save_payload([5, 6, 7][:len(loaded)], [hashes[i] for i in loaded]),
           len(loaded), flags=CommandFlag.RELEASE_LEASE, arg=lease_id)
    is_run = loaded != [0, 2]
    expected = [int(i in loaded) + (0 if is_run else 1) for i in range(3)]
    assert [e.refs for e in entries] == expected
    assert (lease_id in h.dispatcher.index.leases) is not is_run
    offsets = h.backend.ops[h.backend.held[-1]].entry_offsets.tolist()
    assert offsets == [entries[i].offset for i in loaded]
    # 3. The copy ends: answered OK, nothing pinned, no lease left.
    h.dispatcher.on_copy_done(CopyDone(h.backend.held.pop()))
    done = _completion(h.completions.try_get())
    assert (done.command_id, done.status, done.value) == (3, Status.OK, len(loaded))
    assert [e.refs for e in entries] == [0, 0, 0] and not h.dispatcher.index.leases


def test_dispatcher_one_event_save_waits_for_that_event_in_every_layer():
    # 1. A SAVE of every layer waiting on event 0: without the flag, layer k waits for
    #    event k (the client recorded one per layer as vLLM wrote them)...
    h = _held_dispatcher()
    h.send(1, Opcode.SAVE, _save_payload([1], [b"y" * 32]), 1, event_index=0)
    op = h.backend.ops[h.backend.held[-1]]
    assert (op.wait_event, op.wait_per_layer) == (0, True)
    # 2. ...with ONE_EVENT (a full CUDA graph replay ran no per-layer hook, and the client
    #    recorded one event after the forward) every layer waits for event 0 alone.
    h.send(2, Opcode.SAVE, _save_payload([2], [b"z" * 32]), 1, event_index=0,
           flags=CommandFlag.ONE_EVENT)
    op = h.backend.ops[h.backend.held[-1]]
    assert (op.wait_event, op.wait_per_layer) == (0, False)


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


def test_dispatcher_group_save_waits_for_one_event_per_layer_of_that_group():
    # 1. Three layers in two KV cache groups: layers 0 and 2 are group 0, layer 1 group 1.
    from engine.copy.base import LayerPlacement
    h = _held_dispatcher()
    h.client.layers = {i: LayerPlacement(i, 0, i * 16 * 4096, 4096) for i in range(3)}
    h.client.groups = {0: [0, 2], 1: [1]}
    # 2. A SAVE of group 0 copies its two layers only, the k-th waiting for event 2 + k.
    h.send(1, Opcode.SAVE, _save_payload([1], [b"g" * 32]), 1, event_index=2,
           flags=CommandFlag.LAYER_GROUP, layer=0)
    op = h.backend.ops[h.backend.held[-1]]
    assert [p.layer for p in op.layers] == [0, 2] and (op.wait_event, op.wait_per_layer) == (2, True)
    # 3. Events 3 and 4 for its two layers: past the client's 4 events, refused.
    h.send(2, Opcode.SAVE, _save_payload([2], [b"h" * 32]), 1, event_index=3,
           flags=CommandFlag.LAYER_GROUP, layer=0)
    answer = h.completions.try_get()
    assert (answer.request_id, answer.status) == (2, Status.BAD_ARGUMENT)


def test_dispatcher_has_a_handler_for_every_opcode():
    # An opcode added to the wire's enum without a handler here fails (and the engine's
    # dispatcher refuses to start).
    h = _held_dispatcher()
    assert set(h.dispatcher.handlers) == set(Opcode)


def test_dispatcher_refused_setup_commands_are_logged_once_per_client_and_opcode_per_interval(
        monkeypatch, caplog):
    # 1. A client sends 20 ATTACHes the engine refuses (voter 0 of 0 voters), another client
    #    one, and the first a refused REGISTER_EVENTS (a payload of no whole record).
    import engine.dispatcher
    from engine.slow_commands import REFUSAL_EVERY_S
    now = [100.0]
    monkeypatch.setattr(engine.dispatcher, "monotonic", lambda: now[0])
    h = _held_dispatcher()
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
