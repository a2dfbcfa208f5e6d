"""Commands in, index and copy work out, and exactly one answer per command.

A record is decoded once into a typed command (``pegaflow.platform.protocol``, where each
command's fields and answer are declared) and handed to its handler, which takes the typed
command and returns its answer or ``LATER`` (``received.py``: the one rule by which every
command is answered once).  SAVE and LOAD are ``transfers.py``'s, LOOKUP ``lookup.py``'s,
RESET ``reset.py``'s.

A bad command (unknown opcode, wrong version, payload past the arena, block id out of
range, ...) is answered with its status and changes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from time import monotonic, perf_counter

from pegaflow.platform.errors import CommandError
from pegaflow.platform.protocol import (
    COMMANDS,
    NO_PAYLOAD,
    PAYLOAD_BYTES_AT,
    Attach,
    Detach,
    Done,
    Drop,
    DropAnswer,
    Ping,
    PingAnswer,
    Register,
    RegisterEvents,
    Release,
    Unregister,
    check_envelope,
    decode,
    envelope,
    payload_past_arena,
    read_payload,
)
from pegaflow.platform.wire import ClientRole, Opcode, Status, attach_role

from ..blocks.index import BlockIndex
from ..blocks.votes import VoterTable
from ..clients.claims import attach_problem
from ..clients.client import ClientState
from ..clients.registration import register_events, register_region
from ..copy.base import CopyBackend, CopyDone
from ..stats import StatsWriter
from .lookup import Lookups
from .prefill_claims import PrefillClaims
from .received import LATER, Received, untimed
from .reset import Resets
from .slow_commands import RefusedCommands
from .transfers import Transfers

logger = logging.getLogger(__name__)

__all__ = ["NO_PAYLOAD", "Dispatcher"]

_READ_ONLY = frozenset({Opcode.PING, Opcode.ATTACH})  # commands that leave the index (and gauges) be
_SETUP = frozenset({Opcode.ATTACH, Opcode.REGISTER, Opcode.REGISTER_EVENTS})
_OPCODES = frozenset(Opcode)
_DONE = Done()


class Dispatcher:
    def __init__(self, index: BlockIndex, backend: CopyBackend, stats: StatsWriter, lookup_wait_s: float = 0.0,
                 *, disk=None, remote=None, clients: Callable[[], tuple] = tuple, own_pid_is_client: bool = False,
                 compute_once: bool = True):
        """``disk``, ``remote``: the tiers (``engine/disk/tier.py``, ``engine/remote/tier.py``),
        where the engine has them; ``clients``: the attached clients now (whose rings a waiting
        LOOKUP reads past); ``own_pid_is_client``: the engine runs in its clients' process (tests);
        ``compute_once``: a LOOKUP may claim what it misses (``prefill_claims.py``)."""
        self.index = index
        self.backend = backend
        self.stats = stats
        # Whether the index may have changed since the gauges were last written: set by
        # every command but the read-only ones, by finished copies and by release_client.
        self.gauges_stale = True
        self.disk, self.remote = disk, remote
        self.own_pid_is_client = own_pid_is_client
        self.claims = PrefillClaims(index, stats, compute_once)  # compute once (prefill_claims.py)
        self.transfers = Transfers(index, backend, stats, self.answer, self.claims)
        self.lookups = Lookups(index, stats, self.answer_later, lookup_wait_s,
                               self.transfers.issuing.is_issuing_save, clients, remote, self.claims)
        self.resets = Resets(index, stats, clients, disk)  # RESET: a namespace emptied (reset.py)
        self.voters = VoterTable()  # the namespaces whose clients vote (``votes.py``)
        self.refusals = RefusedCommands()  # refused setup commands, logged at a bounded rate
        self.handlers: dict[Opcode, Callable] = {
            Opcode.ATTACH: self._attach, Opcode.DETACH: self._detach, Opcode.PING: self._ping,
            Opcode.REGISTER: self._register, Opcode.UNREGISTER: self._unregister,
            Opcode.REGISTER_EVENTS: self._register_events, Opcode.LOOKUP: self.lookups.lookup,
            Opcode.RELEASE: self._release, Opcode.SAVE: self.transfers.save,
            Opcode.LOAD: self.transfers.load, Opcode.DROP: self._drop,
            Opcode.RELEASE_CLAIM: self.claims.release,  # compute once (prefill_claims.py)
            Opcode.RESET: self.resets.reset,
        }
        assert set(self.handlers) == set(COMMANDS), "every command needs a handler"

    @property
    def pending(self) -> dict:
        """Copies in flight (token -> their command and keys)."""
        return self.transfers.pending

    @property
    def waiting(self):
        """LOOKUPs waiting for saves in flight (``lookup_waits.py``)."""
        return self.lookups.waiting

    def on_copy_done(self, done: CopyDone) -> None:
        self.gauges_stale = True
        self.after_answer(self.transfers.on_copy_done(done))

    def index_changed(self) -> None:
        """The index changed outside a command (the pool grew, a long copy issued a slice): the
        gauges are written again."""
        self.gauges_stale = True

    def answer_later(self, received: Received, status: int, answer=()) -> None:
        """A command whose handler returned ``LATER``, answered now (``answer`` still ``LATER``:
        not yet, its work went on); the index may have changed meanwhile."""
        self.gauges_stale = True
        if answer is not LATER:
            self.answer(received, status, answer)
        self.after_answer(received.client)

    def after_answer(self, client: ClientState) -> None:
        """A command of ``client`` that waited was answered: a DETACH waiting for it goes on."""
        if client.pending_detach is not None and client.num_inflight == 0:
            self._finish_detach(client)

    def resume_parked_loads(self, now: float) -> None:
        """LOADs that waited for blocks read from disk: handled now that the reads are over,
        or answered MISSING_BLOCK past their deadline (the reads go on into the pool)."""
        for received, load, is_late in self.transfers.take_parked(now):
            self.gauges_stale = True
            client = received.client
            if load.ends_lease and (not client.is_attached or is_late):  # refused: its lease ends here
                self.index.release(load.lease_id)
            if is_late:
                self.stats.add("disk_late_loads")
                self.answer(untimed(received), Status.MISSING_BLOCK)
                continue
            try:
                self._run(received, load)
            except Exception:  # boundary, as in the server's loop: answered, the engine goes on
                logger.exception("slot %d: internal error resuming a LOAD", client.slot)
                self.answer(untimed(received), Status.INTERNAL)
            self.after_answer(client)

    def handle(self, client: ClientState, rec) -> bool:
        """Decode ``rec`` (its payload copied out of the client's arena first), run its
        handler and answer it (now, or once its work ends); True: an accepted DETACH."""
        payload = read_payload(client.view.arena, rec) if rec[PAYLOAD_BYTES_AT] else NO_PAYLOAD  # None: past it
        command_id, opcode, num_items = envelope(rec)
        received = Received(client, command_id, opcode, num_items, perf_counter())
        if opcode not in _READ_ONLY:
            self.gauges_stale = True
        try:
            opcode = check_envelope(rec)
            if not client.is_attached and opcode is not Opcode.ATTACH:
                raise CommandError(Status.NOT_ATTACHED, "ATTACH first")
            if payload is None:
                raise payload_past_arena(rec)
            answer = self.handlers[opcode](received, decode(opcode, rec, payload))
        except CommandError as exc:
            self._refused(received, exc)
            return False
        if answer is not LATER:
            self.answer(received, Status.OK, answer)
        return client.is_detached and opcode is Opcode.DETACH

    def _run(self, received: Received, command) -> None:
        """A command decoded before (a parked LOAD): its handler run, and answered."""
        try:
            answer = self.handlers[command.OPCODE](received, command)
        except CommandError as exc:
            self._refused(received, exc)
            return
        if answer is not LATER:
            self.answer(received, Status.OK, answer)

    def _refused(self, received: Received, exc: CommandError) -> None:
        opcode, client = received.opcode, received.client  # setup refusals stop a client caching: say why
        if opcode in _SETUP:
            self.refusals.note(client, opcode, exc, monotonic())
        else:
            logger.debug("slot %d (pid %d): %s refused: %s", client.slot, client.pid,
                         Opcode(opcode).name if opcode in _OPCODES else opcode, exc)
        self.answer(received, Status(exc.status))

    def answer_internal_error(self, client: ClientState, rec) -> None:
        """A handler failed with a bug: the command is answered INTERNAL (``rec`` as received)."""
        command_id, opcode, _ = envelope(rec)
        logger.exception("slot %d: internal error on opcode %d", client.slot, opcode)
        self.answer(Received(client, command_id, opcode, 0, 0.0), Status.INTERNAL)

    @staticmethod
    def received_unread(client: ClientState, rec) -> Received:
        """A command still on the ring at a stop, to be answered SHUTTING_DOWN."""
        command_id, opcode, _ = envelope(rec)
        return Received(client, command_id, opcode, 0, 0.0)

    def answer_stopping(self, received: Received) -> None:
        self.answer(untimed(received), Status.SHUTTING_DOWN)

    def answer(self, received: Received, status: int, answer: tuple = (), num_items: int | None = None) -> None:
        """The one way a command is answered: counted in the stats, and with the gauges
        current, so a client that reads the stats after the answer sees what it did."""
        if self.gauges_stale:
            self.update_gauges()
        client, command_id, opcode, received_items, received_at = received
        self.stats.count_command(opcode, status, received_at)  # first: the answer finds it counted
        client.answer(command_id, opcode, status, received_items if num_items is None else num_items, *answer)

    def update_gauges(self) -> None:
        self.gauges_stale = False
        index = self.index
        pool, counters = index.pool, index.counters
        self.stats.set_gauges(pool.bytes_used, pool.num_entries, len(index.leases),
                              counters.evictions, counters.lease_expiries)

    def _ping(self, received: Received, ping: Ping) -> PingAnswer:
        return PingAnswer(len(self.transfers.pending))

    def _attach(self, received: Received, attach: Attach) -> Done:
        # The pid decides when the slot is reclaimed: only the claimant, a process that maps
        # this slot's ring (the kernel says so), may name itself; a lie would keep or steal a slot.
        client = received.client
        why = attach_problem(attach.pid, client.pid, client.ring_name, self.own_pid_is_client) \
            if client.ring_name else None
        if why is not None:
            raise CommandError(Status.BAD_ARGUMENT, why)
        self.voters.attach(client, attach.namespace, attach.voters)  # (wire.py: voting)
        client.pid, client.is_attached = attach.pid, True
        client.instance, client.namespace = attach.instance, attach.namespace
        self.stats.client_attached(client.slot, attach.pid & 0xFFFFFFFF, attach_role(attach.role, attach.kv_role),
                                   attach.rank if attach.role == ClientRole.WORKER else 0, attach.namespace)
        return _DONE

    def _detach(self, received: Received, detach: Detach):
        """Answered once no copy touches the client's memory any more (it may free it then)."""
        client = received.client
        client.is_attached = False
        client.is_detached = True
        self.stats.client_gone(client.slot)  # no longer listed, though its slot frees later
        if client.num_inflight:
            client.pending_detach = received
            return LATER
        self.release_client(client)
        return _DONE

    def _finish_detach(self, client: ClientState) -> None:
        self.release_client(client)
        received, client.pending_detach = client.pending_detach, None
        self.answer(untimed(received), Status.OK)

    def release_client(self, client: ClientState) -> None:
        """Leases, half-written blocks and memory of ``client``; copies must be over."""
        self.gauges_stale = True
        assert client.num_inflight == 0, "release_client with copies in flight"
        self.index.release_slot(client.slot)
        self.claims.release_slot(client.slot)  # compute once: its claims end
        self.voters.leave(client.namespace, client.slot)
        self.backend.unregister_client(client.slot)
        client.layers.clear()
        client.groups.clear()
        client.region_blocks.clear()
        client.page_bytes = client.num_events = 0

    def _register(self, received: Received, register: Register) -> Done:
        register_region(received.client, register, self.backend, self.index.pool)
        return _DONE

    def _unregister(self, received: Received, unregister: Unregister) -> Done:
        if received.client.num_inflight:
            raise CommandError(Status.BAD_ARGUMENT, "copies still in flight")
        self.release_client(received.client)
        return _DONE

    def _register_events(self, received: Received, events: RegisterEvents) -> Done:
        register_events(received.client, events, self.backend)
        return _DONE

    def _drop(self, received: Received, drop: Drop) -> DropAnswer:
        client, keys = received.client, drop.keys()
        num_found = self.index.drop(keys, client.uid, drop.since_command)
        if self.disk is not None:  # who wrote a disk copy is not known: each named goes
            self.disk.forget(keys)
        if self.remote is not None:  # nor who published a remote one
            self.remote.forget(keys)
        if num_found:
            logger.info("slot %d (pid %d): dropped %d stored blocks it computed from bad data",
                        client.slot, client.pid, num_found)
        return DropAnswer(num_found)

    def _release(self, received: Received, release: Release) -> Done:
        lease_id = release.lease_id
        if self.index.is_foreign_lease(lease_id, received.client.instance):
            raise CommandError(Status.UNKNOWN_LEASE, f"lease {lease_id} is another vLLM instance's")
        if not self.index.release(lease_id):
            raise CommandError(Status.UNKNOWN_LEASE, f"no lease {lease_id}")
        return _DONE
