"""SAVE and LOAD: checked against the client's registration, planned against the index,
handed to the copy backend in chunks, and answered exactly once.

Each goes in steps of a chunk (64 blocks, then doubling up to 1024, the last 64 alone), a
slice of steps per loop turn (``issuing.py``).  A SAVE builds a chunk's keys, reserves its
entries and marks the layers it copies pending; a finished chunk marks them done, a failed
or revoked one abandons them.  A LOAD finds and pins every block (or takes over its lease's
run, in one step) before it copies any (one gone meanwhile: MISSING_BLOCK); its copies go
in one op of every layer, or ops of LOAD_OP_BLOCKS if longer and not fenced.  A fenced LOAD
(``first_event``) is answered when issued, the client's events telling its GPU when each
layer has landed; with AFTER_CLIENT its copies wait for the client's last pool event first
(``pegaflow.platform.protocol`` says what each means).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import replace

import numpy as np

from pegaflow.platform.errors import CommandError, PegaflowError
from pegaflow.platform.protocol import Load, LoadAnswer, Save, SaveAnswer, keys_of, last_pool_event
from pegaflow.platform.wire import ALL_LAYERS, Opcode, Status

from ..blocks import votes
from ..blocks.entries import Key
from ..blocks.index import BlockIndex
from ..blocks.votes import Vote
from ..clients.client import ClientState
from ..copy.base import CopyBackend, CopyDone, CopyOp, Direction
from ..stats import StatsWriter
from .copy_arguments import checked_event, copied_blocks, stored_offsets
from .issuing import Issuing, step_before
from .load_waits import ParkedLoads
from .pending_copy import PendingCopy, chunk_bounds
from .received import LATER, Received

logger = logging.getLogger(__name__)

LOAD_OP_BLOCKS = 4096  # a LOAD's copies, an op at most (a fenced one: all in one op)


class Transfers:
    def __init__(self, index: BlockIndex, backend: CopyBackend, stats: StatsWriter,
                 answer: Callable[..., None], claims=None):
        self.index = index
        self.claims = claims  # compute once's (``prefill_claims.py``): told of SAVEs that failed
        self.backend = backend
        self.stats = stats
        self.answer = answer  # the dispatcher's: the one way a command is answered
        self.pending: dict[int, tuple[PendingCopy, list[Key]]] = {}
        self.parked = ParkedLoads()  # LOADs waiting for the disk tier's reads
        self._tokens = itertools.count(1)
        self.issue_s = 0.0  # seconds spent in the backend's submit, all told (slow_commands.py)
        self.issuing = Issuing(self._seal, self._answered_on_fault, answer, index)

    def save(self, received: Received, save: Save):
        client = received.client
        tags = votes.check_tags(client, save)
        block_ids, placements, mask = copied_blocks(client, save)
        # All layers (or a group's): an event per layer, unless one_event fences them all
        is_many = save.layer == ALL_LAYERS or save.group is not None
        per_layer = is_many and not save.one_event
        wait_event = checked_event(client, save.first_event, len(placements) if per_layer else 1)
        pending = PendingCopy(client, received, Opcode.SAVE, mask, len(placements) * client.page_bytes,
                              chain=[], is_timed=logger.isEnabledFor(logging.DEBUG))
        self.issuing.start(pending, self._save_chunks(pending, save, block_ids.tolist(), placements,
                                                      wait_event, per_layer, tags), save.namespace)
        return LATER

    def _save_chunks(self, pending: PendingCopy, save: Save, ids: list[int], placements,
                     wait_event: int | None, per_layer: bool, tags: list[int] | None):
        """A SAVE's chunks, one a step: keys built, entries reserved, copies issued."""
        for start, end in chunk_bounds(len(ids)):
            yield from step_before(start)
            keys = keys_of(save.namespace, save.hashes[start:end])
            pending.chain.extend(keys)
            self._save_chunk(pending, ids[start:end], keys, placements, wait_event, per_layer,
                             None if tags is None else tags[start:end])
        self.stats.add("save_dedup_blocks", pending.num_deduped)
        self.stats.add("save_dropped_blocks", pending.num_dropped)

    def _save_chunk(self, pending: PendingCopy, ids: list[int], keys: list[Key], placements,
                    wait_event: int | None, per_layer: bool, tags: list[int] | None) -> None:
        client, mask = pending.client, pending.layer_mask
        chosen_ids, chosen_keys, offsets = [], [], []
        entries = self.index.reserve_many(keys, client.entry_bytes, client.num_layers, client.slot,
                                          (client.uid, pending.command_id))
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
        """A fault (a bug) in the middle of a SAVE or LOAD: the server's boundary answers
        the command INTERNAL (it takes the command over from here); the chunks already in
        flight finish their bookkeeping, and the command's leases and marks are given back."""
        try:
            yield
        except CommandError:  # refused before any copy of it was issued (a LOAD's block gone)
            raise
        except BaseException:
            pending.error = pending.error or "internal error"
            pending.received = None
            self._seal(pending)
            raise

    def load(self, received: Received, load: Load):
        lease_id, client = load.lease_id, received.client
        if lease_id and self.index.is_foreign_lease(lease_id, client.instance):
            raise CommandError(Status.UNKNOWN_LEASE, f"lease {lease_id} is another vLLM instance's")
        if lease_id and self.index.is_promoting(lease_id):
            self.parked.park(received, load, time.monotonic())  # resumed once the reads end
            return LATER
        try:
            block_ids, placements, mask = copied_blocks(client, load)
            wait_event = None
            if load.after_client:
                if not client.num_events:
                    raise CommandError(Status.BAD_ARGUMENT, "after_client without registered events")
                wait_event = last_pool_event(client.num_events)
            op = CopyOp(0, Direction.LOAD, client.slot, placements, client.page_bytes, block_ids,
                        np.zeros(0, np.int64), wait_event=wait_event,
                        record_events=checked_event(client, load.first_event, len(placements)))
            pending = PendingCopy(client, received, Opcode.LOAD, mask, len(placements) * client.page_bytes,
                                  lease_id=lease_id if load.ends_lease else 0,
                                  is_timed=logger.isEnabledFor(logging.DEBUG))
            self.issuing.start(pending, self._load_steps(pending, load, op), load.namespace)
            return LATER
        except CommandError:
            if lease_id and load.ends_lease:
                self.index.release(lease_id)  # the lease dies with the load that was to use it
            raise

    def _load_steps(self, pending: PendingCopy, load: Load, op: CopyOp):
        """A LOAD's keys built, then its blocks found and pinned, a chunk a step (or the pins
        of its LOOKUP's lease taken over), then its copies issued."""
        keys, entry_bytes = [], pending.client.entry_bytes
        for start, end in chunk_bounds(len(op.block_ids)):
            yield from step_before(start)
            keys.extend(keys_of(load.namespace, load.hashes[start:end]))
        offsets = self.index.take_lease(pending.lease_id, keys, entry_bytes) if pending.lease_id else None
        if offsets is not None:
            pending.lease_id = 0  # ended: the load holds its pins
        else:
            found, num_pinned = [], 0
            try:
                for start, end in chunk_bounds(len(keys)):
                    yield from step_before(start)
                    found.append(stored_offsets(self.index, keys[start:end], entry_bytes))
                    self.index.pin(keys[start:end])
                    num_pinned = end
            finally:  # refused (a block gone), stopped, or a fault: nothing copied, nothing kept
                if num_pinned < len(keys):
                    self.index.unpin(keys[:num_pinned])
            offsets = np.concatenate(found) if found else np.zeros(0, np.int64)
        yield from self._load_ops(pending, keys, op, offsets)

    def _load_ops(self, pending: PendingCopy, keys: list[Key], op: CopyOp, offsets: np.ndarray):
        """One op of every layer (layer 0 moves first), or ops of LOAD_OP_BLOCKS if long, not fenced."""
        step = max(len(keys), 1) if op.record_events is not None else LOAD_OP_BLOCKS
        for start in range(0, len(keys), step):
            yield from step_before(start)
            end = min(start + step, len(keys))
            self._submit(pending, keys[start:end], replace(op, block_ids=op.block_ids[start:end],
                                                           entry_offsets=offsets[start:end]))
        if op.record_events is not None and pending.error is None and keys:  # (a refusal set error)
            # Fenced: the client's events tell its GPU when the data is there, not our answer.
            self._answer(pending, Status.OK, LoadAnswer(len(keys)), len(keys))

    def take_parked(self, now: float) -> list[tuple[Received, Load, bool]]:
        """Parked LOADs to go on, or late (``ParkedLoads.take``)."""
        return self.parked.take(now, self.index.is_promoting)

    def _submit(self, pending: PendingCopy, keys: list[Key], op: CopyOp) -> None:
        """Hand one chunk to the backend; ``on_copy_done`` finishes it."""
        op.token = next(self._tokens)
        if pending.error is None:
            started = time.perf_counter()
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
            finally:
                self.issue_s += time.perf_counter() - started
        if pending.error is not None:
            self._finish_chunk(pending, keys, pending.error)
            return
        self.pending[op.token] = (pending, keys)
        pending.num_ops += 1
        if pending.is_timed and not pending.first_issued_at:
            pending.first_issued_at = time.perf_counter()
        pending.client.num_inflight += 1
        self.stats.set_client(pending.client.slot, "inflight_copies", pending.client.num_inflight)

    def _seal(self, pending: PendingCopy) -> None:
        """All chunks are submitted: answer now if none is in flight, else when the last ends."""
        pending.is_sealed = True
        if pending.is_timed:
            pending.sealed_at = time.perf_counter()
        self.stats.set("inflight_copies", len(self.pending))
        if not pending.num_ops:
            self._complete(pending)

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

    def _answer(self, pending: PendingCopy, status: Status, answer: tuple, num_items: int) -> None:
        """Answer the command and let go of it (``received.py``): it is answered here once."""
        received, pending.received = pending.received, None
        self.answer(received, status, answer, num_items)

    def _complete(self, pending: PendingCopy) -> None:
        if pending.opcode == Opcode.LOAD and pending.lease_id:
            self.index.release(pending.lease_id)  # before the gauges the answer's reader sees
        if pending.received is not None:
            status = Status.OK if pending.error is None else Status.COPY_FAILED
            answer = (SaveAnswer(pending.num_blocks, pending.num_deduped, pending.num_dropped)
                      if pending.opcode == Opcode.SAVE else LoadAnswer(pending.num_blocks))
            self._answer(pending, status, answer, pending.num_blocks)
        elif pending.error:
            logger.error("slot %d: %s failed after it was answered: %s", pending.client.slot,
                         pending.opcode.name, pending.error)
        # After the answer (nothing else runs before it is done): the eviction order only.
        if pending.chain and pending.error is None:  # stored or deduplicated: head kept longest
            self.issuing.touch_chain(pending.chain)
        if pending.chain and (pending.error or pending.num_dropped) and self.claims is not None:
            self.claims.save_failed(pending.chain)  # compute once: waiters for them compute them
        if pending.is_timed:
            pending.log_timing(logger)

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
