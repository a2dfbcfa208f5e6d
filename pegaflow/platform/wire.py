"""Every byte layout that crosses a process boundary, in one place.

Segments (all created by the engine, see ``pegaflow.platform.shm``)::

    control   CONTROL_HEADER | SLOT x num_slots          clients claim a slot here
    ring.<i>  RING_HEADER | SUBMISSION x n | COMPLETION x n | payload arena
    stats     STATS | CLIENT_STATS x num_slots            written by the engine only (stats_layout.py)
    pool.table POOL_TABLE_HEADER | POOL_RECORD x n        what each pool entry holds (pool_layout.py)

A client writes SUBMISSIONs (and their variable-length payload: HASH records, int32
block ids, REGION/LAYER records) and the engine answers each with exactly one
COMPLETION carrying the same ``command_id`` (the client's count of its commands).  Only
``pegaflow.platform.protocol`` reads or writes a SUBMISSION's generic fields: each command
is a typed value there.  Offsets are explicit and every itemsize
is checked at import, so a layout change that is not a version bump cannot slip in.

Voting (one stored copy of KV that several clients compute alike, e.g. MLA's latent on
every TP rank): ATTACH's payload is ``<u8`` [instance] or [instance, num_voters, voter];
clients attached under one namespace must name the same ``num_voters``.  A voter's SAVEs
set VOTE_TAGS and end their payload with one ``<u8`` tag per block (the same on every
voter for the same computation: the scheduler's step and the block's request).  With
``num_voters`` > 1 a block is READY once its layers are in and every voter has saved it
under the tag of its first SAVE; a SAVE under another tag leaves a block that is not
READY yet alone (a miss later, never a wrong byte).

Compute once (several vLLMs sent one new prefix at once): a LOOKUP with CLAIM ends its
payload with one PREFILL record; the engine claims for the asker's instance the blocks it
is about to compute, and parks another instance's CLAIM LOOKUP that reaches them until
they are saved or the claim ends.  RELEASE_CLAIM's payload is HASH records: the asker's
instance's claims on them end (its request finished, was aborted or preempted).
"""

from __future__ import annotations

import hashlib
from enum import IntEnum, IntFlag

import numpy as np

from pegaflow.platform.records import struct_dtype
from pegaflow.platform.stats_layout import (
    CLIENT_STATS,
    LATENCY_BUCKETS_S,
    LATENCY_OPCODES,
    NUM_LATENCY_BUCKETS,
    NUM_OPCODE_COUNTERS,
    NUM_STATUS_COUNTERS,
    STATS,
    STATS_COUNTER_NAMES,
)

MAGIC = 0x574F4C4641474550  # b"PEGAFLOW" little-endian
WIRE_VERSION = 16  # 16: REGION's gpu_uuid, LOOKUP's WAIT_REFUSED, RESET (a namespace emptied); 15: request_id
#                  is command_id; 14: compute once (a LOOKUP's CLAIM and its PREFILL record, RELEASE_CLAIM);
#                  13: the stats count LOOKUP waits refused; 12: ATTACH carries the kv_role, LOOKUP its wait
ALL_LAYERS = 0xFFFF
NO_EVENT = 0xFFFFFFFF
HASH_BYTES = 32
IPC_HANDLE_BYTES = 64
SHM_NAME_BYTES = 128
GPU_UUID_BYTES = 16
# REGION.gpu_uuid of host memory (the host backend's one stand-in "GPU"; no GPU has it).
HOST_GPU_UUID = b"pegaflow-host-kv"


class Opcode(IntEnum):
    ATTACH = 1
    DETACH = 2
    REGISTER = 3
    UNREGISTER = 4
    REGISTER_EVENTS = 5
    LOOKUP = 6
    RELEASE = 7
    SAVE = 8
    LOAD = 9
    PING = 10
    DROP = 11
    RELEASE_CLAIM = 12
    RESET = 13


class Status(IntEnum):
    OK = 0
    BAD_OPCODE = 1
    BAD_ARGUMENT = 2
    BAD_PAYLOAD = 3
    BLOCK_OUT_OF_RANGE = 4
    UNKNOWN_REGION = 5
    UNKNOWN_LEASE = 6
    MISSING_BLOCK = 7
    POOL_FULL = 8
    SHUTTING_DOWN = 9
    NOT_ATTACHED = 10
    COPY_FAILED = 11
    INTERNAL = 12
    BAD_VERSION = 13
    WAIT_REFUSED = 14  # not an error: a LOOKUP answered at once with its READY prefix (values as OK's,
    #                    leased), the wait it would have had refused by the bounds on parked LOOKUPs


class SlotState(IntEnum):
    FREE = 0
    CLAIMED = 1
    ACTIVE = 2


class RegionKind(IntEnum):
    HOST_SHM = 1
    CUDA_IPC = 2


