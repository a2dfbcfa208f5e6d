"""Commands onto the fixed SUBMISSION record and its payload, and back: one encoder and one
decoder per opcode.  A decoder checks what the bytes alone can say (payload sizes, hash
lengths) and raises CommandError; what depends on the client (its layers, its lease) is the
engine's to check.  An answer's COMPLETION record as the client reads it: a ``Completion``
(``completion_of``), and CommandError for one that is not OK (``checked``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from pegaflow.platform.errors import CommandError
from pegaflow.platform.wire import (
    ALL_LAYERS,
    BLOCK_ID,
    EVENT_HANDLE,
    HASH,
    HASH_BYTES,
    LAYER,
    NO_EVENT,
    PREFILL,
    REGION,
    TAG,
    WIRE_VERSION,
    CommandFlag,
    Opcode,
    Status,
    attach_role,
    split_attach_role,
)

from .commands import (
    ANSWERS,
    COMMANDS,
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
    event_or_none,
    hash_records,
)
from .envelope import (
    ARG_AT,
    EVENT_INDEX_AT,
    FLAGS_AT,
    LAYER_AT,
    NAMESPACE_AT,
    NUM_ITEMS_AT,
    PAYLOAD_BYTES_AT,
    PAYLOAD_OFFSET_AT,
    REGION_ID_AT,
)

# Speed.  This module and ``ring.py`` are the two places of the control path that trade
# plain code for speed, because each runs once per command of every request: the encoders
# of the commands sent per request build ``Encoded`` by position with their opcodes read
# once (below), ``record_fields`` unpacks once and builds one tuple, and ``completion_of``
# builds a Completion by ``tuple.__new__`` and compares against names read once.  Measured
# with timeit on the 2-core development machine (Python 3.11): an enum member's lookup
# ~90 ns against ~10 ns for a module name; a named tuple ~300 ns by its constructor, ~1 us
# by keyword, ~160 ns by tuple.__new__; a slice and a splat of the record twice one
# unpacking.  Everything else reads plainly.
_DETACH, _UNREGISTER, _PING = Detach(), Unregister(), Ping()  # no fields: one value each
_LOOKUP, _RELEASE, _SAVE, _LOAD, _DROP = Opcode.LOOKUP, Opcode.RELEASE, Opcode.SAVE, Opcode.LOAD, Opcode.DROP
_OK, _WAIT_REFUSED = Status.OK, Status.WAIT_REFUSED
_opcode_of = {int(m): m for m in Opcode}.get
_status_of = {int(m): m for m in Status}.get


class Encoded(NamedTuple):
    """A command as the SUBMISSION's fields (less seq, its id and the payload's place) and
    the arrays its payload is made of."""

    opcode: int
    flags: int = 0
    layer: int = ALL_LAYERS
    region_id: int = 0
    num_items: int = 0
    event_index: int = NO_EVENT
    namespace: int = 0
    arg: int = 0
    payload: tuple = ()


def record_fields(command_id: int, encoded: Encoded, payload_offset: int, payload_bytes: int) -> tuple:
    """The SUBMISSION's fields after ``seq``, in record order."""
    opcode, flags, layer, region_id, num_items, event_index, namespace, arg, _ = encoded
    return (command_id, opcode, flags, layer, region_id, num_items, event_index, namespace,
            payload_offset, payload_bytes, WIRE_VERSION, arg)


def decode(opcode: Opcode, rec, payload: np.ndarray | None):
    """The typed command of a record ``check_envelope`` passed, and its payload."""
    if payload is None:
        raise payload_past_arena(rec)
    return DECODERS[opcode](rec, payload)


def payload_past_arena(rec) -> CommandError:
    """What ``decode`` raises for a payload ``read_payload`` found past the arena (None)."""
    return CommandError(Status.BAD_PAYLOAD, f"payload [{rec[PAYLOAD_OFFSET_AT]}, "
                                           f"+{rec[PAYLOAD_BYTES_AT]}) past the arena")


def encode(command) -> Encoded:
    return ENCODERS[command.OPCODE](command)


def raw_submission(opcode: int, payload=(), **fields) -> Encoded:
    """Any record at all, fields by their wire names (tests of what the engine refuses)."""
    return Encoded(opcode, payload=tuple(payload), **fields)


