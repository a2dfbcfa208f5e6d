"""The commands a client sends the engine and their answers: one typed value per opcode.

Each command is declared here once: a frozen dataclass whose fields say what they carry,
its ``OPCODE``, its ``Answer`` (a named tuple of what an OK answer's values mean), and
one encoder and one decoder between it and the fixed SUBMISSION record plus payload of
``wire.py``.  The client encodes (``encode``), the engine decodes once before dispatch
(``check_envelope``, then ``decode``); nothing else reads a record's generic fields.

    Attach(pid, role, kv_role, rank, namespace, instance, voters)     -> Done
    Detach()                                                          -> Done, once no copy
                                                                         touches the client's memory
    Register(region_id, region, layers)   a region of KV memory       -> Done
    Unregister()                                                      -> Done
    RegisterEvents(handles)               the client's pool of events -> Done
    Lookup(namespace, hashes, wait_ms, prefill)  the cached prefix, leased -> LookupAnswer
                                          (with ``prefill``: a claim on what it misses, or a
                                          wait for another instance's: compute once)
    ReleaseClaim(hashes)                  the instance's claims on them end -> Done
    Release(lease_id)                     ends a lease                -> Done
    Save(namespace, block_ids, hashes, ...)   client pages -> pool    -> SaveAnswer
    Load(namespace, block_ids, hashes, ...)   pool -> client pages    -> LoadAnswer
    Ping()                                                            -> PingAnswer
    Drop(namespace, hashes, since_command)    forget blocks from bad data -> DropAnswer
    Reset(namespace)                      every block of a namespace forgotten -> ResetAnswer

What a SAVE or LOAD of several layers means for events (one rule, named):

    - the layers copied are one layer, every layer (``ALL_LAYERS``), or one KV cache
      group's (``group``: its layers in the order REGISTER listed them);
    - ``first_event``: the k-th of those layers' copy uses the client's event
      ``layer_event(first_event, k)``: a SAVE's waits for it, a LOAD's records it when the
      layer has landed (a fenced LOAD is answered once issued: the events tell the client's
      GPU); a SAVE with ``one_event`` waits for ``first_event`` alone for every layer;
    - a LOAD ``after_client`` copies only once the client's stream reaches its pool's last
      event (``last_pool_event``): vLLM's kernels still queued there may write blocks it has
      just given to this load, so the client records that event before sending the LOAD;
    - a LOAD's ``lease_id`` (a LOOKUP's) pins its blocks; it ends with the LOAD, or with a
      later LOAD of the same lease (``ends_lease`` False: one KV cache group's of several).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import numpy as np

from pegaflow.platform.wire import ALL_LAYERS, NO_EVENT, ClientRole, KvRole, Opcode, encode_hashes, hash_keys

Key = tuple[int, bytes]  # an index key: (namespace, hash key of ``hash_keys``)
NO_PAYLOAD = np.zeros(0, dtype=np.uint8)


def layer_event(first_event: int, position: int) -> int:
    """The event of the ``position``-th layer a SAVE or LOAD copies (in its layer order)."""
    return first_event + position


def event_or_none(event_index: int) -> int | None:
    """A record's event index as a command holds it: None for ``NO_EVENT``."""
    return None if event_index == NO_EVENT else event_index


def last_pool_event(num_events: int) -> int:
    """The event an ``after_client`` LOAD waits for: the last of the client's pool."""
    return num_events - 1


class Done(NamedTuple):
    """The answer of a command whose OK says it all."""


class PingAnswer(NamedTuple):
    num_inflight: int  # the engine's copies in flight


class LookupAnswer(NamedTuple):
    num_hit_blocks: int   # the prefix found (in the pool, or on disk or remote being read into it)
    lease_id: int         # pins it (0: none)
    num_disk_blocks: int  # how many of its blocks are still being read (their LOAD waits)


class SaveAnswer(NamedTuple):
    num_stored: int   # copied
    num_deduped: int  # held already
    num_dropped: int  # no room


class LoadAnswer(NamedTuple):
    num_loaded: int


class DropAnswer(NamedTuple):
    num_found: int  # blocks it held that the SAVEs named stored


class ResetAnswer(NamedTuple):
    num_dropped: int       # the pool's blocks of the namespace forgotten
    num_held: int          # of them leased or being copied then: never served again, freed when let go
    num_disk_dropped: int  # the disk tier's blocks of the namespace removed


@dataclass(frozen=True, slots=True)
class Voters:
    """A voter's place (wire.py: voting): how many clients save a namespace alike, and which."""

    num_voters: int
    voter: int


@dataclass(frozen=True, slots=True)
class Attach:
    OPCODE: ClassVar[Opcode] = Opcode.ATTACH
    Answer: ClassVar[type] = Done
    pid: int
    role: ClientRole = ClientRole.OTHER
    kv_role: KvRole = KvRole.BOTH
    rank: int = 0  # a worker's TP/PP rank index (shown in the stats)
    namespace: int = 0
    instance: int = 0  # its vLLM instance (0: none)
    voters: Voters | None = None


@dataclass(frozen=True, slots=True)
class Detach:
    OPCODE: ClassVar[Opcode] = Opcode.DETACH
    Answer: ClassVar[type] = Done


