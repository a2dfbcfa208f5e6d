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
(``engine/pinning.py``) and rings the doorbell after each chunk, and the loop, at its
claim checks, grows the usable pool by what was pinned (``_take_pinned``): the backend
first, then the index and pool, then the stats' ``pool_bytes_ready``.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from pegaflow.platform.errors import PegaflowError
from pegaflow.platform.protocol import read_payload
from pegaflow.platform.values import format_size
from pegaflow.platform.waits import Doorbell, sleep_until
from pegaflow.platform.wire import CLIENT_STATS, STATS

from .client_table import ClientTable
from .config import EngineConfig
from .copy import make_backend
from .copy.base import CopyBackend
from .disk.open import open_disk_tier
from .dispatcher import Dispatcher
from .fault_in import default_threads
from .index import BlockIndex
from .pinning import PinProgress, PoolPinner
from .pool import PagePool
from .pool_table import NoTable, PoolTable
from .remote.open import open_remote_tier
from .segments import EngineSegments
from .stats import StatsWriter

logger = logging.getLogger(__name__)

MAX_COMMANDS_PER_CLIENT_ROUND = 8  # a lookup waits behind at most this many saves
HELD_BACK_POLL_S = 5e-3  # while answers wait behind a full completion ring: how often to look
MAX_UNREAD_ANSWERS = 1024  # answers queued behind a client's full completion ring; past
#                            this its commands wait unread (its submit then times out)
SHUTDOWN_DRAIN_S = 5.0
CLAIM_CHECK_S = 1e-3
LIVENESS_ONLY_S = 2.5  # clients attached, nothing leased, half written or detaching: only
#                        their liveness is checked, and a dead one's slot can wait this long
UNATTENDED_SLEEP_S = LIVENESS_ONLY_S  # nothing attached: a wake-up only to beat the heartbeat
#                        (pegaflow-stat tells a stopped or stuck engine by a stale one)


