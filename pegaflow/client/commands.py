"""The commands a client sends, by name (``EngineClient``'s named half): each method builds
one typed command of ``pegaflow.platform.protocol`` and submits it, or waits for its answer.

``EngineClient`` (``connection.py``) provides ``submit``, ``wait``, ``call`` and the answers
kept until asked for (``answers``: a fire-and-forget answer is ignored there).
"""

from __future__ import annotations

from pegaflow.client.completion import LookupResult, checked
from pegaflow.platform.protocol import (
    Drop,
    Load,
    Lookup,
    Ping,
    Prefill,
    Register,
    RegisterEvents,
    Release,
    ReleaseClaim,
    Save,
    event_or_none,
    hash_records,
)
from pegaflow.platform.wire import ALL_LAYERS, NO_EVENT, Opcode

_PING = Ping()
_PING_OP, _LOOKUP_OP = Opcode.PING, Opcode.LOOKUP  # read once: an enum member's lookup is slow


class EngineCommands:
    def ping(self, timeout_s: float | None = None) -> int:
        """A round trip; returns the engine's number of copies in flight."""
        return checked(_PING_OP, self.wait(self.submit(_PING, timeout_s=timeout_s), timeout_s)).value

    def lookup(self, namespace: int, hashes, timeout_s: float | None = None,
               wait_ms: int | None = None, prefill: Prefill | None = None) -> LookupResult:
        """Length of the cached prefix of ``hashes``, pinned under a lease until released."""
        done = checked(_LOOKUP_OP, self.wait(self.submit_lookup(namespace, hashes, timeout_s, wait_ms, prefill),
                                                 timeout_s))
        return done.result

    def submit_lookup(self, namespace: int, hashes, timeout_s: float | None = None,
                      wait_ms: int | None = None, prefill: Prefill | None = None) -> int:
        """``wait_ms``: the most the engine waits for blocks of the prefix still being saved
        (None: the engine's --lookup-wait-ms; 0: no wait).  ``prefill``: this instance takes
        part in compute once (it claims what it misses, waits for what another claimed)."""
        return self.submit(Lookup(namespace, hash_records(hashes), wait_ms, prefill), timeout_s=timeout_s)

    def release_claim_nowait(self, hashes) -> None:
        """End this instance's claims on ``hashes`` (compute once), fire and forget."""
        self.answers.ignore(self.submit(ReleaseClaim(hash_records(hashes))))

    def release(self, lease_id: int) -> int:
        """End a lease; returns the command id to wait on."""
        return self.submit(Release(lease_id))

    def release_nowait(self, lease_id: int) -> None:
        """End a lease, fire and forget: its answer is dropped on arrival."""
        self.answers.ignore(self.release(lease_id))

    def submit_save(self, namespace: int, block_ids, hashes: list[bytes], *,
                    layer: int = ALL_LAYERS, event_index: int = NO_EVENT,
                    one_event: bool = False, group: int | None = None, tags=None) -> int:
        """``event_index``: the first event (protocol.py: the k-th layer copied waits for
        ``layer_event(event_index, k)``; with ``one_event``, every layer for ``event_index``
        alone).  ``group``: only that KV cache group's layers, instead of ``layer``.
        ``tags``: a voter's (one u64 per block, wire.py: voting)."""
        return self.submit(Save(namespace, block_ids, hash_records(hashes), layer, group,
                                event_or_none(event_index), one_event, tags))

    def submit_drop(self, namespace: int, hashes, since_request: int = 0) -> int:
        """Ask the engine to forget those of these blocks that our SAVEs from command id
        ``since_request`` on stored (their data was found bad since); the answer's
        ``value`` is how many it held."""
        return self.submit(Drop(namespace, hash_records(hashes), since_request))

    def drop_nowait(self, namespace: int, hashes, since_request: int = 0) -> None:
        """``submit_drop``, fire and forget: its answer is dropped on arrival."""
        self.answers.ignore(self.submit_drop(namespace, hashes, since_request))

    def submit_load(self, namespace: int, block_ids, hashes: list[bytes], *, lease_id: int = 0,
                    layer: int = ALL_LAYERS, event_index: int = NO_EVENT,
                    after_client: bool = False, group: int | None = None,
                    ends_lease: bool = True) -> int:
        """``after_client``: the copy waits for the last event of our pool, which the caller
        recorded on its stream before this call.  ``event_index``: the first event the
        layers' copies record (protocol.py).  ``group``: only that KV cache group's layers,
        instead of ``layer``.  ``ends_lease`` False: ``lease_id`` pins these blocks and
        another LOAD (a later group's) ends it."""
        return self.submit(Load(namespace, block_ids, hash_records(hashes), lease_id, ends_lease,
                                layer, group, event_or_none(event_index), after_client))

    def register_region(self, region_id: int, region, layers) -> None:
        """REGISTER one region of KV memory (a wire.REGION record and its wire.LAYER records)."""
        self.call(Register(region_id, region, layers))

    def register_events(self, handles) -> None:
        self.call(RegisterEvents(handles))
