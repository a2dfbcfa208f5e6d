"""engine/commands/issuing.py: a long SAVE or LOAD issued a slice per loop turn, other clients served in
between, and its own client's next command only after it (the held in-memory dispatcher,
whose backend holds each copy until the test ends it; then a real engine process)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.copy.base import CopyDone
from pegaflow.platform.wire import Opcode, Status, encode_hashes, hash_keys
from tests.conftest import shm_leftovers
from tests.engine.commands.held_dispatcher import held_dispatcher, save_payload, store_blocks

NAMESPACE = 7  # the in-memory clients' commands' namespace
HASHES = [bytes([65 + i]) * 32 for i in range(6)]
KEYS = [(NAMESPACE, k) for k in hash_keys(encode_hashes(HASHES))]


@pytest.fixture
def sliced(monkeypatch):
    """The held dispatcher issuing one step a turn: chunks of 2 blocks, LOAD ops of 2."""
    import engine.commands.pending_copy
    import engine.commands.transfers
    monkeypatch.setattr(engine.commands.pending_copy, "FIRST_CHUNK", 2)
    monkeypatch.setattr(engine.commands.transfers, "LOAD_OP_BLOCKS", 2)
    h = held_dispatcher()
    h.issuing = h.dispatcher.transfers.issuing
    h.issuing.slice_s = 0.0
    return h


def _stored_whole(h) -> None:
    """The six blocks stored (issued in one go), then back to a step a turn."""
    h.issuing.slice_s = float("inf")
    store_blocks(h, 1, range(6), HASHES)
    h.issuing.slice_s = 0.0


def _land(h) -> None:
    for token in list(h.backend.held):
        h.backend.held.remove(token)
        h.dispatcher.on_copy_done(CopyDone(token))


def test_issuing_a_long_save_goes_a_chunk_a_turn_with_other_clients_served_between(sliced):
    h = sliced
    other = h.add_client(1)
    # 1. A SAVE of three chunks: only its first is issued by its handling; it is not answered,
    #    and counts in its client's commands in flight (its memory stays registered).
    h.send(1, Opcode.SAVE, save_payload(range(6), HASHES), 6)
    assert len(h.backend.ops) == 1 and h.issuing.is_issuing(h.client) and h.client.num_inflight == 2
    assert h.issuing.is_issuing_save(h.client, NAMESPACE) and not h.issuing.is_issuing_save(h.client, 8)
    assert [k in h.dispatcher.index.entries for k in KEYS] == [True, True, False, False, False, False]
    # 2. Another client's PING is answered meanwhile.
    other.send(1, Opcode.PING)
    assert other.completions.try_get().status == Status.OK
    # 3. A turn issues the next chunk, the next the last; the copies land: answered once, whole.
    h.issuing.more()
    assert len(h.backend.ops) == 2 and h.completions.try_get() is None
    h.issuing.more()
    assert len(h.backend.ops) == 3 and not h.issuing
    _land(h)
    answer = h.completions.try_get()
    assert (answer.status, answer.value) == (Status.OK, 6) and h.completions.try_get() is None
    assert all(h.dispatcher.index.get_ready(k) is not None for k in KEYS) and h.client.num_inflight == 0


def test_issuing_a_long_load_pins_every_block_before_any_copy_then_an_op_a_turn(sliced):
    h = sliced
    _stored_whole(h)
    # 1. A LOAD of six blocks (three chunks) builds its keys a chunk a turn, finds and pins
    #    its blocks a chunk a turn, no copy issued yet; then issues an op of two blocks a turn.
    num_saves = len(h.backend.ops)
    h.send(2, Opcode.LOAD, save_payload(range(8, 14), HASHES), 6)
    num_ops = [len(h.backend.ops) - num_saves]
    while h.issuing:
        h.issuing.more()
        num_ops.append(len(h.backend.ops) - num_saves)
    assert num_ops == [0, 0, 0, 0, 1, 2, 3]
    assert not h.issuing and h.completions.try_get() is None
    assert [h.dispatcher.index.entries[k].refs for k in KEYS] == [1] * 6
    _land(h)
    answer = h.completions.try_get()
    assert (answer.status, answer.value) == (Status.OK, 6)
    assert [h.dispatcher.index.entries[k].refs for k in KEYS] == [0] * 6 and h.client.num_inflight == 0


def test_issuing_a_load_whose_block_is_gone_by_a_later_turn_copies_nothing(sliced):
    # 1. Six blocks stored; a LOAD of them is issued a step a turn; before it reaches the
    #    fifth block, that block is dropped.
    h = sliced
    _stored_whole(h)
    num_saves = len(h.backend.ops)
    h.send(2, Opcode.LOAD, save_payload(range(8, 14), HASHES), 6)
    h.issuing.more()
    h.dispatcher.index.drop_entry(KEYS[4])
    while h.issuing:
        h.issuing.more()
    # 2. Answered MISSING_BLOCK, no copy issued, no block left pinned.
    assert h.completions.try_get().status == Status.MISSING_BLOCK
    assert len(h.backend.ops) == num_saves and h.client.num_inflight == 0
    assert all(e.refs == 0 for e in h.dispatcher.index.entries.values())


def test_issuing_stops_for_a_client_that_left(sliced):
    # A client gone while its SAVE is issued: the rest is not issued, the chunk in flight
    # ends, and the client holds nothing in flight after (its slot may be reclaimed).
    h = sliced
    h.send(1, Opcode.SAVE, save_payload(range(6), HASHES), 6)
    h.client.is_attached = False
    h.issuing.more()
    assert not h.issuing and len(h.backend.ops) == 1
    _land(h)
    assert h.client.num_inflight == 0 and h.completions.try_get().status == Status.COPY_FAILED
    assert not any(k in h.dispatcher.index.writing for k in KEYS)


def test_issuing_holds_back_the_clients_next_command_until_its_save_is_issued(engine_factory, kv_client, rng,
                                                                             make_hashes):
    # 1. One client sends a SAVE of 10,000 blocks (issued over several loop turns) and, without
    #    waiting, a LOOKUP of the same blocks.
    engine = engine_factory(pool_size="256MiB", extra=("--lookup-wait-ms", "10000"))
    kv = kv_client(engine)
    num_blocks = 10_000
    hashes = make_hashes(num_blocks)
    ids = np.arange(num_blocks) % kv.NUM_BLOCKS
    kv.fill(rng, range(kv.NUM_BLOCKS))
    save = kv.client.submit_save(0x1551, ids, hashes)
    lookup = kv.client.submit_lookup(0x1551, hashes)
    # 2. The LOOKUP was read only once the SAVE was issued whole: it finds (or waits for) every
    #    block, none missing because the SAVE had not reached it yet.
    assert kv.client.wait(save, 60).value == num_blocks
    assert kv.client.wait(lookup, 60).result.num_hit_blocks == num_blocks


def test_issuing_a_long_chains_eviction_order_is_given_over_turns_tail_first(sliced, monkeypatch):
    # 1. A SAVE of six blocks lands; its chain's eviction order is given two keys a turn.
    import engine.commands.issuing
    monkeypatch.setattr(engine.commands.issuing, "TOUCH_STEP", 2)
    h = sliced
    h.issuing.slice_s = float("inf")
    h.send(1, Opcode.SAVE, save_payload(range(6), HASHES), 6)
    h.issuing.slice_s = 0.0
    _land(h)
    assert h.completions.try_get().status == Status.OK
    order = h.dispatcher.index.policy._order
    # 2. At its answer, its tail's two keys; a turn later the next two; then the head, which
    #    ends the most recently used (a chain is evicted from its tail).
    assert list(order)[-2:] == [KEYS[5], KEYS[4]] and h.issuing
    h.issuing.more()
    assert list(order)[-4:] == [KEYS[5], KEYS[4], KEYS[3], KEYS[2]]
    h.issuing.more()
    assert list(order) == KEYS[::-1] and not h.issuing


def test_issuing_two_commands_of_one_client_each_go_to_their_end(sliced):
    # A LOAD parked on the disk tier's reads is resumed while its client's later SAVE is
    # still being issued (the dispatcher handles it then, whatever the server reads): both
    # are issued to their end and each is answered once.
    h = sliced
    _stored_whole(h)
    h.send(2, Opcode.SAVE, save_payload(range(6), [b"s" * 31 + bytes([i]) for i in range(6)]), 6)
    h.send(3, Opcode.LOAD, save_payload(range(8, 14), HASHES), 6)
    assert len(h.issuing.items) == 2 and h.issuing.slots == {0: 2}
    while h.issuing:
        h.issuing.more()
    _land(h)
    answers = sorted((a.command_id, a.status, a.value) for a in iter(h.completions.try_get, None))
    assert answers == [(2, Status.OK, 6), (3, Status.OK, 6)] and h.client.num_inflight == 0


def test_issuing_chunks_are_bounded_contiguous_and_cover_every_block():
    # A step of a SAVE or LOAD handles one chunk: none is longer than MAX_CHUNK, the first and
    # the last at most FIRST_CHUNK, and together they are every block once, in order (up to
    # the largest SAVE measured, 190,650 blocks).
    from engine.commands.pending_copy import FIRST_CHUNK, MAX_CHUNK, chunk_bounds
    for num_blocks in (1, FIRST_CHUNK, FIRST_CHUNK + 1, 2 * FIRST_CHUNK + 1, 5000, 190_650):
        chunks = list(chunk_bounds(num_blocks))
        assert [start for start, _ in chunks] == [0] + [end for _, end in chunks[:-1]]
        assert chunks[-1][1] == num_blocks and all(end > start for start, end in chunks)
        assert max(end - start for start, end in chunks) <= MAX_CHUNK
        assert chunks[0][1] <= FIRST_CHUNK and chunks[-1][1] - chunks[-1][0] <= FIRST_CHUNK
    assert len(list(chunk_bounds(190_650))) > 190_650 // MAX_CHUNK  # (a long one is many steps)


def test_issuing_the_loop_answers_another_clients_ping_between_a_long_saves_chunks(rng, make_hashes):
    # 1. An engine served in this process by a thread until both clients are in, then a loop
    #    turn only when the test takes one; each turn issues one step (one chunk) of a SAVE.
    import os
    import threading
    import time

    from engine.commands.pending_copy import chunk_bounds
    from engine.config import EngineConfig
    from engine.process.server import EngineServer
    from pegaflow.platform.protocol import Ping
    from tests.engine.conftest import KVClient
    server = EngineServer(EngineConfig(name=f"t{os.getpid()}_turns", backend="host", pool_bytes=32 << 20,
                                       slab_bytes=1 << 20, num_slots=3), serve_own_process=True)
    handed_over = threading.Event()

    def serve() -> None:
        while not handed_over.is_set():
            server.run_once(time.monotonic())
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    clients = []
    try:
        saver, pinger = KVClient(server.config.name), KVClient(server.config.name)
        clients += [saver, pinger]
        handed_over.set()
        thread.join(30)
        server.dispatcher.transfers.issuing.slice_s = 0.0
        # 2. A SAVE of 1,000 blocks (five chunks) and another client's PING.
        num_blocks = 1000
        saver.fill(rng, range(saver.NUM_BLOCKS))
        save = saver.client.submit_save(0x7E, np.arange(num_blocks) % saver.NUM_BLOCKS, make_hashes(num_blocks))
        chunk_ends = [end for _, end in chunk_bounds(num_blocks)]
        # 3. Each turn answers that turn's PING while the SAVE is still being issued, and
        #    issues one chunk of it more (the first turn two: its handling's, then the turn's
        #    slice); the SAVE is answered, whole, once its last chunk is issued and copied.
        for num_reserved in chunk_ends[1:]:
            assert server.dispatcher.transfers.issuing or num_reserved == chunk_ends[1]
            ping = pinger.client.submit(Ping())
            server.run_once(time.monotonic())
            assert pinger.take_raw(ping)["status"] == Status.OK
            assert len(server.index.entries) == num_reserved
        assert not server.dispatcher.transfers.issuing
        server.run_once(time.monotonic())
        assert saver.take_raw(save)["value"] == num_blocks
    finally:
        handed_over.set()
        thread.join(30)
        thread = threading.Thread(target=server.serve_forever, daemon=True)  # (the clients detach)
        thread.start()
        for client in clients:
            client.close()
        server.request_stop()
        thread.join(30)
    assert not thread.is_alive() and shm_leftovers(server.config.name) == []
