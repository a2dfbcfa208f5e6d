"""A LOOKUP continued through the remote store, on the engine's thread::

    start(received, keys, num_hits, lease_id)   the local prefix ended on a key the pool
            lacks: ask the store which keys after it it holds (a query) and leave
            the LOOKUP unanswered (its client's ``num_inflight`` counts it meanwhile)
    on_query(done)      the store said which keys it holds: a pool entry is reserved for
            the run of them (one block size, the first key's), their fetch starts, the
            lease is extended over them (pinned, ``is_promoting``, counted in its
            ``num_disk``: a LOAD of it waits for the fetch) and the LOOKUP is answered
    expire(now)         a LOOKUP whose query is not back by its deadline is answered with
            its local prefix alone (the late headers are ignored)
    on_fetch(done)      a block fetched and checked becomes READY; one that failed or was
            corrupt is doomed (its LOAD answers MISSING_BLOCK: vLLM recomputes)

While a query has been out longer than the deadline (the store stalls), lookups do not ask
it at all: their misses are counted and answered at once.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..blocks.entries import ORPHAN, Entry, Key
from ..blocks.index import BlockIndex
from ..stats import StatsWriter
from .workers import MAX_QUERY_BLOCKS, FetchStatus, Kind, RemoteDone, RemoteJob, RemoteWorkers

logger = logging.getLogger(__name__)

MAX_FETCH_BYTES = 2 << 30  # one lookup's fetch at most (its LOAD waits for all of it, 3 s at most)
MAX_QUERIES_IN_FLIGHT = 16


@dataclass(slots=True)
class PendingLookup:
    received: object  # the LOOKUP as received (``engine/commands/received.py``): answered once, from here
    keys: list[Key]  # those after the local prefix
    num_hits: int    # the local prefix
    lease_id: int
    deadline: float

    @property
    def client(self):
        return self.received.client


class RemoteLookups:
    def __init__(self, workers: RemoteWorkers, index: BlockIndex, stats: StatsWriter, timeout_s: float,
                 answer: Callable) -> None:
        self.workers, self.index, self.stats, self.timeout_s = workers, index, stats, timeout_s
        self.answer = answer  # (received, num_hits, lease_id): the dispatcher's
        self._tokens = itertools.count(1)
        self.pending: dict[int, PendingLookup] = {}
        self._queried_at: dict[int, float] = {}  # queries out (answered or not), by token
        self._fetches: dict[int, tuple[list[Key], list[Entry]]] = {}
        self.is_degraded = False  # the store was slow or failing: warned once, until it answers again

    @property
    def num_inflight(self) -> int:
        return len(self._queried_at) + len(self._fetches)

    def next_deadline(self) -> float:
        return min((p.deadline for p in self.pending.values()), default=float("inf"))

    def start(self, received, keys: list[Key], num_hits: int, lease_id: int) -> bool:
        """Ask the store for the rest of ``keys`` past ``num_hits``; False (answer now) where
        the store is not asked: nothing left, the pool has the next key (being written), or
        the store stalls."""
        if num_hits >= len(keys) or keys[num_hits] in self.index.entries:
            return False
        now = time.monotonic()
        oldest = min(self._queried_at.values(), default=now)
        if now - oldest > self.timeout_s or len(self._queried_at) >= MAX_QUERIES_IN_FLIGHT:
            self.stats.add("remote_lookup_timeouts")
            self._degraded("does not answer within %.0f ms" % (self.timeout_s * 1e3))
            return False
        token = next(self._tokens)
        rest = keys[num_hits:num_hits + MAX_QUERY_BLOCKS]
        self.workers.submit(RemoteJob(Kind.QUERY, token, rest))
        self._queried_at[token] = now
        self.pending[token] = PendingLookup(received, rest, num_hits, lease_id, now + self.timeout_s)
        received.client.num_inflight += 1
        self.stats.add("remote_lookups")
        return True

    def expire(self, now: float) -> None:
        for token in [t for t, p in self.pending.items() if p.deadline <= now]:
            lookup = self.pending.pop(token)
            self.stats.add("remote_lookup_timeouts")
            self._degraded("answered no lookup within %.0f ms" % (self.timeout_s * 1e3))
            self._answer(lookup, lookup.num_hits, lookup.lease_id)

    def fail_all(self) -> None:
        """At a stop: every waiting LOOKUP answered with its local prefix."""
        for token in list(self.pending):
            lookup = self.pending.pop(token)
            self._answer(lookup, lookup.num_hits, lookup.lease_id)

    def on_query(self, done: RemoteDone) -> None:
        token = done.tokens[0]
        self._queried_at.pop(token, None)
        self.stats.add("remote_lookup_ns", done.elapsed_ns)
        if done.num_errors:
            self.stats.add("remote_errors", done.num_errors)
            self._degraded("failed %d of a lookup's %d existence checks" % (done.num_errors, len(done.results)))
        elif self.is_degraded:
            self.is_degraded = False
            logger.info("remote store answers again")
        lookup = self.pending.pop(token, None)
        if lookup is None:
            return  # answered at its deadline already
        run = _leading_run(lookup.keys, done.results, self.index.pool.slab_bytes)
        num_fetched, lease_id = 0, lookup.lease_id
        if run and lookup.client.is_attached:
            num_fetched, lease_id = self._fetch(lookup, run)
        self._answer(lookup, lookup.num_hits + num_fetched, lease_id)

    def _fetch(self, lookup: PendingLookup, run: list[tuple[Key, tuple[int, int]]]) -> tuple[int, int]:
        """Reserve, pin and start fetching ``run``; (how many started, the lease's id)."""
        (entry_bytes, num_layers), index = run[0][1], self.index
        keys = [key for key, _ in run]
        entries = index.reserve_many(keys, entry_bytes, num_layers, ORPHAN)
        started, seen = [], set()
        for entry in entries:
            if entry is None or entry.refs or entry.pending_mask or entry.done_mask or id(entry) in seen:
                break  # the pool is full of blocks in use (or the key came in meanwhile, or repeats)
            started.append(entry)
            seen.add(id(entry))
        for key, entry in zip(keys[len(started):], entries[len(started):]):
            is_fresh = entry is not None and not (entry.refs or entry.pending_mask or entry.done_mask)
            if is_fresh and id(entry) not in seen:
                index.abandon_layers(key, 0)  # reserved here, never fetched: dropped again
        if not started:
            return 0, lookup.lease_id
        keys = keys[:len(started)]
        for entry in started:
            entry.pending_mask, entry.is_promoting, entry.is_published = entry.all_layers_mask, True, True
            entry.refs += 1  # the lease's
        token = next(self._tokens)
        self.workers.submit(RemoteJob(Kind.FETCH, token, keys, [e.offset for e in started],
                                      [entry_bytes] * len(started)))
        self._fetches[token] = (keys, started)
        self.stats.add("lookup_remote_blocks", len(started))
        lease_id = index.extend_lease(lookup.lease_id, lookup.client.slot, lookup.client.instance, keys, started)
        return len(started), lease_id

    def on_fetch(self, done: RemoteDone) -> None:
        keys, entries = self._fetches.pop(done.tokens[0])
        num_ok = num_corrupt = 0
        for key, entry, status in zip(keys, entries, done.results):
            entry.is_promoting = False
            if status is FetchStatus.OK and not entry.is_doomed:
                self.index.mark_layers_done([key], entry.all_layers_mask)
                num_ok += 1
                continue
            num_corrupt += status is FetchStatus.CORRUPT
            entry.is_doomed = True  # never served: dropped when its lease or load lets go
            self.index.abandon_layers(key, entry.all_layers_mask)
        stats = self.stats
        stats.add("remote_blocks_fetched", num_ok)
        stats.add("remote_bytes_fetched", done.num_bytes)
        stats.add("remote_fetch_ns", done.elapsed_ns)
        stats.add("remote_checksum_failures", num_corrupt)
        stats.add("remote_fetch_failures", len(keys) - num_ok - num_corrupt)
        stats.add("remote_errors", done.num_errors)
        if num_corrupt:
            logger.warning("remote store: %d fetched blocks had a wrong length or checksum: not served",
                           num_corrupt)

    def _answer(self, lookup: PendingLookup, num_hits: int, lease_id: int) -> None:
        lookup.client.num_inflight -= 1
        self.answer(lookup.received, num_hits, lease_id)

    def _degraded(self, what: str) -> None:
        if not self.is_degraded:
            self.is_degraded = True
            logger.warning("remote store %s: lookups go on without it (counted in remote_lookup_timeouts "
                           "and remote_errors) until it answers again", what)


def _leading_run(keys: list[Key], held: list, slab_bytes: int) -> list[tuple[Key, tuple[int, int]]]:
    """The keys the store holds from the first on, within MAX_FETCH_BYTES and a pool entry's
    size: (key, (entry_bytes, num_layers)) each (all the first one's size: a block of
    another size fails its fetch, a miss)."""
    run, num_bytes = [], 0
    for key, meta in zip(keys, held):
        if meta is None or num_bytes + meta[0] > MAX_FETCH_BYTES or not 0 < meta[0] <= slab_bytes or meta[1] < 1:
            break
        run.append((key, meta))
        num_bytes += meta[0]
    return run
