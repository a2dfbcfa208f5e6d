"""Commands in, index and copy work out, and exactly one completion per command.

Protocol (each a SUBMISSION on the client's ring, answered by one COMPLETION):

    ATTACH(arg=pid)            the handshake after a slot is claimed
    REGISTER(region, layers)   a region of KV memory and where each layer's pages are
    REGISTER_EVENTS(handles)   the client's pool of IPC events (cuda)
    LOOKUP(ns, hashes)         -> value = contiguous READY prefix, value2 = lease id
    RELEASE(arg=lease)         ends a lease
    SAVE(ns, ids, hashes)      client pages -> pool, ``layer`` or ALL_LAYERS; answered when copied
    LOAD(ns, ids, hashes)      pool -> client pages; answered when copied, or when issued if
                               the client's events fence it (``event_index``); with
                               AFTER_CLIENT, copied only after the client's last pool event
    PING, UNREGISTER, DETACH

A bad command (unknown opcode, wrong version, payload past the arena, block id out of
range, ...) is answered with its status and changes nothing.
"""

from __future__ import annotations

import itertools
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from engine.clients import ClientState
from engine.copy.base import CopyBackend, CopyDone, CopyOp, Direction
from engine.registration import register_events, register_region
from engine.index import BlockIndex, Key
from engine.stats import StatsWriter
from pegaflow.errors import CommandError, PegaflowError
from pegaflow.wire import (ALL_LAYERS, BLOCK_ID, HASH, NO_EVENT,
                           WIRE_VERSION, CommandFlag, Opcode, Status, hash_keys)

logger = logging.getLogger(__name__)

FIRST_CHUNK = 64
MAX_CHUNK = 1024
NO_PAYLOAD = np.zeros(0, dtype=np.uint8)
_OK, _ATTACH = Status.OK, Opcode.ATTACH  # enum members read off their class cost ~70 ns each
_READ_ONLY = frozenset({Opcode.PING, Opcode.ATTACH})
_SETUP = frozenset({Opcode.ATTACH, Opcode.REGISTER, Opcode.REGISTER_EVENTS})
_OPCODES = frozenset(Opcode)  # commands that leave the index (and gauges) be


@dataclass(slots=True)
class PendingCopy:
    """One SAVE or LOAD command (a SAVE is copied in chunks so the first bytes move early)."""

    client: ClientState
    request_id: int
    opcode: Opcode
    layer_mask: int
    bytes_per_block: int
    lease_id: int = 0
    is_answered: bool = False
    is_sealed: bool = False
    num_ops: int = 0
    num_blocks: int = 0
    num_deduped: int = 0
    num_dropped: int = 0
    error: str | None = None


def chunk_bounds(num_items: int):
    """[0, 64), then chunks growing 4x up to 1024, then the last 64 on their own.

    A SAVE's bookkeeping for each chunk hides behind the copy of the one before (a
    block's copy takes ~10x its bookkeeping); a short first chunk starts the copies
    early and a short last chunk keeps the bookkeeping after the final copy short.
    """
    tail = max(num_items - FIRST_CHUNK, min(num_items, FIRST_CHUNK))
    start, size = 0, FIRST_CHUNK
    while start < tail:
        end = min(tail, start + size)
        yield start, end
        start, size = end, min(size * 4, MAX_CHUNK)
    if start < num_items:
        yield start, num_items


