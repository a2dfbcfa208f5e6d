"""The one contract between a client and the engine: a typed command per opcode
(``commands.py``: its fields, its answer, what a LOAD's flags and events mean) how each
goes onto the fixed wire record and back (``codec.py``), and what every record says
whatever its opcode (``envelope.py``)."""

from .codec import (
    DECODERS,
    ENCODERS,
    Completion,
    Encoded,
    checked,
    completion_of,
    decode,
    encode,
    payload_past_arena,
    raw_submission,
    record_fields,
)
from .commands import (
    ANSWERS,
    COMMANDS,
    NO_PAYLOAD,
    Attach,
    Command,
    Detach,
    Done,
    Drop,
    DropAnswer,
    Key,
    Load,
    LoadAnswer,
    Lookup,
    LookupAnswer,
    Ping,
    PingAnswer,
    Prefill,
    Register,
    RegisterEvents,
    Release,
    ReleaseClaim,
    Reset,
    ResetAnswer,
    Save,
    SaveAnswer,
    Unregister,
    Voters,
    event_or_none,
    hash_records,
    keys_of,
    last_pool_event,
    layer_event,
)
from .envelope import PAYLOAD_BYTES_AT, check_envelope, envelope, read_payload

__all__ = [
    "ANSWERS", "COMMANDS", "DECODERS", "ENCODERS", "NO_PAYLOAD", "PAYLOAD_BYTES_AT", "Attach", "Command", "Completion",
    "Detach", "Done", "Drop", "DropAnswer", "Encoded", "Key", "Load", "LoadAnswer", "Lookup", "LookupAnswer",
    "Ping", "PingAnswer", "Prefill", "Register", "RegisterEvents", "Release", "ReleaseClaim", "Reset", "ResetAnswer",
    "Save", "SaveAnswer", "Unregister",
    "Voters", "check_envelope", "checked", "completion_of", "decode", "encode", "envelope", "hash_records", "keys_of",
    "event_or_none", "last_pool_event", "layer_event", "payload_past_arena", "raw_submission", "read_payload",
    "record_fields",
]
