"""Every field a client can write in shared memory, written with values no client should
write: the engine lives, refuses or closes that client (counted), and another client's
blocks load back exactly; a claim under a pid not the claimant's is never held."""

from __future__ import annotations

import contextlib
import os
import signal

import numpy as np
import pytest

from engine.clients.client_table import ATTACH_TIMEOUT_S
from pegaflow.client.connection import EngineClient
from pegaflow.platform.errors import CommandError, RingFullError
from pegaflow.platform.wire import RING_HEADER, SLOT, Opcode, SlotState, Status
from tests.engine.conftest import KVClient
from tests.engine.shm_fields import SlotTable, connect_on_slot, ring_header, slot_record

NUM_SLOTS = 12
ALL_ONES = {"<u4": 2**32 - 1, "<u8": 2**64 - 1}  # one value per field here; the fuzz test tries others


@pytest.fixture(scope="module")
def fields_engine(tmp_path_factory):
    from tests.conftest import EngineHarness
    harness = EngineHarness(tmp_path_factory.mktemp("fields"))
    yield harness.start(max_clients=NUM_SLOTS)
    harness.stop_all()


@pytest.fixture(scope="module")
def honest(fields_engine):
    client = KVClient(fields_engine.name)
    yield client
    client.close()


@pytest.fixture(autouse=True)
def _slots_reclaimed(fields_engine, honest):
    """Each case starts with every slot but the honest client's free: the rogues of the cases
    before are reclaimed (all 12 slots taken at once otherwise, on a loaded machine)."""
    table = SlotTable(fields_engine.name)
    try:
        table.wait_all_free_but(1)
    finally:
        table.close()


def _assert_serving(engine, honest: KVClient, rng) -> None:
    """The engine runs, and a block stored now loads back byte for byte."""
    assert engine.proc.poll() is None, engine.stderr_text()[-2000:]
    namespace = int(rng.integers(1, 2**62))
    hashes, saved = honest.store(rng, namespace, [1, 2])
    honest.pages[:, [5, 6]] = 0
    assert honest.load(namespace, [5, 6], hashes).is_ok
    np.testing.assert_array_equal(honest.pages[:, [5, 6]], saved)


def _cases():
    for part, dtype in (("slot", SLOT), ("ring", RING_HEADER)):
        for field in dtype.names:
            yield part, field, ALL_ONES[dtype.fields[field][0].str]


@pytest.mark.parametrize("part,field,value", list(_cases()))
def test_client_fields_any_value_leaves_the_engine_serving(fields_engine, honest, rng, part, field, value):
    # 1. A client writes the value into its own slot record or ring header, sends a PING
    #    and goes (its ring says closed: the engine reclaims the slot, or has closed it).
    rogue = EngineClient.connect(fields_engine.name, timeout_s=10.0)
    slot = rogue.slot
    record = slot_record(rogue) if part == "slot" else ring_header(rogue)
    record[field] = value
    rogue.submit(Opcode.PING)
    rogue.close(detach=False)
    # 2. The slot comes free again, and a client that claims it is served: claiming it
    #    resets its ring from the engine's own counters, not the values written.
    table = SlotTable(fields_engine.name)
    try:
        if int(table.slots["state"][slot]) != SlotState.FREE:
            table.wait_state(slot, SlotState.FREE)
        again, others = connect_on_slot(fields_engine.name, slot, NUM_SLOTS)
        assert again.ping() == 0
        for client in [again, *others]:
            client.close()
    finally:
        table.close()
    # 3. The engine lives and another client's blocks are exact.
    _assert_serving(fields_engine, honest, rng)


@pytest.mark.parametrize("pid", [2**31 + 5, 2**32 - 1, 0, 1, "engine", "dead"])
def test_client_fields_claim_under_no_claimants_pid_is_refused(fields_engine, honest, rng, pid):
    # 1. A slot claimed under a pid no client of ours can have: past any pid, 0, init,
    #    the engine itself, a process that has exited.
    if pid == "engine":
        pid = fields_engine.pid
    elif pid == "dead":
        child = os.fork()
        if child == 0:
            os._exit(0)
        os.waitpid(child, 0)
        pid = child
    refused = fields_engine.stats().get("clients_refused", 0)
    table = SlotTable(fields_engine.name)
    try:
        slot = table.claim(pid)
        # 2. The engine frees it (never ACTIVE, never held) and counts the refusal.
        table.wait_state(slot, SlotState.FREE)
    finally:
        table.close()
    fields_engine.wait_stats(lambda s: s["clients_refused"] > refused)
    _assert_serving(fields_engine, honest, rng)


