"""What the engine reads of every record whatever its opcode, before decoding it: its
command id, opcode and item count (``envelope``), whether its version and opcode are known
(``check_envelope``), and its payload, copied out of the arena (``read_payload``)."""

from __future__ import annotations

import operator

import numpy as np

from pegaflow.platform.errors import CommandError
from pegaflow.platform.wire import SUBMISSION, WIRE_VERSION, Opcode, Status

from .commands import NO_PAYLOAD

_OPCODES = {int(m): m for m in Opcode}

# A record's fields by place: the engine reads each record as one plain tuple of them
# (``RingConsumer.try_peek_values``; a named tuple per record costs as much as a PING's
# dispatch), and a named tuple of them (tests, ``try_peek``) reads the same.
(COMMAND_ID_AT, OPCODE_AT, FLAGS_AT, LAYER_AT, REGION_ID_AT, NUM_ITEMS_AT, EVENT_INDEX_AT, NAMESPACE_AT,
 PAYLOAD_OFFSET_AT, PAYLOAD_BYTES_AT, VERSION_AT, ARG_AT) = map(SUBMISSION.names.index, (
    "command_id", "opcode", "flags", "layer", "region_id", "num_items", "event_index", "namespace",
    "payload_offset", "payload_bytes", "version", "arg"))

# What every record says whatever its opcode, as a plain (command_id, opcode, num_items):
# the command id (the client's count of its commands), the opcode as sent,
# and how many items it names.  (A C-level getter: it runs once per command.)
envelope = operator.itemgetter(COMMAND_ID_AT, OPCODE_AT, NUM_ITEMS_AT)


def read_payload(arena: np.ndarray, rec) -> np.ndarray | None:
    """A private copy of the record's payload, taken before its ring slot is handed back
    (after that the client may overwrite it); None if it lies past the arena."""
    offset, num_bytes = rec[PAYLOAD_OFFSET_AT], rec[PAYLOAD_BYTES_AT]
    if num_bytes == 0:
        return NO_PAYLOAD
    if offset + num_bytes > len(arena):
        return None
    return arena[offset:offset + num_bytes].copy()


def check_envelope(rec) -> Opcode:
    """The record's opcode, once its wire version and opcode are known good."""
    if rec[VERSION_AT] != WIRE_VERSION:
        raise CommandError(Status.BAD_VERSION, f"wire version {rec[VERSION_AT]}")
    opcode = _OPCODES.get(rec[OPCODE_AT])
    if opcode is None:
        raise CommandError(Status.BAD_OPCODE, f"unknown opcode {rec[OPCODE_AT]}")
    return opcode