@dataclass(frozen=True, slots=True)
class Register:
    OPCODE: ClassVar[Opcode] = Opcode.REGISTER
    Answer: ClassVar[type] = Done
    region_id: int
    region: np.ndarray  # one wire.REGION record
    layers: np.ndarray  # wire.LAYER records


@dataclass(frozen=True, slots=True)
class Unregister:
    OPCODE: ClassVar[Opcode] = Opcode.UNREGISTER
    Answer: ClassVar[type] = Done


@dataclass(frozen=True, slots=True)
class RegisterEvents:
    OPCODE: ClassVar[Opcode] = Opcode.REGISTER_EVENTS
    Answer: ClassVar[type] = Done
    handles: np.ndarray  # wire.EVENT_HANDLE records (or their bytes)


@dataclass(frozen=True, slots=True)
class Prefill:
    """A LOOKUP's part in compute once (``engine/prefill_claims.py``): what its vLLM expects
    of a prefill, and the most it waits for another instance's claim."""

    block_tokens: int  # tokens per block
    tokens_per_s: int  # the prefill rate it expects of itself
    wait_ms: int       # the most it waits for blocks another instance claimed


@dataclass(frozen=True, slots=True)
class Lookup:
    OPCODE: ClassVar[Opcode] = Opcode.LOOKUP
    Answer: ClassVar[type] = LookupAnswer
    namespace: int
    hashes: np.ndarray  # wire.HASH records
    wait_ms: int | None = None  # the most to wait for saves in flight (None: the engine's)
    prefill: Prefill | None = None  # takes part in compute once (None: claims nothing, waits for none)

    def keys(self) -> list[Key]:
        return keys_of(self.namespace, self.hashes)


@dataclass(frozen=True, slots=True)
class Release:
    OPCODE: ClassVar[Opcode] = Opcode.RELEASE
    Answer: ClassVar[type] = Done
    lease_id: int


@dataclass(frozen=True, slots=True)
class ReleaseClaim:
    OPCODE: ClassVar[Opcode] = Opcode.RELEASE_CLAIM
    Answer: ClassVar[type] = Done
    hashes: np.ndarray  # wire.HASH records: the blocks a request of this instance claimed

    def hash_keys(self) -> list[bytes]:
        return hash_keys(self.hashes)


@dataclass(frozen=True, slots=True)
class Save:
    OPCODE: ClassVar[Opcode] = Opcode.SAVE
    Answer: ClassVar[type] = SaveAnswer
    namespace: int
    block_ids: np.ndarray  # BLOCK_ID, one per hash
    hashes: np.ndarray     # wire.HASH records
    layer: int = ALL_LAYERS
    group: int | None = None      # instead of ``layer``: that KV cache group's layers
    first_event: int | None = None
    one_event: bool = False       # every layer waits for ``first_event`` alone
    tags: np.ndarray | None = None  # a voter's: one TAG per block

    def keys(self) -> list[Key]:
        return keys_of(self.namespace, self.hashes)


@dataclass(frozen=True, slots=True)
class Load:
    OPCODE: ClassVar[Opcode] = Opcode.LOAD
    Answer: ClassVar[type] = LoadAnswer
    namespace: int
    block_ids: np.ndarray
    hashes: np.ndarray
    lease_id: int = 0
    ends_lease: bool = True   # False: another LOAD of the lease ends it
    layer: int = ALL_LAYERS
    group: int | None = None
    first_event: int | None = None  # fenced: answered once issued, the events record the landing
    after_client: bool = False

    def keys(self) -> list[Key]:
        return keys_of(self.namespace, self.hashes)


@dataclass(frozen=True, slots=True)
class Ping:
    OPCODE: ClassVar[Opcode] = Opcode.PING
    Answer: ClassVar[type] = PingAnswer


@dataclass(frozen=True, slots=True)
class Drop:
    OPCODE: ClassVar[Opcode] = Opcode.DROP
    Answer: ClassVar[type] = DropAnswer
    namespace: int
    hashes: np.ndarray
    since_command: int = 0  # only blocks stored by SAVEs from this command id on

    def keys(self) -> list[Key]:
        return keys_of(self.namespace, self.hashes)


@dataclass(frozen=True, slots=True)
class Reset:
    """Empty the cache of one namespace (``engine/commands/reset.py`` says whose namespaces
    a client may name): vLLM's ``reset_prefix_cache`` with ``reset_external``."""

    OPCODE: ClassVar[Opcode] = Opcode.RESET
    Answer: ClassVar[type] = ResetAnswer
    namespace: int


Command = (Attach | Detach | Register | Unregister | RegisterEvents | Lookup | Release | Save | Load | Ping | Drop
           | ReleaseClaim | Reset)
COMMANDS: dict[Opcode, type] = {kind.OPCODE: kind for kind in Command.__args__}
ANSWERS: dict[Opcode, type] = {opcode: kind.Answer for opcode, kind in COMMANDS.items()}


def hash_records(hashes) -> np.ndarray:
    """HASH records from a list of bytes, or records already encoded."""
    return hashes if isinstance(hashes, np.ndarray) else encode_hashes(hashes)


def keys_of(namespace: int, records: np.ndarray) -> list[Key]:
    """The index keys of HASH records (their lengths were checked at decode)."""
    return [(namespace, key) for key in hash_keys(records)]

