"""Commands in, index and copy work out, and exactly one completion per command.

Protocol (each a SUBMISSION on the client's ring, answered by one COMPLETION):

    ATTACH(arg=pid)            the handshake after a slot is claimed (payload: its vLLM
                               instance, and for a voter how many vote and its index)
    REGISTER(region, layers)   a region of KV memory and where each layer's pages are
    REGISTER_EVENTS(handles)   the client's pool of IPC events (cuda)
    LOOKUP(ns, hashes, arg)    -> value = contiguous READY prefix (on through blocks the disk
                               tier holds: their reads start; then through those the remote
                               store holds: answered once it says, their fetches started),
                               value2 = lease id, value3 = how many come from disk or the
                               remote store (a LOAD of them waits for the reads)
    RELEASE(arg=lease)         ends a lease
    SAVE(ns, ids, hashes)      client pages -> pool, ``layer`` or ALL_LAYERS; answered when copied
                               (a voter's: a tag per block; READY once all voters saved it)
    LOAD(ns, ids, hashes)      pool -> client pages; answered when copied, or when issued if
                               the client's events fence it (``event_index``); with
                               AFTER_CLIENT, copied only after the client's last pool event
    DROP(ns, hashes, since)    forget those blocks this client stored with SAVEs from request
                               ``since`` on (computed from bad data): now, or when the
                               lease, load or copy using one ends
    PING, UNREGISTER, DETACH

A bad command (unknown opcode, wrong version, payload past the arena, block id out of
range, ...) is answered with its status and changes nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from pegaflow.platform.errors import CommandError
from pegaflow.platform.wire import (
    HASH,
    WIRE_VERSION,
    ClientRole,
    CommandFlag,
    Opcode,
    Status,
    attach_role,
    split_attach_role,
)

from .claims import attach_problem
from .clients import ClientState
from .config import MAX_LOOKUP_WAIT_S
from .copy.base import CopyBackend, CopyDone
from .index import BlockIndex
from .pending import ANSWERED_LATER, command_keys
from .registration import register_events, register_region
from .stats import StatsWriter
from .transfers import Transfers
from .votes import VoterTable
from .waiting_lookups import WaitingLookup, WaitingLookups, writing_stop

logger = logging.getLogger(__name__)

NO_PAYLOAD = np.zeros(0, dtype=np.uint8)
_OK, _ATTACH = Status.OK, Opcode.ATTACH  # read once: the hot loop compares against plain names
_READ_ONLY = frozenset({Opcode.PING, Opcode.ATTACH})  # commands that leave the index (and gauges) be
_SETUP = frozenset({Opcode.ATTACH, Opcode.REGISTER, Opcode.REGISTER_EVENTS})
_OPCODES = frozenset(Opcode)


class Dispatcher:
    def __init__(self, index: BlockIndex, backend: CopyBackend, stats: StatsWriter, lookup_wait_s: float = 0.0):
        self.index = index
        self.backend = backend
        self.stats = stats
        # Whether the index may have changed since the gauges were last written: set by
        # every command but the read-only ones, by finished copies and by release_client.
        self.gauges_stale = True
        self.transfers = Transfers(index, backend, stats, self.reply)
        self.voters = VoterTable()  # the namespaces whose clients vote (``votes.py``)
        self.disk = None  # the disk tier (``engine/disk/tier.py``), if the engine has one
        self.remote = None  # the remote tier (``engine/remote/tier.py``), if the engine has one
        # LOOKUPs waiting for saves in flight (``waiting_lookups.py``): by default for at most
        # ``lookup_wait_s`` (the engine's --lookup-wait-ms; 0: never), and ``clients`` says
        # whose rings may hold a SAVE not read yet (the server's attached clients)
        self.waiting = WaitingLookups(index, self._answer_waiting)
        self.lookup_wait_s = lookup_wait_s
        self.clients: Callable[[], tuple] = tuple
        self.own_pid_is_client = False  # the engine runs in its clients' process (tests only)
        self._handlers = {
            Opcode.ATTACH: self._attach, Opcode.DETACH: self._detach, Opcode.PING: self._ping,
            Opcode.REGISTER: self._register, Opcode.UNREGISTER: self._unregister,
            Opcode.REGISTER_EVENTS: self._register_events, Opcode.LOOKUP: self._lookup,
            Opcode.RELEASE: self._release, Opcode.SAVE: self.transfers.save,
            Opcode.LOAD: self.transfers.load, Opcode.DROP: self._drop,
        }

    @property
    def pending(self) -> dict:
        """Copies in flight (token -> their command and keys)."""
        return self.transfers.pending

    def on_copy_done(self, done: CopyDone) -> None:
        self.gauges_stale = True
        client = self.transfers.on_copy_done(done)
        if client.pending_detach and client.num_inflight == 0:
            self._finish_detach(client)

    def resume_parked_loads(self, now: float) -> None:
        """LOADs that waited for blocks read from disk: handled now that the reads are over,
        or answered MISSING_BLOCK past their deadline (the reads go on into the pool)."""
        for client, rec, payload, is_late in self.transfers.take_parked(now):
            self.gauges_stale = True
            ends_lease = bool(rec.flags & CommandFlag.RELEASE_LEASE)  # (not a LEASE_HELD one)
            if ends_lease and (not client.is_attached or is_late):  # refused: its lease ends here
                self.index.release(rec.arg)
            if is_late:
                self.stats.add("disk_late_loads")
                self.reply(client, rec.request_id, rec.opcode, Status.MISSING_BLOCK)
                continue
            try:
                self.handle(client, rec, payload)
            except Exception:  # boundary, as in the server's loop: answered, the engine goes on
                logger.exception("slot %d: internal error resuming a LOAD", client.slot)
                self.reply(client, rec.request_id, rec.opcode, Status.INTERNAL)
            if client.pending_detach and client.num_inflight == 0:
                self._finish_detach(client)

    def handle(self, client: ClientState, rec, payload: np.ndarray | None) -> None:
        """Check ``rec``, run its handler and answer it (now, or once its copies end);
        ``payload`` is ``read_payload``'s copy (None: out of the arena)."""
        received_at = time.perf_counter()
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
        if status is not ANSWERED_LATER:
            self.reply(client, request_id, opcode, status, rec.num_items, values, received_at)

    def reply(self, client: ClientState, request_id: int, opcode: int, status: int, num_items: int = 0,
              values: tuple[int, int, int] = (0, 0, 0), received_at: float = 0.0) -> None:
        """The one way a command is answered (exactly once each): counted in the stats, and
        with the gauges current, so a client that reads the stats after the answer sees
        what the command did."""
        if self.gauges_stale:
            self.update_gauges()
        self.stats.count_command(opcode, status, received_at)  # first: the answer finds it counted
        client.answer(request_id, opcode, status, num_items, *values)

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
        # The pid decides when the slot is reclaimed: only the claimant, a process that maps
        # this slot's ring (the kernel says so), may name itself; a lie would keep or steal a slot.
        why = attach_problem(rec.arg, client.pid, client.ring_name, self.own_pid_is_client) \
            if client.ring_name else None
        if why is not None:
            raise CommandError(Status.BAD_ARGUMENT, why)
        words = payload.view("<u8") if len(payload) in (8, 24) else np.zeros(1, "<u8")
        if len(words) == 3:  # a voter (wire.py: voting)
            self.voters.join(rec.namespace, client.slot, int(words[1]), int(words[2]))
            client.num_voters, client.voter = int(words[1]), int(words[2])
        client.pid, client.is_attached = rec.arg, True
        client.instance, client.namespace = int(words[0]), rec.namespace
        role, kv_role = split_attach_role(int(rec.flags))
        self.stats.client_attached(client.slot, rec.arg & 0xFFFFFFFF, attach_role(role, kv_role),
                                   rec.layer if role == ClientRole.WORKER else 0, rec.namespace)
        return Status.OK, (0, 0, 0)

    def _detach(self, client, rec, payload):
        """Answered once no copy touches the client's memory any more (it may free it then)."""
        client.is_attached = False
        client.is_detached = True
        self.stats.client_gone(client.slot)  # no longer listed, though its slot frees later
        if client.num_inflight:
            client.pending_detach = rec.request_id
            return ANSWERED_LATER, None
        self.release_client(client)
        return Status.OK, (0, 0, 0)

    def _finish_detach(self, client: ClientState) -> None:
        self.release_client(client)
        self.reply(client, client.pending_detach, Opcode.DETACH, Status.OK)
        client.pending_detach = 0

    def release_client(self, client: ClientState) -> None:
        """Leases, half-written blocks and memory of ``client``; copies must be over."""
        self.gauges_stale = True
        assert client.num_inflight == 0, "release_client with copies in flight"
        self.index.release_slot(client.slot)
        self.voters.leave(client.namespace, client.slot)
        self.backend.unregister_client(client.slot)
        client.layers.clear()
        client.groups.clear()
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

    @staticmethod
    def _hash_keys(rec, payload) -> list:
        """The keys of a LOOKUP's or DROP's payload: ``num_items`` hash records."""
        if len(payload) != rec.num_items * HASH.itemsize:
            raise CommandError(Status.BAD_PAYLOAD,
                               f"{Opcode(rec.opcode).name} wants num_items hash records")
        return command_keys(rec, payload.view(HASH))

    def _lookup(self, client, rec, payload):
        keys = self._hash_keys(rec, payload)
        num_hits, lease_id = self.index.lookup(client.slot, keys, client.instance)
        wait_s = min((rec.arg - 1) / 1e3, MAX_LOOKUP_WAIT_S) if rec.arg else self.lookup_wait_s
        is_reading = lease_id and self.index.leases[lease_id].num_disk  # (the disk tier has the rest)
        if wait_s > 0 and num_hits < len(keys) and not is_reading and self.waiting.try_park(
                client, rec, keys, num_hits, wait_s, self.clients()):
            if lease_id:  # answered once the saves land (or at the deadline), with a fresh lookup
                self.index.release(lease_id)
            return ANSWERED_LATER, None
        return self._lookup_on(client, rec, keys, num_hits, lease_id)

    def _lookup_on(self, client, rec, keys, num_hits: int, lease_id: int):
        """The rest of a LOOKUP whose local prefix is leased: through the remote store, if any."""
        remote = self.remote
        if remote is not None:  # the prefix may go on in the remote store: answered once it says
            if lease_id:
                lease = self.index.leases[lease_id]
                remote.note_hits(lease.entries, lease.keys)
            if remote.try_lookup(client, rec, keys, num_hits, lease_id):
                return ANSWERED_LATER, None
        return Status.OK, self._lookup_values(client, rec.num_items, num_hits, lease_id)

    def _answer_waiting(self, waiting: WaitingLookup) -> None:
        """A LOOKUP whose wait for saves in flight is over: the index walked again, answered."""
        self.gauges_stale = True
        client, rec = waiting.client, waiting.rec
        if waiting.is_waiting_saves:
            num_more, why = writing_stop(self.index, waiting.keys[waiting.num_usable:], time.monotonic())
            self.stats.add("lookup_waits")
            self.stats.add("lookup_wait_ns", int((time.monotonic() - waiting.parked_at) * 1e9))
            self.stats.add("lookup_wait_blocks", waiting.num_usable + num_more - waiting.num_ready)
            self.stats.add("lookup_wait_timeouts", int(why == "writing"))
        status, values = Status.OK, (0, 0, 0)
        if client.is_attached:
            try:
                num_hits, lease_id = self.index.lookup(client.slot, waiting.keys, client.instance)
                status, values = self._lookup_on(client, rec, waiting.keys, num_hits, lease_id)
            except Exception:  # boundary, as in the server's loop: answered, the engine goes on
                logger.exception("slot %d: internal error answering a waiting LOOKUP", client.slot)
                status, values = Status.INTERNAL, (0, 0, 0)
        if status is not ANSWERED_LATER:
            self.reply(client, rec.request_id, rec.opcode, status, rec.num_items, values, waiting.received_at)
        if client.pending_detach and client.num_inflight == 0:
            self._finish_detach(client)

    def _lookup_values(self, client, num_items: int, num_hits: int, lease_id: int) -> tuple[int, int, int]:
        """A LOOKUP's answer (counted in the stats): hits, lease, blocks still on their way."""
        num_disk = self.index.leases[lease_id].num_disk if lease_id else 0
        self.stats.add("lookups")
        self.stats.add("lookup_blocks", num_items)
        self.stats.add("lookup_hit_blocks", num_hits)
        self.stats.add_client(client.slot, "lookups", 1)
        self.stats.add_client(client.slot, "lookup_hit_blocks", num_hits)
        return num_hits, lease_id, num_disk

    def answer_lookup(self, client, rec, num_hits: int, lease_id: int, received_at: float) -> None:
        """A LOOKUP the remote tier continued: answered now (its local prefix and what the
        store held, being fetched)."""
        self.gauges_stale = True
        if lease_id and not client.is_attached:  # gone meanwhile: its lease ends here
            self.index.release(lease_id)
            num_hits = lease_id = 0
        values = self._lookup_values(client, rec.num_items, num_hits, lease_id)
        self.reply(client, rec.request_id, rec.opcode, Status.OK, rec.num_items, values, received_at)
        if client.pending_detach and client.num_inflight == 0:
            self._finish_detach(client)

    def _drop(self, client, rec, payload):
        keys = self._hash_keys(rec, payload)
        num_found = self.index.drop(keys, client.uid, rec.arg)
        if self.disk is not None:  # who wrote a disk copy is not known: each named goes
            self.disk.forget(keys)
        if self.remote is not None:  # nor who published a remote one
            self.remote.forget(keys)
        if num_found:
            logger.info("slot %d (pid %d): dropped %d stored blocks it computed from bad data",
                        client.slot, client.pid, num_found)
        return Status.OK, (num_found, 0, 0)

    def _release(self, client, rec, payload):
        if self.index.is_foreign_lease(rec.arg, client.instance):
            raise CommandError(Status.UNKNOWN_LEASE, f"lease {rec.arg} is another vLLM instance's")
        if not self.index.release(rec.arg):
            raise CommandError(Status.UNKNOWN_LEASE, f"no lease {rec.arg}")
        return Status.OK, (0, 0, 0)
