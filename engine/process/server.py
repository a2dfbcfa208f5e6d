"""The engine's main loop: drain every client ring, poll copies, keep house, sleep when idle.

One thread does everything, so the index, pool and stats need no locks.  The loop spins
while there is work (and for ``idle_spin_s`` after it), then sleeps on the shared
doorbell that every client rings after submitting (and after claiming a slot).  It wakes
to keep house (expire leases, drop stale half-written blocks, free the slots of dead or
detached clients) every ``housekeeping_s`` while anything is leased, half written or
detaching, and every ``LIVENESS_ONLY_S`` otherwise, with nothing attached too: each pass
beats the heartbeat in the stats, by which ``pegaflow-stat`` tells a stopped or stuck
engine from a live one (a wake-up every 2.5 s costs next to nothing).

A spinning pass with nothing to do reads one seq word per attached client and the
clock, nothing else: claims are checked every ``CLAIM_CHECK_S``, copies polled only
while some are in flight, backlogs flushed only where there is one.

The engine serves once the pool's first chunk is pinned; a thread pins the rest
(``engine/memory/pinning.py``) and rings the doorbell after each chunk, and the loop, at its
claim checks, grows the usable pool by what was pinned (``_take_pinned``): the backend
first, then the index and pool, then the stats' ``pool_bytes_ready``.
"""

from __future__ import annotations

import logging
import time

from pegaflow.platform.errors import PegaflowError
from pegaflow.platform.protocol import envelope
from pegaflow.platform.values import format_size
from pegaflow.platform.waits import Doorbell, sleep_until
from pegaflow.platform.wire import CLIENT_STATS, STATS

from ..clients.client import MAX_UNREAD_ANSWERS
from ..clients.client_table import ClientTable
from ..commands.dispatcher import Dispatcher
from ..commands.slow_commands import SLOW_COMMAND_S, SlowCommands
from ..config import EngineConfig
from ..copy.base import CopyBackend
from ..memory.pinning import PinProgress
from ..stats import StatsWriter
from .segments import EngineSegments
from .shutdown import shut_down
from .startup import log_ready, open_pool, open_tiers

logger = logging.getLogger(__name__)

MAX_COMMANDS_PER_CLIENT_ROUND = 8  # a lookup waits behind at most this many saves
HELD_BACK_POLL_S = 5e-3  # while answers wait behind a full completion ring: how often to look
CLAIM_CHECK_S = 1e-3
LIVENESS_ONLY_S = 2.5  # clients attached, nothing leased, half written or detaching: only
#                        their liveness is checked, and a dead one's slot can wait this long
UNATTENDED_SLEEP_S = LIVENESS_ONLY_S  # nothing attached: a wake-up only to beat the heartbeat
#                        (pegaflow-stat tells a stopped or stuck engine by a stale one)


