"""LOOKUP: the READY prefix of a chain of keys, leased, and where it may go on.

    lookup          the index's prefix, now; or parked (``lookup_waits.py``) while it
                    stops at a block being saved, answered when the saves land or at its
                    wait's end (the LOOKUP's ``wait_ms``, else the engine's --lookup-wait-ms);
                    past the bounds on parked LOOKUPs, answered now under WAIT_REFUSED
                    (one the remote tier goes on with is answered OK by it)
    (compute once)  a LOOKUP with a ``Prefill`` claims what it misses for its instance, and
                    is parked while its prefix reaches blocks another instance claimed
                    (``prefill_claims.py``), if that wait looks no longer than computing
    continue_on     then through the remote store, if the engine has one (``remote/store_lookups.py``
                    answers it through ``answer_remote`` once the store says)

Every answer is counted in the lookup stats; the lease of a client gone meanwhile ends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pegaflow.platform.protocol import Key, Lookup, LookupAnswer
from pegaflow.platform.wire import Status

from ..blocks.index import BlockIndex
from ..config import MAX_LOOKUP_WAIT_S
from ..stats import StatsWriter
from .lookup_waits import Parked, WaitingLookup, WaitingLookups, writing_stop
from .prefill_claims import PrefillClaims
from .received import LATER, Received

logger = logging.getLogger(__name__)


class Lookups:
    def __init__(self, index: BlockIndex, stats: StatsWriter, answer_later: Callable, lookup_wait_s: float,
                 is_issuing_save: Callable[[object, int], bool], clients: Callable[[], tuple] = tuple, remote=None,
                 claims: PrefillClaims | None = None):
        """``answer_later``: the dispatcher's answer to a LOOKUP that waited (``Dispatcher.answer_later``);
        ``is_issuing_save``: whether a SAVE of (client, namespace) is being issued in slices
        (``Issuing.is_issuing_save``); ``remote``: the remote tier (``engine/remote/tier.py``), if any;
        ``claims``: compute once's claims (``prefill_claims.py``; None: a table that claims nothing)."""
        self.index, self.stats, self.answer_later = index, stats, answer_later
        self.claims = claims if claims is not None else PrefillClaims(index, stats, False)
        # LOOKUPs waiting for saves in flight: by default for at most ``lookup_wait_s`` (0:
        # never), and ``clients`` says whose rings may hold a SAVE not read yet (the
        # server's attached clients)
        self.waiting = WaitingLookups(self.index, self._answer_waiting, self.stats, is_issuing_save, self.claims)
        self.lookup_wait_s = lookup_wait_s
        self.clients = clients
        self.remote = remote

    def lookup(self, received: Received, lookup: Lookup):
        client, keys = received.client, lookup.keys()
        num_hits, lease_id = self.index.lookup(client.slot, keys, client.instance)
        wait_s = self.lookup_wait_s if lookup.wait_ms is None else min(lookup.wait_ms / 1e3, MAX_LOOKUP_WAIT_S)
        is_reading = lease_id and self.index.leases[lease_id].num_disk  # (the disk tier has the rest)
        # compute once: the wait for another instance's claim, then this one's claim
        claim_until = None if is_reading else self.claims.wait_until(client, keys, num_hits, lookup.prefill)
        self.claims.claim(client, keys, num_hits, lookup.prefill)
        claim_wait = None if claim_until is None else (claim_until, lookup.prefill)
        parked = Parked.NO
        if (wait_s > 0 or claim_wait) and num_hits < len(keys) and not is_reading:
            parked = self.waiting.try_park(received, keys, num_hits, wait_s, self.clients(), claim_wait)
        if parked is Parked.YES:
            if lease_id:  # answered once the saves land (or at the deadline), with a fresh lookup
                self.index.release(lease_id)
            return LATER
        answer = self.continue_on(received, keys, num_hits, lease_id)
        if parked is Parked.REFUSED and answer is not LATER:  # past the bounds: its asker is told
            self.answer_later(received, Status.WAIT_REFUSED, answer)
            return LATER
        return answer

    def continue_on(self, received: Received, keys: list[Key], num_hits: int, lease_id: int):
        """The rest of a LOOKUP whose local prefix is leased: through the remote store, if any."""
        remote = self.remote
        if remote is not None:  # the prefix may go on in the remote store: answered once it says
            if lease_id:
                lease = self.index.leases[lease_id]
                remote.note_hits(lease.entries, lease.keys)
            if remote.try_lookup(received, keys, num_hits, lease_id):
                return LATER
        return self._counted(received, num_hits, lease_id)

    def _answer_waiting(self, waiting: WaitingLookup) -> None:
        """A LOOKUP whose wait for saves in flight is over: the index walked again, answered."""
        received = waiting.received
        client = received.client
        if waiting.prefill is None:  # (a wait for a claim is counted as one: count_wait)
            self._count_wait(waiting)
        status, answer = Status.OK, ()
        if client.is_attached:
            try:
                num_hits, lease_id = self.index.lookup(client.slot, waiting.keys, client.instance)
                if waiting.prefill is not None:  # compute once: what its wait for a claim gained
                    self.claims.count_wait(max(0, num_hits - waiting.num_ready), waiting.prefill,
                                           time.monotonic() - waiting.parked_at)
                answer = self.continue_on(received, waiting.keys, num_hits, lease_id)
            except Exception:  # boundary, as in the server's loop: answered, the engine goes on
                logger.exception("slot %d: internal error answering a waiting LOOKUP", client.slot)
                status = Status.INTERNAL
        self.answer_later(received, status, answer)

    def _count_wait(self, waiting: WaitingLookup) -> None:
        num_more, _ = writing_stop(self.index, waiting.keys[waiting.num_usable:], time.monotonic())
        self.stats.add("lookup_waits")
        self.stats.add("lookup_wait_ns", int((time.monotonic() - waiting.parked_at) * 1e9))
        self.stats.add("lookup_wait_blocks", waiting.num_usable + num_more - waiting.num_ready)
        self.stats.add("lookup_wait_timeouts", int(waiting.is_late))

    def _counted(self, received: Received, num_hits: int, lease_id: int) -> LookupAnswer:
        """A LOOKUP's answer (counted in the stats): hits, lease, blocks still on their way."""
        num_disk = self.index.leases[lease_id].num_disk if lease_id else 0
        slot, stats = received.client.slot, self.stats
        stats.add("lookups")
        stats.add("lookup_blocks", received.num_items)
        stats.add("lookup_hit_blocks", num_hits)
        stats.add_client(slot, "lookups", 1)
        stats.add_client(slot, "lookup_hit_blocks", num_hits)
        return LookupAnswer(num_hits, lease_id, num_disk)

    def answer_remote(self, received: Received, num_hits: int, lease_id: int) -> None:
        """A LOOKUP the remote tier continued: answered now (its local prefix and what the
        store held, being fetched)."""
        if lease_id and not received.client.is_attached:  # gone meanwhile: its lease ends here
            self.index.release(lease_id)
            num_hits = lease_id = 0
        self.answer_later(received, Status.OK, self._counted(received, num_hits, lease_id))