def _hashes(rec, payload: np.ndarray, what: str) -> np.ndarray:
    if len(payload) != rec[NUM_ITEMS_AT] * HASH.itemsize:
        raise CommandError(Status.BAD_PAYLOAD, f"{what} wants num_items hash records")
    return _checked_hashes(payload.view(HASH))


def _checked_hashes(records: np.ndarray) -> np.ndarray:
    lengths = records["length"]
    if (lengths == 0).any() or (lengths > HASH_BYTES).any():
        raise CommandError(Status.BAD_PAYLOAD, "a hash record has a bad length")
    return records


def _blocks(rec, payload: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A SAVE's or LOAD's block ids and hash records."""
    num_items = rec[NUM_ITEMS_AT]
    if len(payload) != num_items * (BLOCK_ID.itemsize + HASH.itemsize):
        raise CommandError(Status.BAD_PAYLOAD, "SAVE/LOAD want num_items block ids and hashes")
    split = num_items * BLOCK_ID.itemsize
    return payload[:split].view(BLOCK_ID), _checked_hashes(payload[split:].view(HASH))


def _layers(flags: int, layer: int) -> tuple[int, int | None]:
    """(layer, group) of a SAVE's or LOAD's record."""
    return (ALL_LAYERS, layer) if flags & CommandFlag.LAYER_GROUP else (layer, None)


def _encode_layers(command, flags: int) -> tuple[int, int]:
    if command.group is not None:
        return flags | CommandFlag.LAYER_GROUP, command.group
    return flags, command.layer


def _encode_attach(c: Attach) -> Encoded:
    words = [c.instance] if c.voters is None else [c.instance, c.voters.num_voters, c.voters.voter]
    return Encoded(Opcode.ATTACH, attach_role(c.role, c.kv_role), c.rank, namespace=c.namespace,
                   arg=c.pid, payload=(np.array(words, dtype="<u8"),))


def _decode_attach(rec, payload: np.ndarray) -> Attach:
    words = payload.view("<u8").tolist() if len(payload) in (8, 24) else [0]
    role, kv_role = split_attach_role(int(rec[FLAGS_AT]))
    voters = Voters(words[1], words[2]) if len(words) == 3 else None
    return Attach(rec[ARG_AT], role, kv_role, rec[LAYER_AT], rec[NAMESPACE_AT], words[0], voters)


def _encode_register(c: Register) -> Encoded:
    return Encoded(Opcode.REGISTER, region_id=c.region_id, num_items=len(c.layers),
                   payload=(c.region, c.layers))


def _decode_register(rec, payload: np.ndarray) -> Register:
    if len(payload) != REGION.itemsize + rec[NUM_ITEMS_AT] * LAYER.itemsize:
        raise CommandError(Status.BAD_PAYLOAD, "REGISTER wants one REGION and num_items LAYERs")
    return Register(rec[REGION_ID_AT], payload[:REGION.itemsize].view(REGION)[0],
                    payload[REGION.itemsize:].view(LAYER))


def _encode_events(c: RegisterEvents) -> Encoded:
    return Encoded(Opcode.REGISTER_EVENTS, num_items=len(c.handles), payload=(c.handles,))


def _decode_events(rec, payload: np.ndarray) -> RegisterEvents:
    if len(payload) != rec[NUM_ITEMS_AT] * EVENT_HANDLE.itemsize:
        raise CommandError(Status.BAD_PAYLOAD, "REGISTER_EVENTS wants num_items handles")
    return RegisterEvents(payload.view(EVENT_HANDLE))


def _encode_lookup(c: Lookup) -> Encoded:
    records = hash_records(c.hashes)
    wait = 0 if c.wait_ms is None else 1 + max(0, int(c.wait_ms))  # 0 on the wire: the engine's
    if c.prefill is None:
        return Encoded(_LOOKUP, 0, ALL_LAYERS, 0, len(records), NO_EVENT, c.namespace, wait, (records,))
    prefill = np.array([(c.prefill.block_tokens, c.prefill.tokens_per_s, c.prefill.wait_ms, 0)], PREFILL)
    return Encoded(_LOOKUP, int(CommandFlag.CLAIM), ALL_LAYERS, 0, len(records), NO_EVENT, c.namespace,
                   wait, (records, prefill))


def _decode_lookup(rec, payload: np.ndarray) -> Lookup:
    wait, prefill = rec[ARG_AT], None
    if rec[FLAGS_AT] & CommandFlag.CLAIM:
        if len(payload) < PREFILL.itemsize:
            raise CommandError(Status.BAD_PAYLOAD, "CLAIM wants a PREFILL record after the hashes")
        record = payload[-PREFILL.itemsize:].view(PREFILL)[0]
        payload = payload[:-PREFILL.itemsize]
        prefill = Prefill(int(record["block_tokens"]), int(record["tokens_per_s"]), int(record["wait_ms"]))
    return Lookup(rec[NAMESPACE_AT], _hashes(rec, payload, "LOOKUP"), None if wait == 0 else wait - 1, prefill)


def _encode_save(c: Save) -> Encoded:
    ids = np.asarray(c.block_ids, dtype=BLOCK_ID)
    flags, layer = _encode_layers(c, CommandFlag.ONE_EVENT if c.one_event else CommandFlag.NONE)
    payload = (ids, hash_records(c.hashes))
    if c.tags is not None:
        flags |= CommandFlag.VOTE_TAGS
        payload += (np.asarray(c.tags, dtype=TAG),)
    return Encoded(_SAVE, int(flags), layer, 0, len(ids), NO_EVENT if c.first_event is None else c.first_event,
                   c.namespace, 0, payload)


def _decode_save(rec, payload: np.ndarray) -> Save:
    flags, tags = rec[FLAGS_AT], None
    if flags & CommandFlag.VOTE_TAGS:
        split = len(payload) - rec[NUM_ITEMS_AT] * TAG.itemsize
        if split < 0:
            raise CommandError(Status.BAD_PAYLOAD, "VOTE_TAGS wants a tag per block")
        payload, tags = payload[:split], payload[split:].view(TAG)
    block_ids, hashes = _blocks(rec, payload)
    layer, group = _layers(flags, rec[LAYER_AT])
    return Save(rec[NAMESPACE_AT], block_ids, hashes, layer, group, event_or_none(rec[EVENT_INDEX_AT]),
                bool(flags & CommandFlag.ONE_EVENT), tags)


def _encode_load(c: Load) -> Encoded:
    flags = CommandFlag.NONE
    if c.lease_id:
        flags = CommandFlag.RELEASE_LEASE if c.ends_lease else CommandFlag.LEASE_HELD
    if c.after_client:
        flags |= CommandFlag.AFTER_CLIENT
    flags, layer = _encode_layers(c, flags)
    ids = np.asarray(c.block_ids, dtype=BLOCK_ID)
    return Encoded(_LOAD, int(flags), layer, 0, len(ids), NO_EVENT if c.first_event is None else c.first_event,
                   c.namespace, c.lease_id, (ids, hash_records(c.hashes)))


def _decode_load(rec, payload: np.ndarray) -> Load:
    flags = rec[FLAGS_AT]
    block_ids, hashes = _blocks(rec, payload)
    layer, group = _layers(flags, rec[LAYER_AT])
    names_lease = flags & (CommandFlag.RELEASE_LEASE | CommandFlag.LEASE_HELD)
    return Load(rec[NAMESPACE_AT], block_ids, hashes, rec[ARG_AT] if names_lease else 0,
                bool(flags & CommandFlag.RELEASE_LEASE) or not names_lease, layer, group,
                event_or_none(rec[EVENT_INDEX_AT]), bool(flags & CommandFlag.AFTER_CLIENT))


def _encode_drop(c: Drop) -> Encoded:
    records = hash_records(c.hashes)
    return Encoded(_DROP, 0, ALL_LAYERS, 0, len(records), NO_EVENT, c.namespace, c.since_command, (records,))


def _decode_drop(rec, payload: np.ndarray) -> Drop:
    return Drop(rec[NAMESPACE_AT], _hashes(rec, payload, "DROP"), rec[ARG_AT])


def _encode_release_claim(c: ReleaseClaim) -> Encoded:
    records = hash_records(c.hashes)
    return Encoded(Opcode.RELEASE_CLAIM, num_items=len(records), payload=(records,))


def _decode_reset(rec, payload: np.ndarray) -> Reset:
    if rec[NUM_ITEMS_AT] or len(payload) or rec[FLAGS_AT]:  # it names its namespace, nothing more
        raise CommandError(Status.BAD_PAYLOAD, "RESET carries no items, payload or flags")
    return Reset(rec[NAMESPACE_AT])


_ENCODED_DETACH, _ENCODED_UNREGISTER, _ENCODED_PING = (
    Encoded(Opcode.DETACH), Encoded(Opcode.UNREGISTER), Encoded(Opcode.PING))

ENCODERS: dict[Opcode, Callable[..., Encoded]] = {
    Opcode.ATTACH: _encode_attach,
    Opcode.DETACH: lambda c: _ENCODED_DETACH,
    Opcode.REGISTER: _encode_register,
    Opcode.UNREGISTER: lambda c: _ENCODED_UNREGISTER,
    Opcode.REGISTER_EVENTS: _encode_events,
    Opcode.LOOKUP: _encode_lookup,
    Opcode.RELEASE: lambda c: Encoded(_RELEASE, 0, ALL_LAYERS, 0, 0, NO_EVENT, 0, c.lease_id),
    Opcode.SAVE: _encode_save,
    Opcode.LOAD: _encode_load,
    Opcode.PING: lambda c: _ENCODED_PING,
    Opcode.DROP: _encode_drop,
    Opcode.RELEASE_CLAIM: _encode_release_claim,
    Opcode.RESET: lambda c: Encoded(Opcode.RESET, namespace=c.namespace),
}

DECODERS: dict[Opcode, Callable[..., object]] = {
    Opcode.ATTACH: _decode_attach,
    Opcode.DETACH: lambda rec, payload: _DETACH,
    Opcode.REGISTER: _decode_register,
    Opcode.UNREGISTER: lambda rec, payload: _UNREGISTER,
    Opcode.REGISTER_EVENTS: _decode_events,
    Opcode.LOOKUP: _decode_lookup,
    Opcode.RELEASE: lambda rec, payload: Release(rec[ARG_AT]),
    Opcode.SAVE: _decode_save,
    Opcode.LOAD: _decode_load,
    Opcode.PING: lambda rec, payload: _PING,
    Opcode.DROP: _decode_drop,
    Opcode.RELEASE_CLAIM: lambda rec, payload: ReleaseClaim(_hashes(rec, payload, "RELEASE_CLAIM")),
    Opcode.RESET: _decode_reset,
}

if not set(COMMANDS) == set(Opcode) == set(ENCODERS) == set(DECODERS):
    raise ImportError("every opcode needs a command type, an encoder and a decoder")


class Completion(NamedTuple):
    """One answer, as the engine wrote it."""

    command_id: int  # the client's count of its commands, echoed by the engine
    opcode: Opcode | int
    status: Status | int
    num_items: int
    value: int
    value2: int
    value3: int

    @property
    def is_ok(self) -> bool:
        """OK, or WAIT_REFUSED (OK's twin: a LOOKUP answered at once, its values as OK's, the
        wait it asked for refused by the engine's bounds): its values hold."""
        return self.status == _OK or self.status == _WAIT_REFUSED

    @property
    def result(self):
        """The answer's values by name (its opcode's answer type): e.g. a LOOKUP's
        ``num_hit_blocks`` and ``lease_id``.  An opcode without named values: ()."""
        kind = ANSWERS.get(self.opcode)
        return kind(*(self.value, self.value2, self.value3)[:len(kind._fields)]) if kind else ()


_new_completion = functools.partial(tuple.__new__, Completion)


def completion_of(record) -> Completion:
    """A COMPLETION record (in field order) as a Completion; an opcode or status this
    client does not know stays a number."""
    _, command_id, opcode, status, num_items, value, value2, value3 = record
    return _new_completion((command_id, _opcode_of(opcode, opcode), _status_of(status, status),
                            num_items, value, value2, value3))


def checked(completion: Completion) -> Completion:
    """``completion`` if OK (or WAIT_REFUSED); else CommandError naming its opcode and status."""
    if completion.status != _OK and completion.status != _WAIT_REFUSED:
        opcode, status = completion.opcode, completion.status
        raise CommandError(status, f"{getattr(opcode, 'name', opcode)} failed: {getattr(status, 'name', status)}")
    return completion
