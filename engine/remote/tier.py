"""The remote tier's policy, on the engine's one thread (mechanism: ``store.py`` and the
threads of ``workers.py``; lookups through the store: ``store_lookups.py``)::

    on_ready(keys)      (``all``) blocks that just became READY in the pool, every layer in,
                        are queued for publishing; a block fetched from the store is not
    note_hits(lease)    (``reused``) a lookup hit these blocks: used twice, they are queued
    publish()           the queued blocks go to the publish thread, each pinned until its
                        put ends (the put reads its pool pages in place), while it has room
                        and they pin at most 1/8 of the pool; past a bounded backlog the
                        oldest are dropped, counted
    try_lookup(...)     a LOOKUP whose local prefix ends short asks the store (``store_lookups.py``)
    poll(now)           finished store calls taken in; LOOKUPs past their deadline answered
    forget(keys)        a DROP: the store's copies go too

Nothing here blocks: a SAVE's answer and a LOOKUP's local part never wait for the store.
"""

from __future__ import annotations

import collections
import itertools
import logging
from collections.abc import Callable

from ..blocks.entries import Entry, Key
from ..blocks.index import BlockIndex
from ..stats import StatsWriter
from .store_lookups import RemoteLookups
from .workers import Kind, RemoteJob, RemoteWorkers

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 2.0
PUT_PINNED_SHARE = 8  # blocks waiting to be put pin at most 1/8 of the pool (eviction needs the rest)
MAX_FRESH_BLOCKS = 1 << 16  # READY blocks waiting their turn to be published; past it the oldest are dropped


class RemoteTier:
    def __init__(self, store, workers: RemoteWorkers, index: BlockIndex, stats: StatsWriter, answer: Callable,
                 publish: str = "all", timeout_s: float = 0.04) -> None:
        self.store, self.workers, self.index, self.stats = store, workers, index, stats
        self.is_reused_only = publish == "reused"
        self.lookups = RemoteLookups(workers, index, stats, timeout_s, answer)
        self._fresh: collections.deque[Key] = collections.deque()
        self._puts: dict[int, tuple[Key, Entry]] = {}
        self._put_bytes = 0  # of the blocks in ``_puts``, pinned
        self._tokens = itertools.count(1)
        self._num_dropped_logged = 0
        if not self.is_reused_only:
            index.connect_tier(on_ready=self.on_ready)  # (after the disk tier's, if any)
        stats.set("remote_enabled", 1)

    @property
    def num_inflight(self) -> int:
        return len(self._puts) + self.lookups.num_inflight

    def has_work(self) -> bool:
        return bool(self.lookups.pending) or self.workers.has_results()

    def on_ready(self, keys: list[Key]) -> None:
        self._fresh.extend(keys)

    def note_hits(self, entries: list[Entry], keys: list[Key]) -> None:
        if self.is_reused_only:
            self._fresh.extend(key for key, entry in zip(keys, entries) if not entry.is_published)

    def publish(self) -> int:
        """Hand queued READY blocks to the publish thread while it has room (and they pin at
        most 1/8 of the pool); the rest wait for the next call, past MAX_FRESH_BLOCKS the
        oldest are dropped, counted.  Returns how many were handed over."""
        fresh, entries, num_started = self._fresh, self.index.entries, 0
        room_bytes = self.index.pool.bytes_total // PUT_PINNED_SHARE - self._put_bytes
        while fresh:
            key = fresh.popleft()
            entry = entries.get(key)
            if entry is None or not entry.is_ready or entry.is_published:
                continue  # evicted or dropped since, fetched from the store, or published
            job = RemoteJob(Kind.PUT, next(self._tokens), [key], [entry.offset], [entry.entry_bytes],
                            num_layers=entry.all_layers_mask.bit_length())
            if entry.entry_bytes > room_bytes or not self.workers.try_publish(job):
                fresh.appendleft(key)  # the thread is behind: later
                break
            entry.refs += 1  # its pages stay while the put reads them
            entry.is_published = True
            self._puts[job.token] = (key, entry)
            self._put_bytes += entry.entry_bytes
            room_bytes -= entry.entry_bytes
            num_started += 1
        if len(fresh) > MAX_FRESH_BLOCKS:
            self._drop_fresh(len(fresh) - MAX_FRESH_BLOCKS)
        return num_started

    def _drop_fresh(self, num_dropped: int) -> None:
        for _ in range(num_dropped):
            self._fresh.popleft()
        self.stats.add("remote_puts_dropped", num_dropped)
        if not self._num_dropped_logged:
            logger.warning("remote store: publishing falls behind, %d blocks not published (counted in "
                           "remote_puts_dropped; logged once)", num_dropped)
        self._num_dropped_logged += num_dropped

    def try_lookup(self, received, keys: list[Key], num_hits: int, lease_id: int) -> bool:
        return self.lookups.start(received, keys, num_hits, lease_id)

    def poll(self, now: float) -> bool:
        """Take in finished store calls and answer LOOKUPs past their deadline; True if
        anything was (a LOAD parked on a fetch may go on)."""
        num_taken = 0
        for done in self.workers.take_results():
            num_taken += 1
            if done.kind is Kind.QUERY:
                self.lookups.on_query(done)
            elif done.kind is Kind.FETCH:
                self.lookups.on_fetch(done)
            else:
                self._put_done(done)
        if self.lookups.pending and now >= self.lookups.next_deadline():
            self.lookups.expire(now)
            num_taken += 1
        return num_taken > 0

    def _put_done(self, done) -> None:
        stats, num_ok, removed = self.stats, 0, []
        for token, is_ok in zip(done.tokens, done.results):
            key, entry = self._puts.pop(token)
            self._put_bytes -= entry.entry_bytes
            num_ok += is_ok
            if entry.is_doomed and is_ok:
                removed.append(key)  # a DROP came while it was put: the store must not keep it
            entry.is_published = is_ok
            self.index.unpin([key])
        stats.add("remote_blocks_put", num_ok)
        stats.add("remote_bytes_put", done.num_bytes)
        stats.add("remote_put_ns", done.elapsed_ns)
        stats.add("remote_put_failures", len(done.tokens) - num_ok)
        if removed:
            self.forget(removed)

    def forget(self, keys: list[Key]) -> None:
        """A DROP's keys: their objects leave the store (best effort: the queue may be full)."""
        if not self.workers.try_publish(RemoteJob(Kind.REMOVE, 0, list(keys))):
            logger.warning("remote store: %d dropped blocks could not be queued for removal", len(keys))

    def close(self) -> bool:
        """Answer waiting LOOKUPs, stop the threads, close the store; False if a thread is
        still in a store call (it uses the pool's pages: the pool stays mapped till exit)."""
        self.lookups.fail_all()
        is_stopped = self.workers.close(CLOSE_TIMEOUT_S)
        if is_stopped:
            self.store.close()
        return is_stopped
