"""pegaflow/platform/protocol/codec.py: each command comes back from its wire record exactly as it
was sent, a record that says more or less than its command is refused, and an answer is read
back with its status typed."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest

from pegaflow.platform import protocol, wire
from pegaflow.platform.errors import CommandError
from pegaflow.platform.protocol import Load, Lookup, Prefill, Register, Reset
from pegaflow.platform.wire import EVENT_HANDLE, REGION, CommandFlag, Opcode, RegionKind, Status
from tests.pegaflow.platform.protocol.samples import (
    GPU_UUID,
    one_command_per_opcode,
    random_hashes,
    region_and_layers,
    round_trip,
    same,
    submission,
)


@pytest.mark.parametrize("command", one_command_per_opcode(), ids=lambda c: type(c).__name__)
def test_protocol_command_decodes_as_it_was_encoded(command):
    back = round_trip(command)
    assert type(back) is type(command)
    for field in fields(command):
        mine, theirs = getattr(command, field.name), getattr(back, field.name)
        assert same(mine, theirs), field.name


def test_protocol_register_carries_the_clients_gpu_uuid_and_ordinal_byte_for_byte():
    # 1. A client's REGISTER, through the codec as the engine receives it.
    region, layers = region_and_layers()
    back = round_trip(Register(5, region[0], layers))
    # 2. The engine reads the GPU's UUID the client exported, and the client's own ordinal.
    assert back.region["gpu_uuid"].tobytes() == GPU_UUID
    assert int(back.region["client_device"]) == 2
    assert back.region["kind"] == RegionKind.CUDA_IPC and back.region.dtype == REGION


def test_protocol_load_flags_say_what_the_load_means():
    ids, hashes = [1], random_hashes(1)
    flags = lambda **kw: protocol.encode(Load(1, ids, hashes, **kw)).flags  # noqa: E731
    assert flags() == CommandFlag.NONE
    assert flags(lease_id=5) == CommandFlag.RELEASE_LEASE
    assert flags(lease_id=5, ends_lease=False) == CommandFlag.LEASE_HELD
    assert flags(after_client=True, group=1) == CommandFlag.AFTER_CLIENT | CommandFlag.LAYER_GROUP
    assert protocol.last_pool_event(8) == 7 and protocol.layer_event(4, 2) == 6


@pytest.mark.parametrize("opcode,payload,num_items", [
    (Opcode.LOOKUP, random_hashes(2).view(np.uint8)[:-1], 2),
    (Opcode.DROP, random_hashes(2).view(np.uint8), 3),
    (Opcode.SAVE, np.zeros(8, np.uint8), 1),
    (Opcode.REGISTER, np.zeros(REGION.itemsize, np.uint8), 1),
    (Opcode.REGISTER_EVENTS, np.zeros(EVENT_HANDLE.itemsize - 1, np.uint8), 1),
])
def test_protocol_payload_of_the_wrong_size_is_refused(opcode, payload, num_items):
    rec = submission(opcode, num_items=num_items, layer=0, event_index=0)
    with pytest.raises(CommandError) as info:
        protocol.DECODERS[opcode](rec, payload)
    assert info.value.status == Status.BAD_PAYLOAD


@pytest.mark.parametrize("payload,fields", [
    (random_hashes(1).view(np.uint8), dict(num_items=1)),  # a hash record: RESET names no blocks
    (np.zeros(0, np.uint8), dict(num_items=3)),       # items it does not carry
    (np.zeros(0, np.uint8), dict(flags=int(CommandFlag.CLAIM))),  # a flag no RESET has
])
def test_protocol_reset_with_anything_beyond_its_namespace_is_refused(payload, fields):
    # A RESET is its namespace alone: a record that says more was not written by our codec.
    rec = submission(Opcode.RESET, namespace=9, **fields)
    with pytest.raises(CommandError) as info:
        protocol.DECODERS[Opcode.RESET](rec, payload)
    assert info.value.status == Status.BAD_PAYLOAD
    assert protocol.DECODERS[Opcode.RESET](submission(Opcode.RESET, namespace=9), protocol.NO_PAYLOAD) == Reset(9)


def test_protocol_claim_lookup_without_its_prefill_record_is_refused():
    # CLAIM says a PREFILL record ends the payload: hashes alone are one record short.
    rec = submission(Opcode.LOOKUP, num_items=2, flags=int(CommandFlag.CLAIM))
    with pytest.raises(CommandError) as info:
        protocol.DECODERS[Opcode.LOOKUP](rec, random_hashes(2).view(np.uint8))
    assert info.value.status == Status.BAD_PAYLOAD
    assert protocol.encode(Lookup(1, random_hashes(1), prefill=Prefill(16, 1000, 10))).flags == CommandFlag.CLAIM


def test_protocol_hash_record_of_no_length_is_refused():
    records = random_hashes(2)
    records[1]["length"] = 0
    rec = submission(Opcode.LOOKUP, num_items=2)
    with pytest.raises(CommandError) as info:
        protocol.DECODERS[Opcode.LOOKUP](rec, records.view(np.uint8))
    assert info.value.status == Status.BAD_PAYLOAD


# -- an answer as a client reads it: its status typed, which statuses ``checked`` lets through

def _completion_record(status: int, value: int = 0, value2: int = 0):
    record = np.zeros(1, dtype=wire.COMPLETION)[0]
    record["command_id"], record["opcode"], record["status"] = 9, int(Opcode.LOOKUP), status
    record["value"], record["value2"] = value, value2
    return record


def test_protocol_completion_wait_refused_round_trips_typed_with_its_values():
    # A LOOKUP answered at once past the engine's bounds: WAIT_REFUSED on the wire, read back
    # as that status (not a bare number), its values those of an OK answer.
    done = protocol.completion_of(_completion_record(int(Status.WAIT_REFUSED), value=3, value2=41))
    assert done.status is Status.WAIT_REFUSED and done.is_ok
    assert (done.result.num_hit_blocks, done.result.lease_id) == (3, 41)
    assert protocol.checked(done) is done


@pytest.mark.parametrize("status", [s for s in Status if s not in (Status.OK, Status.WAIT_REFUSED)])
def test_protocol_completion_other_statuses_are_errors(status):
    done = protocol.completion_of(_completion_record(int(status)))
    assert not done.is_ok
    with pytest.raises(CommandError):
        protocol.checked(done)


def test_protocol_completion_status_this_client_does_not_know_stays_a_number():
    done = protocol.completion_of(_completion_record(200))
    assert done.status == 200 and not isinstance(done.status, Status) and not done.is_ok
