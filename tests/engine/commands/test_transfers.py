"""engine.commands.transfers in process: SAVE and LOAD checked, planned against the index, handed
to a backend that holds every copy, and answered exactly once (fenced, refused, failing,
revoked, sharing a layer in flight)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from pegaflow.platform.wire import CommandFlag, Opcode, Status, encode_hashes, hash_keys
from tests.engine.commands.held_dispatcher import held_dispatcher, save_payload, store_blocks


def test_transfers_revoked_saves_store_nothing():
    # 1. A SAVE is in flight; then the client revokes its saves (it stopped waiting and may
    #    reuse the blocks): the copy ends, but nothing is stored and the SAVE fails.
    from engine.copy.base import CopyDone
    h = held_dispatcher()
    hashes = [b"r" * 32, b"s" * 32]
    h.send(1, Opcode.SAVE, save_payload([3, 4], hashes), 2)
    h.view.header["revoked"] = 1
    h.dispatcher.on_copy_done(CopyDone(h.backend.held.pop()))
    answer = h.completions.try_get()
    assert (answer.command_id, answer.status) == (1, Status.COPY_FAILED)
    keys = [(7, k) for k in hash_keys(encode_hashes(hashes))]
    assert all(h.dispatcher.index.get_ready(k) is None for k in keys)
    assert h.dispatcher.index.pool.num_entries == 0
    # 2. A SAVE that arrives after the revocation is refused without a copy.
    h.send(2, Opcode.SAVE, save_payload([5], [b"t" * 32]), 1)
    answer = h.completions.try_get()
    assert (answer.command_id, answer.status) == (2, Status.BAD_ARGUMENT) and h.backend.held == []


def test_transfers_fenced_load_is_answered_at_issue_once():
    # 1. Blocks stored; a LOAD fenced by the client's events (event_index) is answered OK as
    #    soon as its copy is issued: the events, not the answer, tell the client's GPU.
    from engine.copy.base import CopyDone
    h = held_dispatcher()
    hashes = [b"f" * 32, b"g" * 32]
    store_blocks(h, 1, [1, 2], hashes)
    h.send(2, Opcode.LOAD, save_payload([5, 6], hashes), 2, event_index=0)
    answer = h.completions.try_get()
    assert (answer.command_id, answer.opcode, answer.status) == (2, Opcode.LOAD, Status.OK)
    assert len(h.backend.held) == 1
    # 2. The copy ends: no second answer, and the entries are no longer pinned.
    h.dispatcher.on_copy_done(CopyDone(h.backend.held.pop()))
    assert h.completions.try_get() is None
    keys = [(7, k) for k in hash_keys(encode_hashes(hashes))]
    assert [h.dispatcher.index.entries[k].refs for k in keys] == [0, 0]


def test_transfers_fenced_load_refused_at_submit_is_not_answered_ok():
    # A copy the backend refuses at submit must not be answered OK: the client would wait
    # on events nobody records.
    h = held_dispatcher(refuse=True)
    hashes = [b"h" * 32]
    keys = [(7, k) for k in hash_keys(encode_hashes(hashes))]
    h.dispatcher.index.reserve_many(keys, 4096, 1, 0)  # stored, without a copy
    h.dispatcher.index.mark_layers_done(keys, 1)
    h.send(3, Opcode.LOAD, save_payload([5], hashes), 1, event_index=0)
    answer = h.completions.try_get()
    assert (answer.command_id, answer.status) == (3, Status.COPY_FAILED)
    assert h.completions.try_get() is None
    # Nothing of it stays in flight or pinned.
    assert h.client.num_inflight == 0 and h.dispatcher.pending == {}
    assert h.dispatcher.index.entries[keys[0]].refs == 0


def test_transfers_fault_in_the_middle_of_a_save_leaves_no_marks(monkeypatch):
    # 1. Chunks of 2 blocks; the backend takes the first chunk and fails (a bug, not a
    #    refusal) on the second.
    import engine.commands.pending_copy
    from engine.copy.base import CopyDone
    monkeypatch.setattr(engine.commands.pending_copy, "FIRST_CHUNK", 2)
    h = held_dispatcher()
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
        h.send(1, Opcode.SAVE, save_payload(range(6), hashes), 6)
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
    store_blocks(h, 2, [2, 3], hashes[2:4])
    assert [index.get_ready(k) is not None for k in keys[2:4]] == [True, True]


def test_transfers_fault_at_load_submit_unpins_and_releases_the_lease(monkeypatch):
    # 1. Two blocks stored and looked up (a lease pins them); the backend fails at the LOAD.
    h = held_dispatcher()
    hashes = [b"u" * 32, b"v" * 32]
    keys = [(7, k) for k in hash_keys(encode_hashes(hashes))]
    store_blocks(h, 1, [1, 2], hashes)
    num_hits, lease_id = h.dispatcher.index.lookup(0, keys)
    assert num_hits == 2 and lease_id

    def failing_submit(op):
        raise RuntimeError("backend bug")

    monkeypatch.setattr(h.backend, "submit", failing_submit)
    with pytest.raises(RuntimeError, match="backend bug"):
        h.send(2, Opcode.LOAD, save_payload([5, 6], hashes), 2, flags=CommandFlag.RELEASE_LEASE,
               arg=lease_id)
    # 2. Nothing stays pinned, the lease is gone, and no answer was written by the dispatcher.
    assert [h.dispatcher.index.entries[k].refs for k in keys] == [0, 0]
    assert lease_id not in h.dispatcher.index.leases
    assert h.completions.try_get() is None and h.client.num_inflight == 0


def test_transfers_after_client_load_waits_for_the_clients_last_event():
    from engine.copy.base import CopyDone
    # 1. A LOAD flagged AFTER_CLIENT: its copy waits for the last event of the client's
    #    pool (4 events: index 3), which the client recorded where its stream stood.
    h = held_dispatcher()
    hashes = [b"w" * 32]
    store_blocks(h, 1, [1], hashes)
    h.send(2, Opcode.LOAD, save_payload([5], hashes), 1, flags=CommandFlag.AFTER_CLIENT)
    (token,) = h.backend.held
    assert h.backend.ops[token].wait_event == 3 and h.backend.ops[token].direction.name == "LOAD"
    # 2. Without the flag, no wait.
    h.dispatcher.on_copy_done(CopyDone(token))
    h.send(3, Opcode.LOAD, save_payload([6], hashes), 1)
    assert h.backend.ops[h.backend.held[-1]].wait_event is None


def test_transfers_after_client_load_without_events_is_refused():
    # A client that registered no events cannot be waited on: BAD_ARGUMENT, nothing copied.
    h = held_dispatcher()
    hashes = [b"x" * 32]
    store_blocks(h, 1, [1], hashes)
    h.client.num_events = 0
    h.send(2, Opcode.LOAD, save_payload([5], hashes), 1, flags=CommandFlag.AFTER_CLIENT)
    answer = h.completions.try_get()
    assert (answer.command_id, answer.status) == (2, Status.BAD_ARGUMENT) and h.backend.held == []
    # The stored block is not left pinned (it could never be evicted).
    keys = [(7, k) for k in hash_keys(encode_hashes(hashes))]
    assert h.dispatcher.index.entries[keys[0]].refs == 0


def test_transfers_debug_log_says_where_a_saves_time_went(caplog):
    # 1. DEBUG logging on; a SAVE of two blocks whose copy ends when released.
    from engine.copy.base import CopyDone
    h = held_dispatcher()
    with caplog.at_level(logging.DEBUG, logger="engine.commands.transfers"):
        h.send(1, Opcode.SAVE, save_payload([1, 2], [b"t" * 32, b"u" * 32]), 2)
        assert "SAVE of" not in caplog.text  # not done yet
        h.dispatcher.on_copy_done(CopyDone(h.backend.held.pop()))
    # 2. One line at its end: blocks, bytes, and each mark since it was received.
    [line] = [r.getMessage() for r in caplog.records if "SAVE of" in r.getMessage()]
    assert line.startswith("slot 0: SAVE of 2 blocks (0.0 MB): first copy handed to the backend after ")
    assert "all after " in line and "done after " in line and "nan" not in line


def test_transfers_save_sharing_a_layer_in_flight_leaves_the_block_to_it():
    # 1. Two clients of a two-layer geometry; the first saves layer 0 of a block (held).
    from engine.copy.base import LayerPlacement
    h = held_dispatcher()
    second = h.add_client(1)
    for c in (h.client, second.client):
        c.layers = {0: LayerPlacement(0, 0, 0, 4096), 1: LayerPlacement(1, 0, 16 * 4096, 4096)}
    block = [b"k" * 32]
    h.send(1, Opcode.SAVE, save_payload([3], block), 1, layer=0)
    [first_op] = h.backend.held
    # 2. The second saves every layer of it: layer 0 is in flight, so it copies nothing.
    second.send(2, Opcode.SAVE, save_payload([5], block), 1)
    assert h.backend.held == [first_op]
    answer = second.completions.try_get()
    assert (answer.command_id, answer.status, answer.value2) == (2, Status.OK, 1)  # deduplicated


@pytest.mark.parametrize("loaded", [[0, 1, 2], [1, 2], [0, 2]], ids=["whole", "run", "not-a-run"])
def test_transfers_load_takes_over_its_lookups_lease(loaded):
    # 1. Three blocks stored and leased by a lookup.
    from engine.copy.base import CopyDone
    from pegaflow.platform.protocol import completion_of as _completion
    h = held_dispatcher()
    hashes = [bytes([i + 1]) * 32 for i in range(3)]
    h.send(1, Opcode.SAVE, save_payload([1, 2, 3], hashes), 3)
    h.dispatcher.on_copy_done(CopyDone(h.backend.held.pop()))
    h.send(2, Opcode.LOOKUP, encode_hashes(hashes).view(np.uint8), 3)
    answers = [_completion(h.completions.try_get()) for _ in range(2)]
    lease_id = answers[1].value2
    assert answers[1].value == 3 and lease_id in h.dispatcher.index.leases
    entries = list(h.dispatcher.index.entries.values())  # in the order saved
    # 2. A LOAD that names the lease: while its copy runs, each loaded block is pinned once
    #    (a run of the lease's blocks: the lease's pins, the lease gone, the others free;
    #    otherwise its own pins beside the lease's, the lease kept until the load ends).
    h.send(3, Opcode.LOAD, save_payload([5, 6, 7][:len(loaded)], [hashes[i] for i in loaded]),
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


def test_transfers_one_event_save_waits_for_that_event_in_every_layer():
    # 1. A SAVE of every layer waiting on event 0: without the flag, layer k waits for
    #    event k (the client recorded one per layer as vLLM wrote them)...
    h = held_dispatcher()
    h.send(1, Opcode.SAVE, save_payload([1], [b"y" * 32]), 1, event_index=0)
    op = h.backend.ops[h.backend.held[-1]]
    assert (op.wait_event, op.wait_per_layer) == (0, True)
    # 2. ...with ONE_EVENT (a full CUDA graph replay ran no per-layer hook, and the client
    #    recorded one event after the forward) every layer waits for event 0 alone.
    h.send(2, Opcode.SAVE, save_payload([2], [b"z" * 32]), 1, event_index=0,
           flags=CommandFlag.ONE_EVENT)
    op = h.backend.ops[h.backend.held[-1]]
    assert (op.wait_event, op.wait_per_layer) == (0, False)


def test_transfers_group_save_waits_for_one_event_per_layer_of_that_group():
    # 1. Three layers in two KV cache groups: layers 0 and 2 are group 0, layer 1 group 1.
    from engine.copy.base import LayerPlacement
    h = held_dispatcher()
    h.client.layers = {i: LayerPlacement(i, 0, i * 16 * 4096, 4096) for i in range(3)}
    h.client.groups = {0: [0, 2], 1: [1]}
    # 2. A SAVE of group 0 copies its two layers only, the k-th waiting for event 2 + k.
    h.send(1, Opcode.SAVE, save_payload([1], [b"g" * 32]), 1, event_index=2,
           flags=CommandFlag.LAYER_GROUP, layer=0)
    op = h.backend.ops[h.backend.held[-1]]
    assert [p.layer for p in op.layers] == [0, 2] and (op.wait_event, op.wait_per_layer) == (2, True)
    # 3. Events 3 and 4 for its two layers: past the client's 4 events, refused.
    h.send(2, Opcode.SAVE, save_payload([2], [b"h" * 32]), 1, event_index=3,
           flags=CommandFlag.LAYER_GROUP, layer=0)
    answer = h.completions.try_get()
    assert (answer.command_id, answer.status) == (2, Status.BAD_ARGUMENT)