class EngineServer:
    def __init__(self, config: EngineConfig, backend: CopyBackend | None = None):
        self.config = config
        marks = [time.perf_counter()]  # the start's steps, for its log line
        self.segments = EngineSegments(config)
        marks.append(time.perf_counter())
        try:  # a failed start leaves nothing behind in /dev/shm
            table = None  # only a kept pool needs its table (and a slab's entries capped by it)
            if config.keep_pool:
                segment = self.segments.pool_table
                table = PoolTable(segment.array(np.uint8, segment.size), config.usable_pool_bytes,
                                  config.slab_bytes, keep=self.segments.is_pool_kept)
            pool = PagePool(config.usable_pool_bytes, config.slab_bytes,
                            table.records_per_slab if table else None, ready_bytes=0)
            self.backend = backend or make_backend(config.backend, config.copy_backend,
                                                      config.device_staging_bytes)
            self.backend.open_pool(self.segments.pool)
            marks.append(time.perf_counter())
            self.pinner = PoolPinner(self.segments.pool, self.backend, config.pin_chunk,
                                     config.pin_threads or default_threads(), config.pin_rate_bytes)
            self.pinner.pin_first()
            marks.append(time.perf_counter())
            self.index = BlockIndex(pool, config.lease_ttl_s, table if table is not None else NoTable())
            if self.segments.is_pool_kept:
                num_blocks = self.index.adopt_table()
                logger.info("took in %d blocks (%.1f MiB) from the pool an earlier engine kept%s",
                            num_blocks, pool.bytes_used / 2**20, "" if config.pin_chunk >= pool.bytes_total
                            else "; each is served once its part of the pool is pinned")
        except BaseException:
            self.segments.unlink_all()
            raise
        self.segments.has_started = True  # from here on, --keep-pool keeps even a new pool
        self.stats = StatsWriter(self.segments.stats.array(STATS, 1), self.segments.stats.array(
            CLIENT_STATS, config.num_slots, STATS.itemsize))
        self.stats.set("pool_bytes_capacity", self.index.pool.bytes_total)
        self.dispatcher = Dispatcher(self.index, self.backend, self.stats, config.lookup_wait_s)
        self._pin_seen = PinProgress()  # the pinner's progress the pool has grown by
        self._is_pinning = True
        self._take_pinned()
        self.table = ClientTable(config.name, self.segments, self.stats, self.dispatcher)
        self.dispatcher.clients = lambda: self.table.attached  # rings a waiting LOOKUP reads past
        self.doorbell = Doorbell(self.segments.doorbell, self.segments.engine_sleeping)
        self.disk = self.remote = None
        try:  # its paths are checked and its files taken in before the engine serves
            self.disk = open_disk_tier(config, self.index, self.segments.pool, self.stats,
                                       self.doorbell.ring)
            self.remote = open_remote_tier(config, self.index, self.segments.pool, self.stats,
                                           self.doorbell.ring)
        except BaseException:
            if self.disk is not None:
                self.disk.close()
            self.pinner.stop()
            self.backend.close()
            self.segments.unlink_all()
            raise
        self.dispatcher.disk = self.disk
        self.dispatcher.remote = self.remote
        if self.remote is not None:
            self.remote.lookups.answer = self.dispatcher.lookups.answer_remote
        self.is_stopping = False
        self._next_housekeeping = 0.0
        self._next_claim_check = 0.0
        self.pinner.start(wake=self.doorbell.ring)
        if config.usable_pool_bytes < config.pool_bytes:
            logger.warning("--pool-size %s is not a whole number of %s slabs: %s allocated",
                           format_size(config.pool_bytes), format_size(config.slab_bytes),
                           format_size(config.usable_pool_bytes))
        steps = [b - a for a, b in zip(marks, marks[1:])]
        logger.info("engine %r ready: %s backend, pool %s (%d %s of %s; the largest block it "
                    "stores is one slab; %s of it pinned so far), %d client slots; in %.2f s "
                    "(shared memory %.2f s, backend %.2f s, first chunk %.2f s)", config.name,
                    self.backend.name, format_size(config.usable_pool_bytes), pool.num_slabs,
                    "slab" if pool.num_slabs == 1 else "slabs", format_size(config.slab_bytes),
                    format_size(pool.bytes_ready), config.num_slots,
                    time.perf_counter() - marks[0], *steps)
        self.segments.mark_serving()  # claims are accepted from the loop's first pass on

    def serve_own_process(self) -> None:
        """Take clients of this very process (an engine run in a test's process): its pid
        is otherwise never a client's."""
        self.dispatcher.own_pid_is_client = True

    def request_stop(self) -> None:
        self.is_stopping = True
        self.doorbell.sem.release()  # wake the loop if it sleeps

    def serve_forever(self) -> None:
        monotonic, idle_spin_s = time.monotonic, self.config.idle_spin_s
        last_work = monotonic()
        while not self.is_stopping:
            now = monotonic()
            if self.run_once(now):
                last_work = now
            elif now - last_work > idle_spin_s:
                self._sleep(now)
        self.shutdown()

    def run_once(self, now: float) -> bool:
        if now >= self._next_claim_check:
            self._next_claim_check = now + CLAIM_CHECK_S
            self.table.accept_claims()
            if self._is_pinning:
                self._take_pinned()
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
        for client in self.table.attached:  # a snapshot: a DETACH may retire a client meanwhile
            if client.backlog:
                queued = len(client.backlog)
                is_flushed = client.flush()
                did_work |= len(client.backlog) < queued
                if not is_flushed and len(client.backlog) >= MAX_UNREAD_ANSWERS:
                    continue  # it reads none of its answers: the engine's memory must not grow
            submissions = client.submissions
            for _ in range(MAX_COMMANDS_PER_CLIENT_ROUND):
                rec = submissions.try_peek()
                if rec is None:
                    break
                did_work = True
                is_detached = False
                try:
                    is_detached = dispatcher.handle(client, rec, read_payload(client.view.arena, rec))
                except Exception:  # boundary: one bad command must not take the engine down
                    dispatcher.answer_internal_error(client, rec)
                # Only now may the client reuse the slot and the payload bytes (copied
                # above): handing them back after the answer keeps it off the answer's path.
                submissions.release()
                if is_detached:  # a DETACH accepted, not refused
                    self.table.retire(client)
                    # its slot is freed by housekeeping: within housekeeping_s, not 2.5 s
                    self._next_housekeeping = min(self._next_housekeeping,
                                                  time.monotonic() + self.config.housekeeping_s)
            if client.backlog:
                client.flush()
        return did_work

    def _take_pinned(self) -> None:
        """Grow the usable pool by what the pinning thread pinned since the last look."""
        progress = self.pinner.progress
        if progress is self._pin_seen:
            return
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
                return
            num_kept = self.index.grow(ready)
            if num_kept:
                logger.debug("pool: %d kept blocks served from now on", num_kept)
            self.stats.set("pool_bytes_ready", self.index.pool.bytes_ready)
            self.dispatcher.gauges_stale = True
        if progress.is_finished and progress.error is None:
            self.stats.set("pool_pin_ns", progress.elapsed_ns)

    def _housekeeping(self, now: float) -> None:
        is_timed = self.index.leases or self.index.writing or any(
            c.is_detached or not c.is_attached for c in self.table.attached)
        self._next_housekeeping = now + (self.config.housekeeping_s if is_timed else
                                         max(self.config.housekeeping_s, LIVENESS_ONLY_S))
        if self.dispatcher.transfers.parked:  # LOADs waiting for disk reads past their deadline
            self.dispatcher.resume_parked_loads(now)
        self.index.expire_leases(now)
        self.index.drop_stale_writes(now - self.config.lease_ttl_s)
        self.table.check_alive()
        self.stats.set("heartbeat_ns", time.time_ns())

    def shutdown(self) -> None:
        """Finish in-flight copies, answer what is queued with SHUTTING_DOWN, unlink everything."""
        logger.info("engine %r stopping", self.config.name)
        self.segments.mark_stopping()
        pinner_stopped = self.pinner.stop()  # before the backend closes: it unpins only what is over
        dispatcher = self.dispatcher
        for received in dispatcher.transfers.parked.take_all():  # waiting for disk reads
            dispatcher.answer_stopping(received)
        for waiting in dispatcher.waiting.take_all():  # LOOKUPs waiting for saves
            dispatcher.answer_stopping(waiting.received)
        is_disk_stopped = self.disk is None or self.disk.close()  # its I/O uses the pool's pages
        is_disk_stopped = (self.remote is None or self.remote.close()) and is_disk_stopped
        deadline = time.monotonic() + SHUTDOWN_DRAIN_S
        while self.backend.num_inflight() and time.monotonic() < deadline:
            for done in self.backend.poll():
                self.dispatcher.on_copy_done(done)
            time.sleep(1e-3)
        for client in self.table.clients.values():
            while (rec := client.submissions.try_get()) is not None:
                dispatcher.answer_stopping(dispatcher.received_unread(client, rec))
            client.flush()
        if not pinner_stopped or not is_disk_stopped:  # a thread may still use the pool: leave it to the exit
            logger.error("engine %r: the pool's %s thread is still running; the pool stays "
                         "mapped until the process exits", self.config.name,
                         "pinning" if not pinner_stopped else "disk or remote I/O")
            self.segments.unlink_all(release_pool=False)
            return
        self.backend.close()
        self.segments.unlink_all(release_pool=self.backend.num_inflight() == 0)
        logger.info("engine %r stopped; its shared memory is unlinked", self.config.name)