class Dispatcher:
    def __init__(self, index: BlockIndex, backend: CopyBackend, stats: StatsWriter):
        self.index = index
        self.backend = backend
        self.stats = stats
        # Whether the index may have changed since the gauges were last written: set by
        # every command but the read-only ones, by finished copies and by release_client.
        self.gauges_stale = True
        self.pending: dict[int, PendingCopy] = {}
        self._tokens = itertools.count(1)
        self._handlers = {
            Opcode.ATTACH: self._attach, Opcode.DETACH: self._detach, Opcode.PING: self._ping,
            Opcode.REGISTER: self._register, Opcode.UNREGISTER: self._unregister,
            Opcode.REGISTER_EVENTS: self._register_events, Opcode.LOOKUP: self._lookup,
            Opcode.RELEASE: self._release, Opcode.SAVE: self._save, Opcode.LOAD: self._load,
        }

    def handle(self, client: ClientState, rec, payload: np.ndarray | None) -> None:
        """Check ``rec``, run its handler and answer it (now, or once its copies end);
        ``payload`` is ``read_payload``'s copy (None: out of the arena)."""
        request_id, opcode = rec.request_id, rec.opcode
        if opcode not in _READ_ONLY:
            self.gauges_stale = True
        try:
            if rec.version != WIRE_VERSION:
                raise CommandError(Status.BAD_VERSION, f"wire version {rec.version}")
            handler = self._handlers.get(opcode)
            if handler is None:
                raise CommandError(Status.BAD_OPCODE, f"unknown opcode {opcode}")
            if not client.is_attached and opcode != _ATTACH:
                raise CommandError(Status.NOT_ATTACHED, "ATTACH first")
            if payload is None:
                raise CommandError(Status.BAD_PAYLOAD, f"payload [{rec.payload_offset}, "
                                                  f"+{rec.payload_bytes}) past the arena")
            status, values = handler(client, rec, payload)
        except CommandError as exc:  # setup refusals stop a client from caching: say why
            logger.log(logging.WARNING if opcode in _SETUP else logging.DEBUG,
                       "slot %d (pid %d): %s refused: %s", client.slot, client.pid,
                       Opcode(opcode).name if opcode in _OPCODES else opcode, exc)
            status, values = Status(exc.status), (0, 0, 0)
        if status is not None:
            if self.gauges_stale:  # a client that reads the stats after our answer sees them
                self.update_gauges()
            client.answer(request_id, opcode, status, rec.num_items, *values)
            self.stats.count_command(opcode, status)

    def update_gauges(self) -> None:
        self.gauges_stale = False
        index = self.index
        pool, counters = index.pool, index.counters
        self.stats.set_gauges(pool.bytes_used, pool.num_entries, len(index.leases),
                              counters.evictions, counters.lease_expiries)

    @staticmethod
    def read_payload(client: ClientState, rec) -> np.ndarray | None:
        """A private copy of the command's payload, taken before its ring slot is handed
        back (after that the client may overwrite it); None if it lies past the arena."""
        offset, num_bytes = rec.payload_offset, rec.payload_bytes
        if num_bytes == 0:
            return NO_PAYLOAD
        arena = client.view.arena
        if offset + num_bytes > len(arena):
            return None
        return arena[offset:offset + num_bytes].copy()

    def _ping(self, client, rec, payload):
        return _OK, (len(self.pending), 0, 0)

    def _attach(self, client, rec, payload):
        client.pid, client.is_attached = rec.arg, True
        return Status.OK, (0, 0, 0)

    def _detach(self, client, rec, payload):
        """Answered once no copy touches the client's memory any more (it may free it then)."""
        client.is_attached = False
        client.is_detached = True
        if client.num_inflight:
            client.pending_detach = rec.request_id
            return None, None
        self.release_client(client)
        return Status.OK, (0, 0, 0)

    def _finish_detach(self, client: ClientState) -> None:
        self.release_client(client)
        self.update_gauges()
        client.answer(client.pending_detach, Opcode.DETACH, Status.OK)
        self.stats.count_command(Opcode.DETACH, Status.OK)
        client.pending_detach = 0

    def release_client(self, client: ClientState) -> None:
        """Leases, half-written blocks and memory of ``client``; copies must be over."""
        self.gauges_stale = True
        assert client.num_inflight == 0, "release_client with copies in flight"
        self.index.release_slot(client.slot)
        self.backend.unregister_client(client.slot)
        client.layers.clear()
        client.region_blocks.clear()
        client.page_bytes = client.num_events = 0

    # -- memory ---------------------------------------------------------------------------

    def _register(self, client, rec, payload):
        register_region(client, rec, payload, self.backend, self.index.pool)
        return Status.OK, (0, 0, 0)

    def _unregister(self, client, rec, payload):
        if client.num_inflight:
            raise CommandError(Status.BAD_ARGUMENT, "copies still in flight")
        self.release_client(client)
        return Status.OK, (0, 0, 0)

    def _register_events(self, client, rec, payload):
        register_events(client, rec, payload, self.backend)
        return Status.OK, (0, 0, 0)

    # -- blocks ---------------------------------------------------------------------------

    def _keys(self, rec, records: np.ndarray) -> list[Key]:
        namespace = rec.namespace
        if (records["length"] == 0).any() or (records["length"] > 32).any():
            raise CommandError(Status.BAD_PAYLOAD, "a hash record has a bad length")
        return [(namespace, key) for key in hash_keys(records)]

    def _lookup(self, client, rec, payload):
        num_items = rec.num_items
        if len(payload) != num_items * HASH.itemsize:
            raise CommandError(Status.BAD_PAYLOAD, "LOOKUP wants num_items hash records")
        num_hits, lease_id = self.index.lookup(client.slot, self._keys(rec, payload.view(HASH)))
        self.stats.add("lookups")
        self.stats.add("lookup_blocks", num_items)
        self.stats.add("lookup_hit_blocks", num_hits)
        return Status.OK, (num_hits, lease_id, 0)

    def _release(self, client, rec, payload):
        if not self.index.release(rec.arg):
            raise CommandError(Status.UNKNOWN_LEASE, f"no lease {rec.arg}")
        return Status.OK, (0, 0, 0)

    def _blocks(self, client: ClientState, rec, payload: np.ndarray):
        """Validated (block ids, keys, layer placements, layer mask) of a SAVE or LOAD."""
        num_items = rec.num_items
        if len(payload) != num_items * (BLOCK_ID.itemsize + HASH.itemsize):
            raise CommandError(Status.BAD_PAYLOAD, "SAVE/LOAD want num_items block ids and hashes")
        if not client.is_complete():
            raise CommandError(Status.UNKNOWN_REGION, "register every layer's KV memory first")
        if client.revoked:  # sent before the client gave up: its blocks may be someone else's
            raise CommandError(Status.BAD_ARGUMENT, "this client revoked its copies")
        split = num_items * BLOCK_ID.itemsize
        block_ids = payload[:split].view(BLOCK_ID).astype(np.int64)
        layer = rec.layer
        if layer == ALL_LAYERS:
            placements = [client.layers[i] for i in range(client.num_layers)]
        elif layer in client.layers:
            placements = [client.layers[layer]]
        else:
            raise CommandError(Status.BAD_ARGUMENT, f"layer {layer} is not registered")
        limit = min(client.region_blocks[p.region_id] for p in placements)
        if num_items and (block_ids.min() < 0 or block_ids.max() >= limit):
            raise CommandError(Status.BLOCK_OUT_OF_RANGE, f"block ids must lie in [0, {limit})")
        mask = sum(1 << p.layer for p in placements)
        return block_ids, self._keys(rec, payload[split:].view(HASH)), placements, mask

    def _check_event(self, client: ClientState, rec, count: int) -> int | None:
        index = rec.event_index
        if index == NO_EVENT:
            return None
        if index + count > client.num_events:
            raise CommandError(Status.BAD_ARGUMENT, f"event {index}+{count} outside the client's pool")
        return index

    def _save(self, client, rec, payload):
        block_ids, keys, placements, mask = self._blocks(client, rec, payload)
        per_layer = rec.layer == ALL_LAYERS  # then one event per layer, in layer order
        wait_event = self._check_event(client, rec, len(placements) if per_layer else 1)
        pending = PendingCopy(client, rec.request_id, Opcode.SAVE, mask,
                              len(placements) * client.page_bytes)
        ids = block_ids.tolist()
        with self._answered_on_fault(pending):
            for start, end in chunk_bounds(len(keys)):
                self._save_chunk(pending, ids[start:end], keys[start:end], placements,
                                 wait_event, per_layer)
        self.stats.add("save_dedup_blocks", pending.num_deduped)
        self.stats.add("save_dropped_blocks", pending.num_dropped)
        return self._seal(pending)

    def _save_chunk(self, pending: PendingCopy, ids: list[int], keys: list[Key], placements,
                    wait_event: int | None, per_layer: bool) -> None:
        client, mask = pending.client, pending.layer_mask
        chosen_ids, chosen_keys, offsets = [], [], []
        entries = self.index.reserve_many(keys, client.entry_bytes, client.num_layers, client.slot)
        for block_id, key, entry in zip(ids, keys, entries):
            if entry is None:
                pending.num_dropped += 1
            elif not mask & ~(entry.done_mask | entry.pending_mask):
                pending.num_deduped += 1  # stored, or on its way from another save
            else:
                entry.pending_mask |= mask
                chosen_ids.append(block_id)
                chosen_keys.append(key)
                offsets.append(entry.offset)
        if chosen_keys:
            self._submit(pending, chosen_keys, CopyOp(
                0, Direction.SAVE, client.slot, placements, client.page_bytes,
                np.array(chosen_ids, np.int64), np.array(offsets, np.int64),
                wait_event=wait_event, wait_per_layer=per_layer))

    @contextmanager
    def _answered_on_fault(self, pending: PendingCopy):
        """A fault (a bug) in the middle of a SAVE or LOAD: the server answers the command
        INTERNAL; the chunks already in flight finish their bookkeeping without a second
        answer, and the command's leases and marks are given back."""
        try:
            yield
        except BaseException:
            pending.error = pending.error or "internal error"
            pending.is_answered = True
            self._seal(pending)
            raise

    def _load(self, client, rec, payload):
        try:
            return self._start_load(client, rec, payload)
        except CommandError:
            if rec.flags & CommandFlag.RELEASE_LEASE:
                self.index.release(rec.arg)  # the lease dies with the load that was to use it
            raise

    def _start_load(self, client, rec, payload):
        started = time.perf_counter()
        block_ids, keys, placements, mask = self._blocks(client, rec, payload)
        record_events = self._check_event(client, rec, len(placements))
        entries = [self.index.get_ready(key) for key in keys]
        missing = sum(entry is None for entry in entries)
        if missing:
            raise CommandError(Status.MISSING_BLOCK, f"{missing} of {len(keys)} blocks are not stored")
        entry_bytes = client.entry_bytes
        if any(entry.entry_bytes != entry_bytes for entry in entries):
            raise CommandError(Status.BAD_ARGUMENT, "stored blocks have another geometry")
        lease_id = rec.arg if rec.flags & CommandFlag.RELEASE_LEASE else 0
        pending = PendingCopy(client, rec.request_id, Opcode.LOAD, mask,
                              len(placements) * client.page_bytes, lease_id=lease_id)
        offsets = np.array([entry.offset for entry in entries], np.int64)
        # One op: the backend moves layer 0 first, so the layer-wise pipeline starts early.
        self.index.pin(keys)
        planned = time.perf_counter()
        wait_event = None
        if rec.flags & CommandFlag.AFTER_CLIENT:
            if not client.num_events:
                raise CommandError(Status.BAD_ARGUMENT, "AFTER_CLIENT without registered events")
            wait_event = client.num_events - 1
        if keys:
            with self._answered_on_fault(pending):
                self._submit(pending, keys, CopyOp(0, Direction.LOAD, client.slot, placements,
                                                   client.page_bytes, block_ids, offsets,
                                                   wait_event=wait_event, record_events=record_events))
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("slot %d: LOAD of %d blocks x %d layers: planned in %.2f ms, issued in "
                         "%.2f ms", client.slot, len(keys), len(placements),
                         (planned - started) * 1e3, (time.perf_counter() - planned) * 1e3)
        if record_events is not None:
            for done in self.backend.poll():  # a refusal at submit must not be answered OK
                self.on_copy_done(done)
        if record_events is not None and pending.error is None and keys:
            pending.is_answered = True  # the client's events fence the data, not our answer
            self.update_gauges()
            self.stats.count_command(Opcode.LOAD, Status.OK)
            pending.client.answer(pending.request_id, Opcode.LOAD, Status.OK, len(keys), len(keys))
        return self._seal(pending)

    def _submit(self, pending: PendingCopy, keys: list[Key], op: CopyOp) -> None:
        """Hand one chunk to the backend; ``on_copy_done`` finishes it."""
        op.token = next(self._tokens)
        if pending.error is None:
            try:
                self.backend.submit(op)
            except PegaflowError as exc:
                logger.error("slot %d: %s of %d blocks failed to start: %s", pending.client.slot,
                             pending.opcode.name, len(keys), exc)
                pending.error = str(exc)
            except BaseException:
                self._finish_chunk(pending, keys, "internal error")  # unpin / unmark, then raise
                raise
        if pending.error is not None:
            self._finish_chunk(pending, keys, pending.error)
            return
        self.pending[op.token] = (pending, keys)
        pending.num_ops += 1
        pending.client.num_inflight += 1

    def _seal(self, pending: PendingCopy):
        """All chunks are submitted: answer now if none is in flight, else when the last ends."""
        pending.is_sealed = True
        self.stats.set("inflight_copies", len(self.pending))
        if pending.num_ops:
            return None, None
        self._complete(pending)
        return None, None

    def on_copy_done(self, done: CopyDone) -> None:
        self.gauges_stale = True
        pending, keys = self.pending.pop(done.token)
        pending.num_ops -= 1
        pending.client.num_inflight -= 1
        self.stats.set("inflight_copies", len(self.pending))
        if done.error is not None and pending.error is None:
            pending.error = done.error
        self._finish_chunk(pending, keys, done.error)
        if pending.num_ops == 0 and pending.is_sealed:
            self._complete(pending)
        if pending.client.pending_detach and pending.client.num_inflight == 0:
            self._finish_detach(pending.client)

    def _complete(self, pending: PendingCopy) -> None:
        if pending.opcode == Opcode.LOAD and pending.lease_id:
            self.index.release(pending.lease_id)
        if pending.is_answered:
            if pending.error:
                logger.error("slot %d: %s failed after it was answered: %s", pending.client.slot,
                             pending.opcode.name, pending.error)
            return
        status = Status.OK if pending.error is None else Status.COPY_FAILED
        self.update_gauges()
        pending.client.answer(pending.request_id, pending.opcode, status, pending.num_blocks,
                              pending.num_blocks, pending.num_deduped, pending.num_dropped)
        self.stats.count_command(pending.opcode, status)

    def _finish_chunk(self, pending: PendingCopy, keys: list[Key], error: str | None) -> None:
        """Index bookkeeping once a chunk's copy is over (or never started)."""
        num_bytes = len(keys) * pending.bytes_per_block
        if pending.opcode == Opcode.LOAD:
            self.index.unpin(keys)
            if error is None:
                pending.num_blocks += len(keys)
                self.stats.add("bytes_loaded", num_bytes)
                if pending.layer_mask & 1:
                    self.stats.add("blocks_loaded", len(keys))
            return
        if error is None and pending.client.revoked:
            error = "the client revoked its copies"  # it may have reused the blocks meanwhile
            pending.error = pending.error or error
            logger.warning("slot %d: %d blocks copied after the client revoked its copies: "
                           "not stored", pending.client.slot, len(keys))
        if error is not None:
            for key in keys:
                self.index.abandon_layers(key, pending.layer_mask)
            return
        num_ready = self.index.mark_layers_done(keys, pending.layer_mask)
        pending.num_blocks += len(keys)
        self.stats.add("blocks_saved", num_ready)
        self.stats.add("bytes_saved", num_bytes)