def test_client_fields_claim_never_attached_is_reclaimed(fields_engine, honest, rng):
    # 1. A real process of ours claims a slot (it maps the control segment) and never
    #    sends ATTACH.
    table = SlotTable(fields_engine.name)
    try:
        slot = table.claim(os.getpid())
        table.wait_state(slot, SlotState.ACTIVE)
        refused = fields_engine.stats().get("clients_refused", 0)
        # 2. Past the attach timeout (and a housekeeping pass) its slot is free again.
        table.wait_state(slot, SlotState.FREE, timeout_s=ATTACH_TIMEOUT_S + 30.0)
    finally:
        table.close()
    assert fields_engine.stats().get("clients_refused", 0) > refused
    _assert_serving(fields_engine, honest, rng)


@pytest.mark.parametrize("pid", [0, 1, "engine", "child"])
def test_client_fields_attach_naming_another_pid_is_refused(fields_engine, pid):
    # 1. A client ATTACHes again naming a pid not its own: nothing, init, the engine (which
    #    maps every ring) or a child of its own (which maps the ring too, by inheritance).
    client = EngineClient.connect(fields_engine.name, timeout_s=10.0)
    child = 0
    try:
        if pid == "engine":
            pid = fields_engine.pid
        elif pid == "child":
            child = pid = os.fork()
            if child == 0:
                signal.pause()
                os._exit(0)
        # 2. Refused with BAD_ARGUMENT; the client stays attached under its own pid.
        with pytest.raises(CommandError) as info:
            client.call(Opcode.ATTACH, arg=pid)
        assert info.value.status == Status.BAD_ARGUMENT
        assert client.ping() == 0
    finally:
        if child:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
        client.close()


def test_client_fields_slot_state_rewritten_closes_that_client(fields_engine, honest, rng):
    # 1. An attached client writes a state that is no state into its slot.
    client = EngineClient.connect(fields_engine.name, timeout_s=10.0)
    refused = fields_engine.stats().get("clients_refused", 0)
    slot_record(client)["state"] = 7
    # 2. The engine closes it, counts it, and frees the slot for the next claimant.
    fields_engine.wait_stats(lambda s: s["clients_refused"] > refused)
    table = SlotTable(fields_engine.name)
    try:
        table.wait_state(client.slot, SlotState.FREE)
    finally:
        table.close()
    client.close(detach=False)
    _assert_serving(fields_engine, honest, rng)


@pytest.mark.parametrize("ring", ["submissions", "completions"])
@pytest.mark.parametrize("value", [0, 1, 2**63, 2**64 - 1])
def test_client_fields_seq_words_of_its_rings_any_value_leaves_the_engine_serving(
        fields_engine, honest, rng, ring, value):
    # 1. A client writes the value into every seq word (the rings' counters) of one of its
    #    rings, sends a PING and goes.
    rogue = EngineClient.connect(fields_engine.name, timeout_s=10.0)
    getattr(rogue._view, ring)["seq"] = value
    with contextlib.suppress(RingFullError):  # its own ring may look full to it now
        rogue.submit(Opcode.PING, timeout_s=0.01)
    rogue.close(detach=False)
    # 2. The engine lives and another client's blocks are exact.
    _assert_serving(fields_engine, honest, rng)


@pytest.mark.parametrize("offset,num_bytes", [(2**64 - 1, 1), (2**64 - 8, 16), (0, 2**32 - 1),
                                              (2**63, 2**31)])
def test_client_fields_payload_past_the_arena_is_bad_payload(fields_engine, honest, rng, offset, num_bytes):
    # A command whose arena offset and size lie past the arena (or wrap 64 bits): refused
    # with BAD_PAYLOAD, answered once; the engine serves on.
    client = KVClient(fields_engine.name)
    try:
        request_id = client.submit_raw(opcode=Opcode.LOOKUP, num_items=1, payload_offset=offset,
                                       payload_bytes=num_bytes, namespace=1)
        assert int(client.take_raw(request_id)["status"]) == Status.BAD_PAYLOAD
        assert client.client.ping() == 0
    finally:
        client.close()
    _assert_serving(fields_engine, honest, rng)
