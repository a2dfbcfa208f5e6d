"""One command per opcode and the records around it, for the tests of pegaflow/platform/protocol/."""

from __future__ import annotations

import numpy as np

from pegaflow.platform import protocol
from pegaflow.platform.cuda.ipc import ExportedAllocation, region_record
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
    SUBMISSION,
    WIRE_VERSION,
    ClientRole,
    KvRole,
    Opcode,
    encode_hashes,
)

make_submission = record_type(SUBMISSION)


def random_hashes(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return encode_hashes([rng.bytes(32) for _ in range(n)])


GPU_UUID = bytes.fromhex("5e1f0c2a9b7d4e61a3c8f0d2b4e6a8c0")


def region_and_layers() -> tuple[np.ndarray, np.ndarray]:
    """A REGION as a CUDA client writes it (its device 2 is GPU_UUID) and two LAYERs."""
    exported = ExportedAllocation(bytes(range(64)), 512, 1 << 20, 2, GPU_UUID)
    region = region_record(exported, 2, 16, 4096)
    layers = np.zeros(2, LAYER)
    layers["layer"], layers["group"], layers["block_stride_bytes"] = [0, 1], [0, 1], 4096
    return region, layers


def one_command_per_opcode() -> list:
    """One command per opcode, with every field away from its default where it has one."""
    region, layers = region_and_layers()
    ids = np.array([3, 1, 2], np.int32)
    return [
        Attach(4242, ClientRole.WORKER, KvRole.CONSUMER, 3, 0x1234, 77, Voters(2, 1)),
        Detach(), Register(5, region[0], layers), Unregister(),
        RegisterEvents(np.zeros(4, EVENT_HANDLE)),
        Lookup(9, random_hashes(4), wait_ms=25), Lookup(9, random_hashes(4), prefill=Prefill(16, 40_000, 3000)),
        Release(31),
        Save(9, ids, random_hashes(3), group=2, first_event=4, one_event=True, tags=np.array([7, 7, 8], np.uint64)),
        Load(9, ids, random_hashes(3, 1), lease_id=12, ends_lease=False, layer=1, first_event=2, after_client=True),
        Ping(),
        Drop(9, random_hashes(2), since_command=40),
        ReleaseClaim(random_hashes(5, 2)),
        Reset(0x5EED),
    ]


def round_trip(command):
    """``command`` encoded onto a SUBMISSION and its payload bytes, then decoded."""
    encoded = protocol.encode(command)
    payload = (np.concatenate([np.ascontiguousarray(p).view(np.uint8).ravel() for p in encoded.payload])
               if encoded.payload else protocol.NO_PAYLOAD)
    rec = make_submission(0, *protocol.record_fields(1, encoded, 0, payload.nbytes))
    assert rec.version == WIRE_VERSION
    return protocol.decode(protocol.check_envelope(rec), rec, payload)


def submission(opcode: Opcode, **fields):
    """A SUBMISSION of ``opcode`` with these wire fields (as the engine reads one, by place)."""
    return make_submission(0, *protocol.record_fields(1, protocol.raw_submission(opcode, **fields), 0, 0))


def same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray) or isinstance(a, np.void):
        return np.asarray(a).tobytes() == np.asarray(b).tobytes()
    return a == b
