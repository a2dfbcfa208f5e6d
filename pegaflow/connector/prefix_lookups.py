"""The scheduler side's lookups: one LOOKUP per rank for the blocks vLLM has not computed,
their answers collected within a short wait per call (vLLM asks again next step while they
are on their way), and every lease they bring given back unless a load takes it.

Under compute once (``ConnectorConfig.is_claiming``, docs/replicas.md) each LOOKUP carries a
``Prefill``: the engine claims for this vLLM what it misses, or parks it while another vLLM
computes the same blocks.  Such a lookup may stay out longer (``lookup_deadline_ms``); vLLM
asks again every step meanwhile, and only its first ask waits for the answer at all.  The
claims are released when the request finishes or is preempted (``release_claims``)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from pegaflow.connector import mamba_state
from pegaflow.connector.config import ConnectorConfig
from pegaflow.connector.link import EngineLink
from pegaflow.connector.stats import PegaKVConnectorStats
from pegaflow.platform.errors import EngineTimeoutError, PegaflowError
from pegaflow.platform.protocol import Prefill
from pegaflow.platform.wire import Opcode, Status, encode_hashes

logger = logging.getLogger(__name__)

LOOKUP_MAX_AGE_S = 30.0  # an answer kept longer is asked again: its lease (default TTL
#                          120 s) may expire, and the blocks with it, while vLLM cannot
#                          allocate the request yet
REFUSED_LOG_EVERY = 100  # answers refused a wait (WAIT_REFUSED): one logged a WARNING per this many
FIRST_WAIT_S = 2e-3  # per call, all ranks' answers together: a lookup is usually answered in
#                     ~0.1 ms; past this, vLLM asks again


@dataclass(slots=True)
class PendingLookup:
    client: object  # command ids mean something only to the client that sent them
    command_ids: tuple[int, ...]  # the engine's ids of its LOOKUPs, one per worker rank (pp x tp)
    num_blocks: int
    started_at: float
    answers: dict = field(default_factory=dict)
    hashes: tuple[bytes, ...] = ()  # (a hybrid SSM model's: its state lookups follow)
    num_run: int = -1  # the stored run's blocks on every rank, once its state lookups are out
    state_ids: dict[int, tuple[int, ...]] = field(default_factory=dict)  # position -> a LOOKUP per rank
    is_claiming: bool = False  # compute once: it may wait for another vLLM's prefill
    num_asks: int = 0  # vLLM's asks so far: the first waits FIRST_WAIT_S, a claiming one's later ones poll


class Lookups:
    def __init__(self, config: ConnectorConfig, namespaces: list[int], block_size: int, link: EngineLink,
                 stats: PegaKVConnectorStats, has_states: bool = False):
        self.has_states = has_states  # a hybrid SSM model: a hit must end on a stored state
        self.config = config
        self.namespaces = namespaces  # one LOOKUP per worker rank (pp x tp, in rank order)
        self.block_size = block_size
        self.link = link
        self.stats = stats
        self.num_late = 0
        self.num_refused = 0  # answers past the engine's bounds on waiting LOOKUPs (WAIT_REFUSED)

    def start(self, state, request, num_computed_tokens: int) -> None:
        """Send one LOOKUP per rank for the blocks vLLM has not computed (one token left over)."""
        bs = self.block_size
        if not self.config.enable_load or num_computed_tokens % bs:
            return
        first = num_computed_tokens // bs
        num_loadable = max(0, (request.num_tokens - 1 - num_computed_tokens) // bs)
        hashes = list(request.block_hashes[first:first + num_loadable])
        if not hashes or (client := self.link.client()) is None:
            return
        self.release_orphans(client)
        config = self.config
        prefill = Prefill(self.block_size, int(config.prefill_tokens_per_s),
                          int(config.compute_once_wait_ms)) if config.is_claiming else None
        try:
            records = encode_hashes(hashes)
            wait_ms = config.lookup_wait_arg
            ids = tuple(client.submit_lookup(namespace, records, wait_ms=wait_ms, prefill=prefill)
                        for namespace in self.namespaces)
        except PegaflowError as exc:
            self.link.fail(exc)
            return
        state.lookup = PendingLookup(client, ids, len(hashes), time.monotonic(),
                                     hashes=tuple(hashes) if self.has_states else (), is_claiming=prefill is not None)
        if prefill is not None:  # what the engine may have claimed for this request
            state.claimed.update(zip(range(first, first + len(hashes)), hashes))

    def finish(self, state) -> bool:
        """Collect the answers if they are in (True), or give up after the deadline (True)."""
        pending, client = state.lookup, self.link.client()
        if client is None or client is not pending.client:  # reconnected: those ids are void
            state.lookup = None
            return True
        timeout_ms = self.config.lookup_deadline_ms if pending.is_claiming else self.config.lookup_timeout_ms
        deadline = pending.started_at + timeout_ms / 1e3
        is_polled = pending.is_claiming and pending.num_asks > 0  # (a wait on each ask would add up)
        pending.num_asks += 1
        wait_until = min(deadline, time.monotonic() + (0.0 if is_polled else FIRST_WAIT_S))  # all ranks' answers
        try:
            self._collect(client, pending, pending.command_ids, wait_until)
            if pending.hashes and pending.num_run < 0:
                mamba_state.submit_state_lookups(client, self, pending)
            self._collect(client, pending, [i for ids in pending.state_ids.values() for i in ids], wait_until)
        except EngineTimeoutError:
            return self._late(state, client, deadline)
        except PegaflowError as exc:
            self.link.fail(exc)
            state.lookup = None
            return True
        state.lookup = None
        answers = [pending.answers[i] for i in pending.command_ids]
        self._note_refused(state, answers)
        leases = tuple(a.result.lease_id for a in answers)
        num_hits = _num_hits(pending.num_blocks, answers)
        if pending.hashes:  # only as far as the last stored Mamba state in that run
            num_hits = mamba_state.finish_state_lookups(self, pending, num_hits)
        self.stats.add("lookups")
        self.stats.add("lookup_tokens", pending.num_blocks * self.block_size)
        self.stats.add("lookup_hit_tokens", num_hits * self.block_size)
        self.stats.observe("lookup_s", time.monotonic() - pending.started_at)
        logger.debug("pegaflow: lookup for %s: %d of %d blocks cached", state.request.request_id,
                     num_hits, pending.num_blocks)
        if num_hits == 0:
            self.release(leases)
            return True
        state.num_hit_tokens, state.lease_ids = num_hits * self.block_size, leases
        state.is_from_disk = any(a.is_ok and a.result.num_disk_blocks for a in answers)
        return True

    @staticmethod
    def _collect(client, pending: PendingLookup, command_ids, wait_until: float) -> None:
        for command_id in command_ids:
            if command_id not in pending.answers:
                pending.answers[command_id] = client.wait(command_id, max(0.0, wait_until - time.monotonic()))

    def _note_refused(self, state, answers) -> None:
        """Answers the engine gave at once, past its bounds on parked LOOKUPs (WAIT_REFUSED):
        their READY prefix is used as any answer's, the rest computed; counted, and logged
        one in REFUSED_LOG_EVERY."""
        num_refused = sum(a.status == Status.WAIT_REFUSED for a in answers)
        if not num_refused:
            return
        self.num_refused += num_refused
        self.stats.add("lookup_waits_refused", num_refused)
        log = logger.warning if self.num_refused % REFUSED_LOG_EVERY == 1 else logger.debug
        log("pegaflow: lookup for %s was answered without waiting for blocks being saved: the "
            "engine holds too many waiting lookups (%d so far; blocks not yet saved are computed)",
            state.request.request_id, self.num_refused)

    def _late(self, state, client, deadline: float) -> bool:
        if time.monotonic() < deadline:
            return False
        self.num_late += 1
        self.stats.add("lookup_timeouts")
        log = logger.warning if self.num_late % 100 == 1 else logger.debug
        log("pegaflow: lookup for %s missed its %.0f ms deadline and is served as a miss (%d so "
            "far; a busy or stopped engine, or raise lookup_timeout_ms)", state.request.request_id,
            self.config.lookup_timeout_ms, self.num_late)
        self._drop(state, client)
        return True

    def _drop(self, state, client) -> None:
        """Give back the leases of the lookup in flight and stop waiting for its other
        answers (``client`` None: the connection it went out on is gone)."""
        lookup, state.lookup = state.lookup, None
        self.release(tuple(a.result.lease_id for a in lookup.answers.values()))
        state_ids = [i for ids in lookup.state_ids.values() for i in ids]
        for command_id in [*lookup.command_ids, *state_ids] if client is not None else ():
            if command_id not in lookup.answers:
                client.abandon(command_id)

    def release_orphans(self, client) -> None:
        """Leases of lookups answered after their deadline: give them back."""
        try:
            for done in client.take_orphans():
                if done.opcode == Opcode.LOOKUP and done.is_ok and done.result.lease_id:
                    client.release_nowait(done.result.lease_id)
        except PegaflowError as exc:
            self.link.fail(exc)

    def release_request(self, state, request) -> None:
        """A request finished (or was aborted): its leases and its claims given back."""
        self.release_leases(state)
        if state.claimed:
            self.release_claims(state, max(state.num_saved_blocks, request.num_computed_tokens // self.block_size))

    def release_claims(self, state, num_computed_blocks: int) -> None:
        """Compute once: the blocks the engine may hold claimed for this request past its
        first ``num_computed_blocks`` (it finished, was aborted or preempted: those will not
        come from it) are claimed no more.  The computed ones' saves are planned: their claims
        end as they land, or fail."""
        claimed, state.claimed = state.claimed, {}
        hashes = [h for i, h in claimed.items() if i >= num_computed_blocks]
        client = self.link.client() if hashes else None
        if client is None:
            return  # the engine ends a gone client's claims itself
        try:
            client.release_claim_nowait(hashes)
        except PegaflowError as exc:
            self.link.fail(exc)

    def release(self, lease_ids) -> None:
        client = self.link.client() if any(lease_ids) else None
        if client is None:
            return  # the engine expires them, or reclaims them with our slot
        try:
            for lease_id in lease_ids:
                if lease_id:
                    client.release_nowait(lease_id)
        except PegaflowError as exc:
            self.link.fail(exc)

    def release_leases(self, state) -> None:
        """Give back every lease ``state`` holds or awaits (a lookup in flight, a planned load)."""
        self.release(state.lease_ids)
        state.lease_ids = ()
        if state.lookup is not None:
            client = self.link.client()
            self._drop(state, client if client is state.lookup.client else None)
        if state.pending_load is not None:
            self.release(state.pending_load.lease_ids)
            state.pending_load = None


def _num_hits(num_blocks: int, answers) -> int:
    """The blocks every rank found stored, of ``num_blocks`` asked."""
    return min([num_blocks] + [a.result.num_hit_blocks if a.is_ok else 0 for a in answers])