class ClientRole(IntEnum):
    """What a client says it is at ATTACH (``flags``' low byte), for the per-client stats."""

    OTHER = 0
    SCHEDULER = 1
    WORKER = 2


class KvRole(IntEnum):
    """Its vLLM's ``kv_role`` (ATTACH ``flags``' second byte; CLIENT_STATS ``role`` likewise):
    a prefill server saves and never loads, a decode server loads and (by default) does not save."""

    BOTH = 0
    PRODUCER = 1
    CONSUMER = 2


KV_ROLE_SHIFT = 8


def attach_role(role: ClientRole, kv_role: KvRole = KvRole.BOTH) -> int:
    """ATTACH's ``flags``: the client's role and its vLLM's kv_role."""
    return int(role) | int(kv_role) << KV_ROLE_SHIFT


def split_attach_role(flags: int) -> tuple[ClientRole, KvRole]:
    """``attach_role`` read back; a value no role has reads as OTHER (kv_role: BOTH)."""
    role, kv_role = flags & ((1 << KV_ROLE_SHIFT) - 1), flags >> KV_ROLE_SHIFT
    return (ClientRole(role) if role in ClientRole._value2member_map_ else ClientRole.OTHER,
            KvRole(kv_role) if kv_role in KvRole._value2member_map_ else KvRole.BOTH)


class CommandFlag(IntFlag):
    """SAVE and LOAD options on the wire; what each means is said once, by the typed
    commands' fields in ``pegaflow.platform.protocol`` (their encoder sets these)."""

    NONE = 0
    RELEASE_LEASE = 1  # Load.lease_id with ends_lease
    AFTER_CLIENT = 2   # Load.after_client
    ONE_EVENT = 4      # Save.one_event
    LAYER_GROUP = 8    # Save/Load.group (carried in ``layer``)
    LEASE_HELD = 16    # Load.lease_id without ends_lease
    VOTE_TAGS = 32     # Save.tags (after the hashes; module docstring: voting)
    CLAIM = 64         # Lookup.prefill (one PREFILL record after the hashes; compute once)


CONTROL_HEADER = struct_dtype([
    ("magic", "<u8", 0),
    ("version", "<u4", 8),
    ("num_slots", "<u4", 12),
    ("fingerprint", "<u8", 16),
    ("engine_pid", "<u8", 24),
    ("epoch", "<u8", 32),
    ("start_ns", "<u8", 40),
    ("ring_slots", "<u4", 48),
    ("is_stopping", "<u4", 52),
    ("arena_bytes", "<u8", 56),
    ("engine_sleeping", "<u4", 64),  # set while the engine sleeps on its doorbell
    ("is_serving", "<u4", 68),       # set once the engine accepts clients (its pool's first chunk pinned)
], 128)

SLOT = struct_dtype([
    ("state", "<u4", 0),
    ("pid", "<u4", 4),
    ("generation", "<u8", 8),
    ("claim_ns", "<u8", 16),
], 32)

RING_HEADER = struct_dtype([
    ("magic", "<u8", 0),
    ("version", "<u4", 8),
    ("ring_slots", "<u4", 12),
    ("arena_bytes", "<u8", 16),
    ("generation", "<u8", 24),
    ("client_sleeping", "<u4", 32),  # set while the client sleeps on its completion bell
    ("revoked", "<u4", 36),          # set by a client that stopped waiting for its copies
    ("client_closed", "<u4", 40),    # set by a client that unmapped its ring: it reads no more
], 64)

SUBMISSION = struct_dtype([
    ("seq", "<u8", 0),
    ("command_id", "<u8", 8),
    ("opcode", "<u2", 16),
    ("flags", "<u2", 18),
    ("layer", "<u2", 20),
    ("region_id", "<u2", 22),
    ("num_items", "<u4", 24),
    ("event_index", "<u4", 28),
    ("namespace", "<u8", 32),
    ("payload_offset", "<u8", 40),
    ("payload_bytes", "<u4", 48),
    ("version", "<u4", 52),
    ("arg", "<u8", 56),
], 64)

COMPLETION = struct_dtype([
    ("seq", "<u8", 0),
    ("command_id", "<u8", 8),
    ("opcode", "<u2", 16),
    ("status", "<u2", 18),
    ("num_items", "<u4", 20),
    ("value", "<u8", 24),
    ("value2", "<u8", 32),
    ("value3", "<u8", 40),
], 48)

HASH = struct_dtype([
    ("digest", f"V{HASH_BYTES}", 0),
    ("length", "u1", HASH_BYTES),
], 40)

