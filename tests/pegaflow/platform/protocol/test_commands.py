"""pegaflow/platform/protocol/commands.py: every opcode has its typed command and answer (and the
codec an encoder and a decoder for it); what a command's helpers say of events and keys."""

from __future__ import annotations

from pegaflow.platform import protocol
from pegaflow.platform.wire import NO_EVENT, Opcode, encode_hashes, hash_keys
from tests.pegaflow.platform.protocol.samples import one_command_per_opcode, random_hashes


def test_protocol_every_opcode_has_a_command_an_encoder_and_a_decoder():
    # Adding an opcode to the wire's enum without its command type, encoder and decoder
    # fails here (and at import); the engine's handlers are checked in tests/engine.
    assert set(protocol.COMMANDS) == set(Opcode)
    assert set(protocol.ENCODERS) == set(Opcode) and set(protocol.DECODERS) == set(Opcode)
    assert {type(c).OPCODE for c in one_command_per_opcode()} == set(Opcode)
    for opcode, kind in protocol.COMMANDS.items():
        assert kind.OPCODE is opcode and 0 <= len(kind.Answer._fields) <= 3


def test_commands_event_and_key_helpers_say_what_a_record_means():
    # 1. NO_EVENT on the wire is no event for the command; any other index is itself.
    assert protocol.event_or_none(NO_EVENT) is None and protocol.event_or_none(0) == 0
    # 2. A LOAD's layers take consecutive events from its first; an after_client LOAD the pool's last.
    assert [protocol.layer_event(4, k) for k in range(3)] == [4, 5, 6] and protocol.last_pool_event(8) == 7
    # 3. Hashes given as bytes are encoded; records already encoded pass through as they are.
    records = random_hashes(2)
    assert protocol.hash_records(records) is records
    assert protocol.hash_records([b"a" * 32]).tobytes() == encode_hashes([b"a" * 32]).tobytes()
    # 4. Index keys pair the command's namespace with each record's key, in order.
    assert protocol.keys_of(7, records) == [(7, key) for key in hash_keys(records)]
    assert protocol.keys_of(7, records) != protocol.keys_of(8, records)
