"""SAVE and LOAD: checked against the client's registration, planned against the index,
handed to the copy backend in chunks, and answered exactly once.

A SAVE reserves pool entries chunk by chunk (64 blocks, then doubling up to 1024, the
last 64 alone) and marks the layers it copies pending; a finished chunk marks them done, a
failed or revoked one abandons them.  A LOAD pins its entries for one op of every
layer; a fenced LOAD (``event_index``) is answered when issued, the client's events
telling its GPU when each layer has landed; with AFTER_CLIENT its copies wait for the
client's last pool event first.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from contextlib import contextmanager

import numpy as np

from pegaflow.platform.errors import CommandError, PegaflowError
from pegaflow.platform.wire import ALL_LAYERS, BLOCK_ID, HASH, NO_EVENT, CommandFlag, Opcode, Status

from . import votes
from .clients import ClientState
from .copy.base import CopyBackend, CopyDone, CopyOp, Direction
from .entries import Key
from .index import BlockIndex
from .parked_loads import ParkedLoads
from .pending import ANSWERED_LATER, PendingCopy, chunk_bounds, command_keys
from .stats import StatsWriter
from .votes import Vote

logger = logging.getLogger(__name__)


class Transfers:
    def __init__(self, index: BlockIndex, backend: CopyBackend, stats: StatsWriter,
                 reply: Callable[..., None]):
        self.index = index
        self.backend = backend
        self.stats = stats
        self.reply = reply  # the dispatcher's: the one way a command is answered
        self.pending: dict[int, tuple[PendingCopy, list[Key]]] = {}
        self.parked = ParkedLoads()  # LOADs waiting for the disk tier's reads
        self._tokens = itertools.count(1)

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
        if rec.flags & CommandFlag.LAYER_GROUP:
            if layer not in client.groups:
                raise CommandError(Status.BAD_ARGUMENT, f"no layer is registered in group {layer}")
            placements = [client.layers[i] for i in client.groups[layer]]
        elif layer == ALL_LAYERS:
            placements = [client.layers[i] for i in range(client.num_layers)]
        elif layer in client.layers:
            placements = [client.layers[layer]]
        else:
            raise CommandError(Status.BAD_ARGUMENT, f"layer {layer} is not registered")
        limit = min(client.region_blocks[p.region_id] for p in placements)
        if num_items and (block_ids.min() < 0 or block_ids.max() >= limit):
            raise CommandError(Status.BLOCK_OUT_OF_RANGE, f"block ids must lie in [0, {limit})")
        mask = sum(1 << p.layer for p in placements)
        return block_ids, command_keys(rec, payload[split:].view(HASH)), placements, mask

    def _check_event(self, client: ClientState, rec, count: int) -> int | None:
        index = rec.event_index
        if index == NO_EVENT:
            return None
        if index + count > client.num_events:
            raise CommandError(Status.BAD_ARGUMENT, f"event {index}+{count} outside the client's pool")
        return index

    def save(self, client, rec, payload):
        received = time.perf_counter()
        payload, tags = votes.split_tags(client, rec, payload)
        block_ids, keys, placements, mask = self._blocks(client, rec, payload)
        # All layers (or a group's): one event per layer, in layer order, unless ONE_EVENT
        # fences them all.
        is_many = rec.layer == ALL_LAYERS or bool(rec.flags & CommandFlag.LAYER_GROUP)
        per_layer = is_many and not rec.flags & CommandFlag.ONE_EVENT
        wait_event = self._check_event(client, rec, len(placements) if per_layer else 1)
        pending = PendingCopy(client, rec.request_id, Opcode.SAVE, mask,
                              len(placements) * client.page_bytes, chain=keys,
                              received_at=received, is_timed=logger.isEnabledFor(logging.DEBUG))
        ids = block_ids.tolist()
        with self._answered_on_fault(pending):
            for start, end in chunk_bounds(len(keys)):
                self._save_chunk(pending, ids[start:end], keys[start:end], placements,
                                 wait_event, per_layer, None if tags is None else tags[start:end])
        self.stats.add("save_dedup_blocks", pending.num_deduped)
        self.stats.add("save_dropped_blocks", pending.num_dropped)
        return self._seal(pending)

    def _save_chunk(self, pending: PendingCopy, ids: list[int], keys: list[Key], placements,
                    wait_event: int | None, per_layer: bool, tags: list[int] | None) -> None:
        client, mask = pending.client, pending.layer_mask
        chosen_ids, chosen_keys, offsets = [], [], []
        entries = self.index.reserve_many(keys, client.entry_bytes, client.num_layers, client.slot,
                                          (client.uid, pending.request_id))
        voted = None if tags is None else votes.cast_all(self.index, self.stats, client, mask, keys,
                                                          entries, tags)
        for i, (block_id, key, entry) in enumerate(zip(ids, keys, entries)):
            if entry is None or entry.is_doomed:  # pool full, or a dropped block still in use
                pending.num_dropped += 1
            elif voted is not None and voted[i] is not Vote.USUAL:
                if voted[i] is Vote.COPY:  # (marked pending already)
                    chosen_ids.append(block_id)
                    chosen_keys.append(key)
                    offsets.append(entry.offset)
                else:
                    pending.num_deduped += 1
            elif not mask & ~(entry.done_mask | entry.pending_mask) or mask & entry.pending_mask:
                # Stored, or on its way from another save.  A save that shares a layer with
                # one still in flight leaves the block to it: copying that layer twice, the
                # other copy (of a client that may since have revoked it) could land last.
                pending.num_deduped += 1
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

    def load(self, client, rec, payload):
        names_lease = bool(rec.flags & (CommandFlag.RELEASE_LEASE | CommandFlag.LEASE_HELD))
        if names_lease and self.index.is_foreign_lease(rec.arg, client.instance):
            raise CommandError(Status.UNKNOWN_LEASE, f"lease {rec.arg} is another vLLM instance's")
        if names_lease and self.index.is_promoting(rec.arg):
            self.parked.park(client, rec, payload, time.monotonic())  # resumed once the reads end
            return ANSWERED_LATER, None
        try:
            return self._start_load(client, rec, payload)
        except CommandError:
            if rec.flags & CommandFlag.RELEASE_LEASE:
                self.index.release(rec.arg)  # the lease dies with the load that was to use it
            raise

    def _start_load(self, client, rec, payload):
        received = time.perf_counter()
        block_ids, keys, placements, mask = self._blocks(client, rec, payload)
        record_events = self._check_event(client, rec, len(placements))
        wait_event = None
        if rec.flags & CommandFlag.AFTER_CLIENT:
            if not client.num_events:
                raise CommandError(Status.BAD_ARGUMENT, "AFTER_CLIENT without registered events")
            wait_event = client.num_events - 1
        lease_id = rec.arg if rec.flags & CommandFlag.RELEASE_LEASE else 0
        # The usual LOAD follows a LOOKUP's lease of the same blocks: its pins and offsets
        # serve (finding and pinning every block again would delay the copy).
        offsets = self.index.take_lease(lease_id, keys, client.entry_bytes) if lease_id else None
        if offsets is not None:
            lease_id = 0  # ended: the load holds its pins
        else:
            offsets = self._stored_offsets(keys, client.entry_bytes)
            self.index.pin(keys)
        pending = PendingCopy(client, rec.request_id, Opcode.LOAD, mask,
                              len(placements) * client.page_bytes, lease_id=lease_id,
                              received_at=received, is_timed=logger.isEnabledFor(logging.DEBUG))
        # One op: the backend moves layer 0 first, so the layer-wise pipeline starts early.
        if keys:
            with self._answered_on_fault(pending):
                self._submit(pending, keys, CopyOp(0, Direction.LOAD, client.slot, placements,
                                                   client.page_bytes, block_ids, offsets,
                                                   wait_event=wait_event, record_events=record_events))
        if record_events is not None and pending.error is None and keys:  # (a refusal set error)
            pending.is_answered = True  # the client's events fence the data, not our answer
            self.reply(pending.client, pending.request_id, Opcode.LOAD, Status.OK, len(keys),
                       (len(keys), 0, 0), pending.received_at)
        return self._seal(pending)

    def take_parked(self, now: float) -> list[tuple[ClientState, object, np.ndarray, bool]]:
        """Parked LOADs to go on, or late (``ParkedLoads.take``)."""
        return self.parked.take(now, self.index.is_promoting)

    def _stored_offsets(self, keys: list[Key], entry_bytes: int) -> np.ndarray:
        """The pool offsets of ``keys``, every one stored with this geometry (one pass: a
        LOAD's copies start after it)."""
        get_ready, offsets = self.index.get_ready, []
        for key in keys:
            entry = get_ready(key)
            if entry is None or entry.entry_bytes != entry_bytes:
                missing = sum(get_ready(k) is None for k in keys)
                if missing:
                    raise CommandError(Status.MISSING_BLOCK,
                                       f"{missing} of {len(keys)} blocks are not stored")
                raise CommandError(Status.BAD_ARGUMENT, "stored blocks have another geometry")
            offsets.append(entry.offset)
        return np.array(offsets, np.int64)

    def _submit(self, pending: PendingCopy, keys: list[Key], op: CopyOp) -> None:
        """Hand one chunk to the backend; ``on_copy_done`` finishes it."""
        op.token = next(self._tokens)
        if pending.error is None:
            try:
                self.backend.submit(op)
            except PegaflowError as exc:  # refused: a bad op (the client's) or a CUDA error
                level = logging.WARNING if isinstance(exc, CommandError) else logging.ERROR
                logger.log(level, "slot %d: %s of %d blocks refused at submit: %s", pending.client.slot,
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
        if pending.is_timed and not pending.first_issued_at:
            pending.first_issued_at = time.perf_counter()
        pending.client.num_inflight += 1
        self.stats.set_client(pending.client.slot, "inflight_copies", pending.client.num_inflight)

    def _seal(self, pending: PendingCopy):
        """All chunks are submitted: answer now if none is in flight, else when the last ends."""
        pending.is_sealed = True
        if pending.is_timed:
            pending.sealed_at = time.perf_counter()
        self.stats.set("inflight_copies", len(self.pending))
        if pending.num_ops:
            return ANSWERED_LATER, None
        self._complete(pending)
        return ANSWERED_LATER, None

    def on_copy_done(self, done: CopyDone) -> ClientState:
        """Finish one chunk (and its command, if it was the last); returns whose it was."""
        pending, keys = self.pending.pop(done.token)
        pending.num_ops -= 1
        pending.client.num_inflight -= 1
        self.stats.set_client(pending.client.slot, "inflight_copies", pending.client.num_inflight)
        self.stats.set("inflight_copies", len(self.pending))
        if done.error is not None and pending.error is None:
            pending.error = done.error
        self._finish_chunk(pending, keys, done.error)
        if pending.num_ops == 0 and pending.is_sealed:
            self._complete(pending)
        return pending.client

    def _complete(self, pending: PendingCopy) -> None:
        if pending.opcode == Opcode.LOAD and pending.lease_id:
            self.index.release(pending.lease_id)  # before the gauges the answer's reader sees
        if pending.is_answered:
            if pending.error:
                logger.error("slot %d: %s failed after it was answered: %s", pending.client.slot,
                             pending.opcode.name, pending.error)
        else:
            status = Status.OK if pending.error is None else Status.COPY_FAILED
            self.reply(pending.client, pending.request_id, pending.opcode, status, pending.num_blocks,
                       (pending.num_blocks, pending.num_deduped, pending.num_dropped), pending.received_at)
        # After the answer (nothing else runs before it is done): the eviction order only.
        if pending.chain and pending.error is None:  # stored or deduplicated: head kept longest
            self.index.touch_chain(pending.chain)
        if pending.is_timed:
            self._log_timing(pending)

    @staticmethod
    def _log_timing(pending: PendingCopy) -> None:
        """Where a SAVE's or LOAD's time went, from its receipt (DEBUG)."""
        done = time.perf_counter()

        def since(mark: float) -> float:
            return (mark - pending.received_at) * 1e3 if mark else float("nan")

        num_bytes = pending.num_blocks * pending.bytes_per_block
        logger.debug("slot %d: %s of %d blocks (%.1f MB): first copy handed to the backend "
                     "after %.2f ms, all after %.2f ms, done after %.2f ms (%.1f GB/s)%s",
                     pending.client.slot, pending.opcode.name, pending.num_blocks, num_bytes / 1e6,
                     since(pending.first_issued_at), since(pending.sealed_at), since(done),
                     num_bytes / max(done - pending.received_at, 1e-9) / 1e9,
                     f"; {pending.error}" if pending.error else "")

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
                    self.stats.add_client(pending.client.slot, "blocks_loaded", len(keys))
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
        self.stats.add_client(pending.client.slot, "blocks_saved", num_ready)
        self.stats.add("bytes_saved", num_bytes)