# ``gpu_uuid``: the GPU the memory lives on, by its UUID (cuDeviceGetUuid; HOST_GPU_UUID for host
# memory): the same in every process, where ordinals are not (each process numbers the GPUs its
# CUDA_VISIBLE_DEVICES shows it).  ``client_device``: the client's own ordinal, for messages only.
REGION = struct_dtype([
    ("kind", "<u4", 0),
    ("client_device", "<u4", 4),
    ("num_layers", "<u4", 8),
    ("num_blocks", "<u4", 12),
    ("page_bytes", "<u8", 16),
    ("base_offset", "<u8", 24),
    ("alloc_bytes", "<u8", 32),
    ("handle", f"V{IPC_HANDLE_BYTES}", 40),
    ("shm_name", f"S{SHM_NAME_BYTES}", 104),
    ("gpu_uuid", f"V{GPU_UUID_BYTES}", 232),
], 248)

LAYER = struct_dtype([
    ("layer", "<u4", 0),
    ("group", "<u2", 4),  # the KV cache group it belongs to (CommandFlag.LAYER_GROUP)
    ("offset_bytes", "<i8", 8),
    ("block_stride_bytes", "<i8", 16),
], 24)

EVENT_HANDLE = struct_dtype([("handle", f"V{IPC_HANDLE_BYTES}", 0)], IPC_HANDLE_BYTES)

# What a LOOKUP that takes part in compute once says of its vLLM (``engine/prefill_claims.py``):
# the tokens of a block, the prefill rate it expects, the most it waits for another's claim.
PREFILL = struct_dtype([
    ("block_tokens", "<u4", 0),
    ("tokens_per_s", "<u4", 4),
    ("wait_ms", "<u4", 8),
    ("reserved", "<u4", 12),
], 16)

BLOCK_ID = np.dtype("<i4")
TAG = np.dtype("<u8")  # one per block at the end of a VOTE_TAGS SAVE's payload

def _fingerprint() -> int:
    text = repr([
        WIRE_VERSION,
        *([(m.name, int(m)) for m in kind] for kind in (Opcode, Status, SlotState, RegionKind,
                                                         CommandFlag, ClientRole, KvRole)),
        *(d.descr for d in (CONTROL_HEADER, SLOT, RING_HEADER, SUBMISSION, COMPLETION,
                            HASH, REGION, LAYER, EVENT_HANDLE, PREFILL, STATS, CLIENT_STATS)),
    ])
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


FINGERPRINT = _fingerprint()

assert CONTROL_HEADER.itemsize == 128
assert SLOT.itemsize == 32
assert RING_HEADER.itemsize == 64
assert SUBMISSION.itemsize == 64
assert COMPLETION.itemsize == 48
assert HASH.itemsize == 40
assert REGION.itemsize == 248
assert LAYER.itemsize == 24
assert PREFILL.itemsize == 16
__all__ = ["CLIENT_STATS", "LATENCY_BUCKETS_S", "LATENCY_OPCODES", "NUM_LATENCY_BUCKETS",  # (stats_layout.py's)
           "NUM_OPCODE_COUNTERS", "NUM_STATUS_COUNTERS", "STATS", "STATS_COUNTER_NAMES", "struct_dtype"]


def gpu_uuid_text(uuid: bytes) -> str:
    """A REGION's ``gpu_uuid`` as ``nvidia-smi -L`` and CUDA_VISIBLE_DEVICES write it
    (``GPU-8-4-4-4-12`` hex digits), or ``host`` for the host stand-in."""
    if uuid == HOST_GPU_UUID:
        return "host"
    h = uuid.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def encode_hashes(hashes: list[bytes]) -> np.ndarray:
    """Pack block hashes (1..32 bytes each) into HASH records."""
    records = np.zeros(len(hashes), dtype=HASH)
    raw = records.view(np.uint8).reshape(len(hashes), HASH.itemsize)
    lengths = {len(h) for h in hashes}
    if len(lengths) == 1 and 0 < (size := lengths.pop()) <= HASH_BYTES:
        raw[:, :size] = np.frombuffer(b"".join(hashes), dtype=np.uint8).reshape(-1, size)
        raw[:, HASH_BYTES] = size
        return records
    for i, h in enumerate(hashes):
        if not 0 < len(h) <= HASH_BYTES:
            raise ValueError(f"block hash {i} has {len(h)} bytes; 1..{HASH_BYTES} allowed")
        raw[i, :len(h)] = np.frombuffer(h, dtype=np.uint8)
        raw[i, HASH_BYTES] = len(h)
    return records


def hash_keys(records: np.ndarray) -> list[bytes]:
    """One hashable key per HASH record (digest plus length, so short hashes stay distinct)."""
    width = HASH_BYTES + 1
    raw = np.ascontiguousarray(records).view(np.uint8).reshape(len(records), HASH.itemsize)
    keys = np.ascontiguousarray(raw[:, :width])
    if keys[:, HASH_BYTES].all():  # numpy's bytes strip trailing NULs: the length byte ends
        return keys.view(f"S{width}").ravel().tolist()  # each key, so none is lost (8x faster)
    flat = keys.tobytes()
    return [flat[i:i + width] for i in range(0, len(flat), width)]
