"""pegaflow.platform.protocol: every opcode has its typed command, encoder and decoder, and
each command comes back from its wire record exactly as it was sent."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest

from pegaflow.platform import protocol, wire
from pegaflow.platform.cuda.ipc import ExportedAllocation, region_record
from pegaflow.platform.errors import CommandError
from pegaflow.platform.protocol import (
    Attach,
    Detach,
    Drop,
    Load,
    Lookup,
    Ping,
    Prefill,
    Register,
    RegisterEvents,
    Release,
    ReleaseClaim,
    Reset,
    Save,
    Unregister,
    Voters,
)
from pegaflow.platform.ring import record_type
from pegaflow.platform.wire import (
    EVENT_HANDLE,
    LAYER,
    REGION,
    SUBMISSION,
    WIRE_VERSION,
    ClientRole,
    CommandFlag,
    KvRole,
    Opcode,
    RegionKind,
    Status,
    encode_hashes,
)

_make = record_type(SUBMISSION)


def _hashes(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return encode_hashes([rng.bytes(32) for _ in range(n)])


GPU_UUID = bytes.fromhex("5e1f0c2a9b7d4e61a3c8f0d2b4e6a8c0")


def _region_and_layers() -> tuple[np.ndarray, np.ndarray]:
    """A REGION as a CUDA client writes it (its device 2 is GPU_UUID) and two LAYERs."""
    exported = ExportedAllocation(bytes(range(64)), 512, 1 << 20, 2, GPU_UUID)
    region = region_record(exported, 2, 16, 4096)
    layers = np.zeros(2, LAYER)
    layers["layer"], layers["group"], layers["block_stride_bytes"] = [0, 1], [0, 1], 4096
    return region, layers


def _samples() -> list:
    """One command per opcode, with every field away from its default where it has one."""
    region, layers = _region_and_layers()
    ids = np.array([3, 1, 2], np.int32)
    return [
        Attach(4242, ClientRole.WORKER, KvRole.CONSUMER, 3, 0x1234, 77, Voters(2, 1)),
        Detach(), Register(5, region[0], layers), Unregister(),
        RegisterEvents(np.zeros(4, EVENT_HANDLE)),
        Lookup(9, _hashes(4), wait_ms=25), Lookup(9, _hashes(4), prefill=Prefill(16, 40_000, 3000)),
        Release(31),
        Save(9, ids, _hashes(3), group=2, first_event=4, one_event=True, tags=np.array([7, 7, 8], np.uint64)),
        Load(9, ids, _hashes(3, 1), lease_id=12, ends_lease=False, layer=1, first_event=2, after_client=True),
        Ping(),
        Drop(9, _hashes(2), since_command=40),
        ReleaseClaim(_hashes(5, 2)),
        Reset(0x5EED),
    ]


def _round_trip(command):
    """``command`` encoded onto a SUBMISSION and its payload bytes, then decoded."""
    encoded = protocol.encode(command)
    payload = (np.concatenate([np.ascontiguousarray(p).view(np.uint8).ravel() for p in encoded.payload])
               if encoded.payload else protocol.NO_PAYLOAD)
    rec = _make(0, *protocol.record_fields(1, encoded, 0, payload.nbytes))
    assert rec.version == WIRE_VERSION
    return protocol.decode(protocol.check_envelope(rec), rec, payload)


def _record(opcode: Opcode, **fields):
    """A SUBMISSION of ``opcode`` with these wire fields (as the engine reads one, by place)."""
    return _make(0, *protocol.record_fields(1, protocol.raw_submission(opcode, **fields), 0, 0))


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray) or isinstance(a, np.void):
        return np.asarray(a).tobytes() == np.asarray(b).tobytes()
    return a == b


def test_protocol_every_opcode_has_a_command_an_encoder_and_a_decoder():
    # Adding an opcode to the wire's enum without its command type, encoder and decoder
    # fails here (and at import); the engine's handlers are checked in tests/engine.
    assert set(protocol.COMMANDS) == set(Opcode)
    assert set(protocol.ENCODERS) == set(Opcode) and set(protocol.DECODERS) == set(Opcode)
    assert {type(c).OPCODE for c in _samples()} == set(Opcode)
    for opcode, kind in protocol.COMMANDS.items():
        assert kind.OPCODE is opcode and 0 <= len(kind.Answer._fields) <= 3


@pytest.mark.parametrize("command", _samples(), ids=lambda c: type(c).__name__)
def test_protocol_command_decodes_as_it_was_encoded(command):
    back = _round_trip(command)
    assert type(back) is type(command)
    for field in fields(command):
        mine, theirs = getattr(command, field.name), getattr(back, field.name)
        assert _same(mine, theirs), field.name


def test_protocol_register_carries_the_clients_gpu_uuid_and_ordinal_byte_for_byte():
    # 1. A client's REGISTER, through the codec as the engine receives it.
    region, layers = _region_and_layers()
    back = _round_trip(Register(5, region[0], layers))
    # 2. The engine reads the GPU's UUID the client exported, and the client's own ordinal.
    assert back.region["gpu_uuid"].tobytes() == GPU_UUID
    assert int(back.region["client_device"]) == 2
    assert back.region["kind"] == RegionKind.CUDA_IPC and back.region.dtype == REGION


def test_protocol_load_flags_say_what_the_load_means():
    ids, hashes = [1], _hashes(1)
    flags = lambda **kw: protocol.encode(Load(1, ids, hashes, **kw)).flags  # noqa: E731
    assert flags() == CommandFlag.NONE
    assert flags(lease_id=5) == CommandFlag.RELEASE_LEASE
    assert flags(lease_id=5, ends_lease=False) == CommandFlag.LEASE_HELD
    assert flags(after_client=True, group=1) == CommandFlag.AFTER_CLIENT | CommandFlag.LAYER_GROUP
    assert protocol.last_pool_event(8) == 7 and protocol.layer_event(4, 2) == 6


@pytest.mark.parametrize("opcode,payload,num_items", [
    (Opcode.LOOKUP, _hashes(2).view(np.uint8)[:-1], 2),
    (Opcode.DROP, _hashes(2).view(np.uint8), 3),
    (Opcode.SAVE, np.zeros(8, np.uint8), 1),
    (Opcode.REGISTER, np.zeros(REGION.itemsize, np.uint8), 1),
    (Opcode.REGISTER_EVENTS, np.zeros(EVENT_HANDLE.itemsize - 1, np.uint8), 1),
])
def test_protocol_payload_of_the_wrong_size_is_refused(opcode, payload, num_items):
    rec = _record(opcode, num_items=num_items, layer=0, event_index=0)
    with pytest.raises(CommandError) as info:
        protocol.DECODERS[opcode](rec, payload)
    assert info.value.status == Status.BAD_PAYLOAD


@pytest.mark.parametrize("payload,fields", [
    (_hashes(1).view(np.uint8), dict(num_items=1)),  # a hash record: RESET names no blocks
    (np.zeros(0, np.uint8), dict(num_items=3)),       # items it does not carry
    (np.zeros(0, np.uint8), dict(flags=int(CommandFlag.CLAIM))),  # a flag no RESET has
])
def test_protocol_reset_with_anything_beyond_its_namespace_is_refused(payload, fields):
    # A RESET is its namespace alone: a record that says more was not written by our codec.
    rec = _record(Opcode.RESET, namespace=9, **fields)
    with pytest.raises(CommandError) as info:
        protocol.DECODERS[Opcode.RESET](rec, payload)
    assert info.value.status == Status.BAD_PAYLOAD
    assert protocol.DECODERS[Opcode.RESET](_record(Opcode.RESET, namespace=9), protocol.NO_PAYLOAD) == Reset(9)


def test_protocol_claim_lookup_without_its_prefill_record_is_refused():
    # CLAIM says a PREFILL record ends the payload: hashes alone are one record short.
    rec = _record(Opcode.LOOKUP, num_items=2, flags=int(CommandFlag.CLAIM))
    with pytest.raises(CommandError) as info:
        protocol.DECODERS[Opcode.LOOKUP](rec, _hashes(2).view(np.uint8))
    assert info.value.status == Status.BAD_PAYLOAD
    assert protocol.encode(Lookup(1, _hashes(1), prefill=Prefill(16, 1000, 10))).flags == CommandFlag.CLAIM


def test_protocol_hash_record_of_no_length_is_refused():
    records = _hashes(2)
    records[1]["length"] = 0
    rec = _record(Opcode.LOOKUP, num_items=2)
    with pytest.raises(CommandError) as info:
        protocol.DECODERS[Opcode.LOOKUP](rec, records.view(np.uint8))
    assert info.value.status == Status.BAD_PAYLOAD


def test_protocol_unknown_opcode_and_wrong_version_are_refused():
    rec = _make(0, *protocol.record_fields(1, protocol.raw_submission(99), 0, 0))
    with pytest.raises(CommandError) as info:
        protocol.check_envelope(rec)
    assert info.value.status == Status.BAD_OPCODE
    rec = rec._replace(opcode=int(Opcode.PING), version=WIRE_VERSION + 1)
    with pytest.raises(CommandError) as info:
        protocol.check_envelope(rec)
    assert info.value.status == Status.BAD_VERSION


@pytest.mark.parametrize(("offset", "num_bytes", "is_inside"), [
    (0, 64, True), (4096 - 40, 40, True),  # from the start; ending exactly at the arena's end
    (4096 - 39, 40, False), (4096, 1, False), (2**40, 40, False),  # straddling it, at it, far past it
])
def test_read_payload_copies_a_payload_inside_the_arena_and_refuses_one_past_it(offset, num_bytes, is_inside):
    # 1. An arena of 4 KiB of known bytes, a record naming [offset, +num_bytes) of it.
    from pegaflow.platform.protocol import NO_PAYLOAD, read_payload
    arena = (np.arange(4096) % 251).astype(np.uint8)
    rec = _make(*np.zeros(1, SUBMISSION)[0].item())._replace(payload_offset=offset, payload_bytes=num_bytes)
    payload = read_payload(arena, rec)
    # 2. Inside: a private copy of exactly those bytes (the client may reuse the arena next).
    if is_inside:
        np.testing.assert_array_equal(payload, arena[offset:offset + num_bytes])
        arena[offset] ^= 0xFF
        assert payload[0] != arena[offset]
    else:  # 3. Past the arena, even by one byte: None (answered BAD_PAYLOAD), never a short copy.
        assert payload is None
    # 4. No payload: the shared empty one.
    assert read_payload(arena, rec._replace(payload_bytes=0)) is NO_PAYLOAD


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