class EngineServer:
    def __init__(self, config: EngineConfig, backend: CopyBackend | None = None, serve_own_process: bool = False):
        """Each part built in order and handed what it uses (``startup.py``).  ``serve_own_process``:
        take clients of this very process (an engine run in a test's process), whose pid is
        otherwise never a client's."""
        self.config = config
        marks = [time.perf_counter()]  # the start's steps, for its log line
        self.segments = EngineSegments(config)
        marks.append(time.perf_counter())
        try:  # a failed start leaves nothing behind in /dev/shm
            opened = open_pool(config, self.segments, backend, marks)
        except BaseException:
            self.segments.unlink_all()
            raise
        self.backend, self.pinner, self.index = opened.backend, opened.pinner, opened.index
        self.segments.mark_started()
        self.stats = StatsWriter(self.segments.stats.array(STATS, 1), self.segments.stats.array(
            CLIENT_STATS, config.num_slots, STATS.itemsize))
        self.stats.set("pool_bytes_capacity", self.index.pool.bytes_total)
        self._pin_seen = PinProgress()  # the pinner's progress the pool has grown by
        self._is_pinning = True
        self._take_pinned()  # (the dispatcher, built below, starts with its gauges stale)
        self.doorbell = Doorbell(self.segments.doorbell, self.segments.engine_sleeping)
        self.disk, self.remote = open_tiers(config, opened, self.segments, self.stats, self.doorbell.ring,
                                            self._answer_remote)
        self.dispatcher = Dispatcher(self.index, self.backend, self.stats, config.lookup_wait_s,
                                     disk=self.disk, remote=self.remote,
                                     clients=lambda: self.table.attached,  # rings a waiting LOOKUP reads past
                                     own_pid_is_client=serve_own_process,
                                     compute_once=config.compute_once)
        self.table = ClientTable(config.name, self.segments, self.stats, self.dispatcher.release_client,
                                 self.backend.drop_held, own_pid_is_client=serve_own_process)
        self.is_stopping = False
        self.slow = SlowCommands()  # handlings that held up every other client (slow_commands.py)
        self._next_housekeeping = 0.0
        self._next_claim_check = 0.0
        self.pinner.start(wake=self.doorbell.ring)
        log_ready(config, self.segments, self.backend, opened.pool, marks)
        self.segments.mark_serving()  # claims are accepted from the loop's first pass on

    def _answer_remote(self, received, num_hits: int, lease_id: int) -> None:
        """A LOOKUP the remote store continued, answered (the dispatcher's, built after the tiers)."""
        self.dispatcher.lookups.answer_remote(received, num_hits, lease_id)

    def request_stop(self) -> None:
        self.is_stopping = True
        self.doorbell.sem.release()  # wake the loop if it sleeps

    def serve_forever(self) -> None:
        """Serve until ``request_stop``; the stop runs however the loop ended (an error in
        it too: logged, then raised once the engine's shared memory and lock files are gone)."""
        monotonic, idle_spin_s = time.monotonic, self.config.idle_spin_s
        last_work = monotonic()
        try:
            while not self.is_stopping:
                now = monotonic()
                if self.run_once(now):
                    last_work = now
                elif now - last_work > idle_spin_s:
                    self._sleep(now)
        except BaseException:
            logger.exception("engine %r: its loop failed; stopping", self.config.name)
            raise
        finally:
            self.shutdown()

    def run_once(self, now: float) -> bool:
        if now >= self._next_claim_check:
            self._next_claim_check = now + CLAIM_CHECK_S
            self.table.accept_claims()
            if self._is_pinning and self._take_pinned():
                self.dispatcher.index_changed()
            if self.disk is not None:
                self.disk.spill()
            if self.remote is not None:
                self.remote.publish()
        did_work = self._drain_rings()
        if self.disk is not None and self.disk.num_inflight and self.disk.poll():
            self.dispatcher.resume_parked_loads(now)
            did_work = True
        if self.remote is not None and self.remote.has_work() and self.remote.poll(now):
            self.dispatcher.resume_parked_loads(now)  # (a fetch may have ended)
            did_work = True
        if self.dispatcher.transfers.issuing:  # long SAVEs or LOADs, a slice a turn (issuing.py)
            self.dispatcher.index_changed()
            self.dispatcher.transfers.issuing.more()
            did_work = True
        if self.dispatcher.pending:  # only copies in flight can finish
            for done in self.backend.poll():
                self.dispatcher.on_copy_done(done)
                did_work = True
        waiting = self.dispatcher.waiting
        if waiting.items and (did_work or now >= waiting.next_deadline()):  # saves landed, rings read
            did_work |= waiting.resume(now) > 0
        if now >= self._next_housekeeping:
            self._housekeeping(now)
            self.dispatcher.update_gauges()
        return did_work

    def _sleep(self, now: float) -> None:
        if self.backend.num_inflight():
            time.sleep(20e-6)
            return
        if self.table.clients or self.index.leases or self.index.writing:
            deadline = self._next_housekeeping
        else:  # a claim rings the doorbell, so does a stop: each wake-up costs CPU, skip them
            deadline = now + UNATTENDED_SLEEP_S
        if any(c.backlog for c in self.table.attached):
            deadline = min(deadline, now + HELD_BACK_POLL_S)  # reading answers rings no doorbell
        if self.remote is not None:  # a LOOKUP waiting on the remote store is answered at its deadline
            deadline = min(deadline, self.remote.lookups.next_deadline())
        deadline = min(deadline, self.dispatcher.waiting.next_deadline())  # and one waiting for saves
        # No spin first: serve_forever has spun for idle_spin_s before calling this.
        if sleep_until(self._has_submissions, self.doorbell, deadline):
            self._next_claim_check = 0.0

    def _has_submissions(self) -> bool:
        # Answers queued behind a full completion ring are work once the client has read
        # some (_sleep looks every HELD_BACK_POLL_S: reading rings no doorbell); a client
        # held back for its unread answers has no command taken meanwhile (else: a spin).
        return (self.is_stopping or self.segments.has_claims() or (
            self.disk is not None and self.disk.store.has_results()) or (
            self.remote is not None and self.remote.workers.has_results()) or (
            self._is_pinning and self.pinner.progress is not self._pin_seen) or any(
            (c.backlog and c.completions.has_room())
            or (c.submissions.is_ready() and len(c.backlog) < MAX_UNREAD_ANSWERS)
            for c in self.table.attached))

    def _drain_rings(self) -> bool:
        """Up to MAX_COMMANDS_PER_CLIENT_ROUND commands of each client, then its backlog."""
        did_work = False
        dispatcher = self.dispatcher
        issuing = dispatcher.transfers.issuing.slots  # a client's next command waits for its SAVE or LOAD
        for client in self.table.attached:  # a snapshot: a DETACH may retire a client meanwhile
            if client.backlog:
                queued = len(client.backlog)
                is_flushed = client.flush()
                did_work |= len(client.backlog) < queued
                if not is_flushed and len(client.backlog) >= MAX_UNREAD_ANSWERS:
                    continue  # it reads none of its answers: the engine's memory must not grow
            submissions = client.submissions
            for _ in range(MAX_COMMANDS_PER_CLIENT_ROUND):
                if client.slot in issuing:
                    break
                rec = submissions.try_peek_values()  # the protocol reads its fields by place
                if rec is None:
                    break
                did_work = True
                is_detached = False
                started, issued = time.perf_counter(), dispatcher.transfers.issue_s
                try:
                    is_detached = dispatcher.handle(client, rec)
                except Exception:  # boundary: one bad command must not take the engine down
                    dispatcher.answer_internal_error(client, rec)
                if (seconds := time.perf_counter() - started) > SLOW_COMMAND_S:
                    _, opcode, num_items = envelope(rec)
                    self.slow.note(opcode, seconds, client.slot, num_items,
                                   dispatcher.transfers.issue_s - issued)
                # Only now may the client reuse the slot and the payload bytes (``handle``
                # copied them): handing them back after the answer keeps it off the answer's path.
                submissions.release()
                if is_detached:  # a DETACH accepted, not refused
                    self.table.retire(client)
                    # its slot is freed by housekeeping: within housekeeping_s, not 2.5 s
                    self._next_housekeeping = min(self._next_housekeeping,
                                                  time.monotonic() + self.config.housekeeping_s)
            if client.backlog:
                client.flush()
        return did_work

    def _take_pinned(self) -> bool:
        """Grow the usable pool by what the pinning thread pinned since the last look: True
        where the index grew."""
        progress, has_grown = self.pinner.progress, False
        if progress is self._pin_seen:
            return False
        self._pin_seen = progress
        self._is_pinning = not progress.is_finished
        ready = progress.ready_bytes
        if ready > self.index.pool.bytes_ready:
            try:
                self.backend.extend_pool(ready)
            except PegaflowError as exc:
                logger.error("pool: the part pinned up to %s cannot be used (%s); the engine "
                             "serves with %s", format_size(ready), exc,
                             format_size(self.index.pool.bytes_ready))
                self.pinner.request_stop()
                self._is_pinning = False
                return False
            num_kept = self.index.grow(ready)
            if num_kept:
                logger.debug("pool: %d kept blocks served from now on", num_kept)
            self.stats.set("pool_bytes_ready", self.index.pool.bytes_ready)
            has_grown = True
        if progress.is_finished and progress.error is None:
            self.stats.set("pool_pin_ns", progress.elapsed_ns)
        return has_grown

    def _housekeeping(self, now: float) -> None:
        is_timed = self.index.leases or self.index.writing or any(
            c.is_detached or not c.is_attached for c in self.table.attached)
        self._next_housekeeping = now + (self.config.housekeeping_s if is_timed else
                                         max(self.config.housekeeping_s, LIVENESS_ONLY_S))
        if self.dispatcher.transfers.parked:  # LOADs waiting for disk reads past their deadline
            self.dispatcher.resume_parked_loads(now)
        self.index.expire_leases(now)
        self.slow.report(now)
        self.index.drop_stale_writes(now - self.config.lease_ttl_s)
        self.dispatcher.claims.sweep(now)  # compute once: claims saved or past their deadline end
        self.table.check_alive()
        if self.dispatcher.waiting.items:  # a dead saver's half-written blocks just dropped
            self.dispatcher.waiting.resume(now)
        self.stats.set("heartbeat_ns", time.time_ns())

    def shutdown(self) -> None:
        """Finish in-flight copies, answer what is queued with SHUTTING_DOWN, unlink everything."""
        self.dispatcher.transfers.issuing.finish()  # (each then ends as its copies do)
        shut_down(self)
