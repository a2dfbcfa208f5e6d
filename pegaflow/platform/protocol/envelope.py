"""What the engine reads of every record whatever its opcode, before decoding it: its
command id, opcode and item count (``envelope``), whether its version and opcode are known
(``check_envelope``), and its payload, copied out of the arena (``read_payload``)."""

from __future__ import annotations

import operator

import numpy as np

from pegaflow.platform.errors import CommandError
from pegaflow.platform.wire import WIRE_VERSION, Opcode, Status

from .commands import NO_PAYLOAD

_OPCODES = {int(m): m for m in Opcode}


# What every record says whatever its opcode, as a plain (command_id, opcode, num_items):
# the engine's command id (the client's count, not vLLM's request id), the opcode as sent,
# and how many items it names.  (A C-level getter: it runs once per command.)
envelope = operator.attrgetter("request_id", "opcode", "num_items")


def read_payload(arena: np.ndarray, rec) -> np.ndarray | None:
    """A private copy of the record's payload, taken before its ring slot is handed back
    (after that the client may overwrite it); None if it lies past the arena."""
    offset, num_bytes = rec.payload_offset, rec.payload_bytes
    if num_bytes == 0:
        return NO_PAYLOAD
    if offset + num_bytes > len(arena):
        return None
    return arena[offset:offset + num_bytes].copy()


def check_envelope(rec) -> Opcode:
    """The record's opcode, once its wire version and opcode are known good."""
    if rec.version != WIRE_VERSION:
        raise CommandError(Status.BAD_VERSION, f"wire version {rec.version}")
    opcode = _OPCODES.get(rec.opcode)
    if opcode is None:
        raise CommandError(Status.BAD_OPCODE, f"unknown opcode {rec.opcode}")
    return opcode
