"""pegaflow/platform/protocol/envelope.py: what the engine reads of every record before decoding
it: an unknown opcode or version refused, a payload copied only from inside the arena."""

from __future__ import annotations

import numpy as np
import pytest

from pegaflow.platform import protocol
from pegaflow.platform.errors import CommandError
from pegaflow.platform.wire import SUBMISSION, WIRE_VERSION, Opcode, Status
from tests.pegaflow.platform.protocol.samples import make_submission


def test_protocol_unknown_opcode_and_wrong_version_are_refused():
    rec = make_submission(0, *protocol.record_fields(1, protocol.raw_submission(99), 0, 0))
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
    rec = make_submission(*np.zeros(1, SUBMISSION)[0].item())._replace(payload_offset=offset, payload_bytes=num_bytes)
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
