"""The disk tier's policy: which pool blocks go to disk, and disk blocks back into the pool.

Mechanism is ``store.py`` (files, checksums, I/O threads); this decides, on the engine's
one thread, and keeps the index in step::

    spill()             while the pool is within its spill window of full, the coldest
                        READY blocks not on disk yet (under ``reused``: only those a lookup
                        hit) are written from their pool pages, each pinned meanwhile, so
                        that eviction mostly drops blocks the disk holds
    promote(keys, slot) a lookup's prefix goes on where the disk holds it: a pool entry is
                        reserved for each block of that run and its read started; the
                        entries come back pinned (the lease's) and ``is_promoting``
    poll()              finished I/O: a block read back and checked becomes READY (a LOAD
                        waiting on it goes on), one that fails is doomed (its LOAD answers
                        MISSING_BLOCK: vLLM recomputes it); a written block is on disk
    forget(keys)        a DROP: the disk's copies go too
    forget_namespace(n) a RESET: every file of the namespace goes

A block is on disk, in the pool, or both; the two tiers evict by their own LRU.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import time

import numpy as np

from ..blocks.entries import ORPHAN, Entry, Key
from ..blocks.index import BlockIndex
from ..stats import StatsWriter
from .store import DiskStore

logger = logging.getLogger(__name__)

MAX_WRITES_IN_FLIGHT = 64
# One lookup's reads at most (the rest of its prefix is a miss): its LOAD waits for all of
# them, and the connector gives an asynchronous load 5 s (command_timeout_ms) before it
# gives up on the engine; 2 GiB is read well within that (docs/benchmarks.md, "Figures
# behind the engine's constants").
MAX_PROMOTE_BYTES = 2 << 30
WRITE_ERROR_PAUSE_S = 1.0  # after a failed write (a full disk, say) no spill for this long
_WRITE_ENDED, _PAUSED = -1, -2  # what ``_scanned_at`` holds when no pass has looked since
SPILL_INTERVAL_S = 10e-3  # a pass looks at up to SPILL_SCAN_BLOCKS entries: at most
#                           this often, and 64 writes in flight keep a drive busy meanwhile
# Spilled: the coldest blocks, up to 1/8 of the pool (at least SPILL_WINDOW_MIN) and at most
# SPILL_SCAN_BLOCKS looked at per pass (a pass runs only after the LRU order or the writes
# changed): eviction takes the coldest, so those are the ones the disk must hold first.
SPILL_WINDOW_SHARE = 8
SPILL_WINDOW_MIN = 64 << 20
SPILL_SCAN_BLOCKS = 256


class DiskTier:
    def __init__(self, store: DiskStore, index: BlockIndex, pool: np.ndarray, stats: StatsWriter,
                 admission: str = "evicted", locks: list[int] | None = None):
        self.store = store
        self.index = index
        self.pool = pool  # the pool segment's bytes (uint8), entries at their offsets
        self.stats = stats
        self.is_reused_only = admission == "reused"
        self._fresh: collections.deque[Key] | None = None  # under ``all``: READY, not yet written
        if admission == "all":
            self._fresh = collections.deque()
        self.locks = locks or []  # the paths' lock fds (``open.lock_path``), held until closed
        self._tokens = itertools.count(1)
        self._writes: dict[int, tuple[Key, Entry]] = {}
        self._reads: dict[int, tuple[Key, Entry]] = {}
        self._scanned_at = _WRITE_ENDED  # the LRU order's change count at the last spill pass
        self._num_refused = 0
        self._next_spill = 0.0  # the next spill pass, not before (later after a failed write)
        index.connect_tier(promote=self.promote, on_ready=self._fresh.extend if self._fresh is not None else None)
        stats.set("disk_bytes_capacity", store.bytes_total)

    @property
    def num_inflight(self) -> int:
        return len(self._writes) + len(self._reads)

    def _page(self, entry: Entry) -> np.ndarray:
        return self.pool[entry.offset:entry.offset + entry.entry_bytes]

    def spill(self) -> int:
        """Start writes of the coldest blocks the disk lacks (under ``all``: of every block
        stored since); returns how many."""
        if self._fresh is not None:
            return self._write_fresh()
        pool, index = self.index.pool, self.index
        window = max(pool.bytes_ready // SPILL_WINDOW_SHARE, SPILL_WINDOW_MIN)
        now = time.monotonic()
        if len(self._writes) >= MAX_WRITES_IN_FLIGHT or pool.bytes_used + window < pool.bytes_ready \
                or index.policy.num_changes == self._scanned_at \
                or now < self._next_spill and self._scanned_at != _WRITE_ENDED:
            return 0
        self._scanned_at, self._next_spill = index.policy.num_changes, now + SPILL_INTERVAL_S
        num_started, seen_bytes, store = 0, 0, self.store
        for num_seen, key in enumerate(index.policy.oldest()):
            entry = index.entries[key]
            seen_bytes += entry.entry_bytes
            if seen_bytes > window or num_seen >= SPILL_SCAN_BLOCKS or len(self._writes) >= MAX_WRITES_IN_FLIGHT:
                break  # (a write that ends makes the next pass look again)
            if entry.refs or entry.is_doomed or store.contains(key) or \
                    self.is_reused_only and entry.num_hits == 0:
                continue
            num_started += self._start_write(key, entry)
        self._note_refused()
        return num_started

    def _write_fresh(self) -> int:
        fresh, entries, store, num_started = self._fresh, self.index.entries, self.store, 0
        if time.monotonic() < self._next_spill:
            return 0
        while fresh and len(self._writes) < MAX_WRITES_IN_FLIGHT:
            key = fresh.popleft()
            entry = entries.get(key)
            if entry is None or not entry.is_ready or store.contains(key):
                continue  # evicted or dropped since, or read back from disk
            num_started += self._start_write(key, entry)
        self._note_refused()
        return num_started

    def _start_write(self, key: Key, entry: Entry) -> bool:
        """Queue ``entry``'s write, pinned until it ends (a READY entry's pages never change:
        the pin only keeps eviction off them); False if the store refused it."""
        token = next(self._tokens)
        if not self.store.try_write(key, self._page(entry), token, entry.all_layers_mask.bit_length()):
            return False  # being written, or no room (counted by the store)
        entry.refs += 1
        self._writes[token] = (key, entry)
        return True

    def _note_refused(self) -> None:
        """Refused writes have no I/O result to bring the stats up to date: do it here."""
        if self.store.counters.writes_refused != self._num_refused:
            self._num_refused = self.store.counters.writes_refused
            self.update_stats()

    def promote(self, keys: list[Key], slot: int) -> list[Entry]:
        """Pool entries for the run of ``keys`` the disk holds, their reads started."""
        store, run, num_bytes = self.store, [], 0
        for key in keys:
            meta = store.block_meta(key)
            if meta is None or num_bytes + meta[0] > MAX_PROMOTE_BYTES:
                break
            if not 0 < meta[0] <= self.index.pool.slab_bytes or meta[1] < 1:
                logger.warning("disk block of %d bytes, %d layers cannot be a pool entry: removed",
                               *meta)
                store.remove(key)
                break
            run.append((key, meta))
            num_bytes += meta[0]
        fetched = []
        for meta, keys_of_size in _runs_of_one_size(run):  # (one reserve for each)
            entries = self.index.reserve_many(keys_of_size, *meta, ORPHAN)
            started = self._start_reads(keys_of_size, entries)
            fetched += started
            if len(started) < len(keys_of_size):
                break
        if fetched:
            self.stats.add("lookup_disk_blocks", len(fetched))
        return fetched

    def _start_reads(self, keys: list[Key], entries: list[Entry | None]) -> list[Entry]:
        """Reads into the entries just reserved for ``keys``, up to the first that cannot
        start; the entries after it are given back (pinned only those started)."""
        started, index = [], self.index
        for key, entry in zip(keys, entries):
            if entry is None or entry.refs or entry.pending_mask or entry.done_mask:
                break  # the pool is full of blocks in use (or the key came in meanwhile)
            token = next(self._tokens)
            if not self.store.try_read(key, self._page(entry), token):
                break
            entry.pending_mask, entry.is_promoting = entry.all_layers_mask, True
            entry.refs += 1  # the lease's
            self._reads[token] = (key, entry)
            started.append(entry)
        for key, entry in zip(keys[len(started):], entries[len(started):]):
            if entry is not None and not (entry.refs or entry.pending_mask or entry.done_mask):
                index.abandon_layers(key, 0)  # reserved here, never read: dropped again
        return started

    def poll(self) -> bool:
        """Take in finished reads and writes; True if any finished."""
        finished = self.store.poll()
        for done in finished:
            if done.is_read:
                self._read_done(done)
            else:
                self._write_done(done)
        if finished:
            self.update_stats()
        return bool(finished)

    def _write_done(self, done) -> None:
        key, entry = self._writes.pop(done.token)
        if done.error is not None:  # a full or failing disk: do not rewrite the same blocks at once
            self._next_spill, self._scanned_at = time.monotonic() + WRITE_ERROR_PAUSE_S, _PAUSED
        elif self._scanned_at != _PAUSED:
            self._scanned_at = _WRITE_ENDED  # room for the next write: look again now
        if entry.is_doomed:  # a DROP came while it was written: the disk must not keep it
            self.store.remove(key)
        self.index.unpin([key])  # (pinned, it never left the index)

    def _read_done(self, done) -> None:
        key, entry = self._reads.pop(done.token)
        entry.is_promoting = False
        if done.error is None and not entry.is_doomed:
            self.index.mark_layers_done([key], entry.all_layers_mask)
            return
        entry.is_doomed = True  # never served: dropped when its lease or load lets go
        self.index.abandon_layers(key, entry.all_layers_mask)

    def forget(self, keys: list[Key]) -> int:
        """Remove the disk's copies of ``keys`` (blocks found bad); returns how many."""
        return sum(self.store.remove(key) for key in keys)

    def forget_namespace(self, namespace: int) -> int:
        """Remove the disk's copies of every block of ``namespace`` (a RESET); returns how many."""
        return self.forget(self.store.keys_of(namespace))

    def update_stats(self) -> None:
        store, c, stats = self.store, self.store.counters, self.stats
        for name, value in (("disk_bytes_used", store.bytes_used), ("disk_blocks_used", store.num_blocks),
                            ("disk_blocks_written", c.blocks_written), ("disk_bytes_written", c.bytes_written),
                            ("disk_write_ns", c.write_ns), ("disk_blocks_read", c.blocks_read),
                            ("disk_bytes_read", c.bytes_read), ("disk_read_ns", c.read_ns),
                            ("disk_checksum_failures", c.checksum_failures), ("disk_io_errors", c.io_errors),
                            ("disk_writes_refused", c.writes_refused), ("disk_evictions", c.evictions)):
            stats.set(name, value)

    def close(self) -> bool:
        """Stop the I/O (queued jobs are dropped); False if a thread may still touch the pool
        (the paths stay locked then, until the process exits)."""
        is_stopped = self.store.close(drop_queued=True)
        if is_stopped:
            for fd in self.locks:
                os.close(fd)
            self.locks = []
        return is_stopped


def _runs_of_one_size(run: list[tuple[Key, tuple[int, int]]]):
    """``(key, (entry_bytes, num_layers))`` pairs cut where the size changes:
    ``((entry_bytes, num_layers), [keys])`` each, in order."""
    start = 0
    for i in range(1, len(run) + 1):
        if i == len(run) or run[i][1] != run[start][1]:
            yield run[start][1], [key for key, _ in run[start:i]]
            start = i
