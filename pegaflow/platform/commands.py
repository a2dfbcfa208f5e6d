"""The commands a client sends, by name: what each one's payload and flags are.

``EngineCommands`` is the named half of ``EngineClient`` (``client.py`` is the connection:
attach, submit, wait, close); each method here builds one command with ``submit`` or
``call`` and says what its answer means.
"""

from __future__ import annotations

import numpy as np

from pegaflow.client.completion import LookupResult, checked
from pegaflow.platform.wire import ALL_LAYERS, BLOCK_ID, NO_EVENT, TAG, CommandFlag, Opcode, encode_hashes

_PING = Opcode.PING


def _records(hashes) -> np.ndarray:
    """HASH records from a list of bytes, or records already encoded."""
    return hashes if isinstance(hashes, np.ndarray) else encode_hashes(hashes)


class EngineCommands:
    """Mixed into ``EngineClient``, which provides ``submit``, ``call``, ``wait`` and the
    answers kept until asked for (``answers``: a fire-and-forget answer is ignored there)."""

    def ping(self, timeout_s: float | None = None) -> int:
        """A round trip; returns the engine's number of copies in flight."""
        return checked(_PING, self.wait(self.submit(_PING, timeout_s=timeout_s), timeout_s)).value

    def lookup(self, namespace: int, hashes, timeout_s: float | None = None,
               wait_ms: int | None = None) -> LookupResult:
        """Length of the cached prefix of ``hashes``, pinned under a lease until released."""
        done = checked(Opcode.LOOKUP, self.wait(self.submit_lookup(namespace, hashes, timeout_s, wait_ms),
                                                 timeout_s))
        return done.result

    def submit_lookup(self, namespace: int, hashes, timeout_s: float | None = None,
                      wait_ms: int | None = None) -> int:
        """``wait_ms``: the most the engine waits for blocks of the prefix still being saved
        (None: the engine's --lookup-wait-ms; 0: no wait)."""
        records = _records(hashes)
        arg = 0 if wait_ms is None else 1 + max(0, int(wait_ms))
        return self.submit(Opcode.LOOKUP, payload=[records], num_items=len(records),
                           namespace=namespace, arg=arg, timeout_s=timeout_s)

    def release(self, lease_id: int) -> int:
        """End a lease; returns the request id to wait on."""
        return self.submit(Opcode.RELEASE, arg=lease_id)

    def release_nowait(self, lease_id: int) -> None:
        """End a lease, fire and forget: its answer is dropped on arrival."""
        self.answers.ignore(self.release(lease_id))

    def submit_save(self, namespace: int, block_ids, hashes: list[bytes], *,
                    layer: int = ALL_LAYERS, event_index: int = NO_EVENT,
                    one_event: bool = False, group: int | None = None, tags=None) -> int:
        """``one_event``: every layer's copy waits for ``event_index`` alone (else, for all
        layers, layer k waits for ``event_index + k``).  ``group``: only that KV cache
        group's layers (its k-th layer waits for ``event_index + k``), instead of ``layer``.
        ``tags``: a voter's (one u64 per block, wire.py: voting)."""
        ids = np.asarray(block_ids, dtype=BLOCK_ID)
        flags = CommandFlag.ONE_EVENT if one_event else CommandFlag.NONE
        if group is not None:
            flags, layer = flags | CommandFlag.LAYER_GROUP, group
        payload = [ids, _records(hashes)]
        if tags is not None:
            flags |= CommandFlag.VOTE_TAGS
            payload.append(np.asarray(tags, dtype=TAG))
        return self.submit(Opcode.SAVE, payload=payload, num_items=len(ids),
                           namespace=namespace, layer=layer, event_index=event_index,
                           flags=int(flags))

    def submit_drop(self, namespace: int, hashes, since_request: int = 0) -> int:
        """Ask the engine to forget those of these blocks that our SAVEs from request
        ``since_request`` on stored (their data was found bad since); the answer's
        ``value`` is how many it held."""
        records = _records(hashes)
        return self.submit(Opcode.DROP, payload=[records], num_items=len(records),
                           namespace=namespace, arg=since_request)

    def drop_nowait(self, namespace: int, hashes, since_request: int = 0) -> None:
        """``submit_drop``, fire and forget: its answer is dropped on arrival."""
        self.answers.ignore(self.submit_drop(namespace, hashes, since_request))

    def submit_load(self, namespace: int, block_ids, hashes: list[bytes], *, lease_id: int = 0,
                    layer: int = ALL_LAYERS, event_index: int = NO_EVENT,
                    after_client: bool = False, group: int | None = None,
                    ends_lease: bool = True) -> int:
        """``after_client``: the copy waits for the last event of our pool, which the caller
        recorded on its stream before this call.  ``group``: only that KV cache group's
        layers (the k-th records ``event_index + k``), instead of ``layer``.  ``ends_lease``
        False: ``lease_id`` pins these blocks and another LOAD (a later group's) ends it."""
        ids = np.asarray(block_ids, dtype=BLOCK_ID)
        flags = CommandFlag.NONE
        if lease_id:
            flags = CommandFlag.RELEASE_LEASE if ends_lease else CommandFlag.LEASE_HELD
        if after_client:
            flags |= CommandFlag.AFTER_CLIENT
        if group is not None:
            flags, layer = flags | CommandFlag.LAYER_GROUP, group
        return self.submit(Opcode.LOAD, payload=[ids, _records(hashes)], num_items=len(ids),
                           namespace=namespace, layer=layer, event_index=event_index,
                           arg=lease_id, flags=int(flags))

    def register_region(self, region_id: int, region: np.ndarray, layers: np.ndarray) -> None:
        """REGISTER one region of KV memory (a wire.REGION record and its wire.LAYER records)."""
        self.call(Opcode.REGISTER, payload=[region, layers], num_items=len(layers),
                  region_id=region_id)

    def register_events(self, handles: np.ndarray) -> None:
        self.call(Opcode.REGISTER_EVENTS, payload=[handles], num_items=len(handles))
