"""The block index: ``(namespace, hash)`` -> pool entry, with refcounts and leases.

An entry is WRITING until every layer of it has been copied into the pool (and, where several
voters share its namespace, each has voted for it: ``votes.py``), and only then READY: lookups
and loads see READY entries only; one that never gets there is dropped by ``drop_stale_writes``.
``refs`` counts leases and in-flight copies; an entry with refs is never evicted.  Leases are
created by LOOKUP, pin the contiguous hit prefix, and end on RELEASE, on the LOAD that uses them,
when their client goes away, or at expiry.  A kept pool's entries beyond the pool's ready
(pinned) part wait outside the index until ``grow`` reaches them (``kept_entries.py``); the
records themselves are in ``entries.py``.
"""
from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..memory.pool import PagePool
from ..memory.pool_table import NoTable, PoolTable
from .entries import ORPHAN, Entry, IndexCounters, Key, Lease, is_unused
from .eviction import LruPolicy
from .kept_entries import KeptEntries
from .writes import Writes


@dataclass(slots=True)
class BlockIndex:
    pool: PagePool
    lease_ttl_s: float
    table: PoolTable | NoTable = field(default_factory=NoTable)  # --keep-pool's record, in step with the entries
    entries: dict[Key, Entry] = field(default_factory=dict)
    leases: dict[int, Lease] = field(default_factory=dict)
    policy: LruPolicy = field(default_factory=LruPolicy)
    counters: IndexCounters = field(default_factory=IndexCounters)
    writing: dict[Key, Entry] = field(default_factory=dict)  # entries not READY yet
    kept: KeptEntries = field(init=False)  # a kept pool's entries taken in (``kept_entries.py``)
    writes: Writes = field(init=False)  # its entries being written (``writes.py``)
    # The disk tier's: the run of keys it holds at the head of the given ones, reserved and
    # being read; their entries, pinned, not READY yet (``connect_tier``).
    promote: Callable[[list[Key], int], list[Entry]] | None = None
    on_ready: list[Callable[[list[Key]], None]] = field(default_factory=list, init=False)  # told what became READY

    def __post_init__(self) -> None:
        self.kept = KeptEntries(self.entries, self.table, self.pool, self.policy)
        self.writes = Writes(self.entries, self.writing, self.policy, self.table, self.drop_entry, self.on_ready)

    def connect_tier(self, promote: Callable[[list[Key], int], list[Entry]] | None = None,
                     on_ready: Callable[[list[Key]], None] | None = None) -> None:
        """A tier over this index: ``promote`` (the disk tier's) asked for the keys after a
        lookup's hits, ``on_ready`` told the keys that became READY (after earlier tiers')."""
        if promote is not None:
            self.promote = promote
        if on_ready is not None:
            self.on_ready.append(on_ready)

    def get_ready(self, key: Key) -> Entry | None:
        entry = self.entries.get(key)
        return entry if entry is not None and entry.is_ready else None

    def lookup(self, slot: int, keys: list[Key], owner: int = 0) -> tuple[int, int]:
        """Pin the READY prefix of ``keys`` under a new lease of ``owner`` (a vLLM instance;
        0: any client's): (num hits, lease id or 0).  With a disk tier the prefix goes on
        through blocks being read from disk, and through those the disk holds (their reads
        start now); the lease's ``num_disk`` counts them."""
        get, hits, entry = self.entries.get, [], None
        for key in keys:
            entry = get(key)
            if entry is None or not (entry.is_ready or entry.is_promoting and not entry.is_doomed):
                break
            hits.append(entry)
        for hit in hits:
            hit.refs += 1
        num_disk = 0
        if self.promote is not None:  # a disk tier: its admission counts hits, and its reads
            for hit in hits:
                hit.num_hits += 1
            num_disk = sum(hit.is_promoting for hit in hits)
            if entry is None and len(hits) < len(keys):
                fetched = self.promote(keys[len(hits):], slot)  # pinned already
                hits += fetched
                num_disk += len(fetched)
        if not hits:
            return 0, 0
        hit_keys = keys[:len(hits)]
        self.touch_chain(hit_keys, hits)
        lease_id = self._new_lease_id()
        self.leases[lease_id] = Lease(lease_id, slot, hit_keys, time.monotonic() + self.lease_ttl_s,
                                      hits, owner, num_disk)
        return len(hits), lease_id

    def extend_lease(self, lease_id: int, slot: int, owner: int, keys: list[Key], entries: list[Entry]) -> int:
        """Lease ``lease_id`` (0: a new one of ``owner``) goes on over ``keys``, whose
        ``entries`` the caller pinned and is filling from a lower tier (counted in its
        ``num_disk``: a LOAD of it waits); returns the lease's id."""
        lease = self.leases.get(lease_id)
        if lease is None:
            lease_id = self._new_lease_id()
            lease = self.leases[lease_id] = Lease(lease_id, slot, [], time.monotonic() + self.lease_ttl_s,
                                                  [], owner)
        lease.keys += keys
        lease.entries += entries
        lease.num_disk += len(entries)
        self.touch_chain(lease.keys, lease.entries)
        return lease_id

    def is_promoting(self, lease_id: int) -> bool:
        """Whether a block of lease ``lease_id`` is still being read from disk."""
        lease = self.leases.get(lease_id)
        return lease is not None and lease.num_disk > 0 and any(e.is_promoting for e in lease.entries)

    def _new_lease_id(self) -> int:
        """A random 63-bit id: a capability the scheduler hands its workers with the load
        plan.  A client cannot guess another's lease (consecutive ids let one release
        another's), and an id kept across an engine restart names no lease here."""
        while True:
            lease_id = secrets.randbits(63)
            if lease_id and lease_id not in self.leases:
                return lease_id

    def is_foreign_lease(self, lease_id: int, instance: int) -> bool:
        """Whether lease ``lease_id`` is another vLLM instance's than ``instance``: not the
        caller's to use or end (an unknown id is not foreign: it is answered as unknown)."""
        lease = self.leases.get(lease_id)
        return lease is not None and lease.owner != 0 and lease.owner != instance

    def take_lease(self, lease_id: int, keys: list[Key], entry_bytes: int) -> np.ndarray | None:
        """The pool offsets of ``keys`` from lease ``lease_id`` if they are a run of its keys,
        all still READY and of ``entry_bytes`` (else None, and the lease stays): the lease
        ends and its pins on ``keys`` pass to the caller (``unpin(keys)`` when done), its
        other keys are unpinned.  A LOAD of what a LOOKUP just leased skips finding and
        pinning every block again."""
        lease = self.leases.get(lease_id)
        if lease is None or not keys:
            return None
        start = _position(lease.keys, keys[0])
        end = start + len(keys)
        if start < 0 or lease.keys[start:end] != keys:
            return None
        taken = lease.entries[start:end]
        if any(entry.entry_bytes != entry_bytes or not entry.is_ready for entry in taken):
            return None  # another geometry, or dropped since (DROP dooms a leased entry)
        del self.leases[lease_id]
        self.unpin(lease.keys[:start])
        self.unpin(lease.keys[end:])
        return np.fromiter((entry.offset for entry in taken), np.int64, len(taken))

    def touch_chain(self, keys: list[Key], entries: list[Entry] | None = None) -> None:
        """``keys`` (a prefix chain, head first) were just used: the head becomes the most
        recently used, so eviction takes a chain from its tail (a lookup stops at the
        first miss: a chain without its head is lost whole).  ``entries``: theirs, where
        the caller has them already."""
        self.policy.touch_all(reversed(keys))
        if not self.table.is_kept:
            return  # (finding the entries costs more than the calls it would feed)
        if entries is None:
            entries = [e for e in map(self.entries.get, keys) if e is not None]
        # the same order in the table, for a kept pool's next engine
        self.table.touched([e.offset for e in reversed(entries)],
                           [e.entry_bytes for e in reversed(entries)])

    def release(self, lease_id: int) -> bool:
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return False
        self.unpin(lease.keys)
        return True

    def pin(self, keys: list[Key]) -> None:
        for key in keys:
            self.entries[key].refs += 1

    def unpin(self, keys: list[Key]) -> None:
        for key in keys:
            entry = self.entries[key]
            entry.refs -= 1
            assert entry.refs >= 0, f"refcount of {key!r} went negative"
            if entry.is_doomed and is_unused(entry):
                self.drop_entry(key)

    def drop(self, keys: list[Key], writer: int, since_command: int) -> int:
        """Forget those of ``keys`` that client ``writer`` stored with SAVEs from request
        ``since_command`` on (it found them computed from bad data; blocks it only
        deduplicated are someone else's and stay): each is dropped now, or, while a lease,
        a load or a copy still uses it, never served again and dropped when that ends.
        Returns how many."""
        entries, num_found = self.entries, 0
        for key in keys:
            entry = entries.get(key)
            if entry is None or entry.is_doomed or entry.writer != (0, 0) and (
                    entry.writer[0] != writer or entry.writer[1] < since_command):
                continue  # (0, 0): its writer is not known (read back from disk): dropped too
            num_found += 1
            if is_unused(entry):
                self.drop_entry(key)
            else:
                entry.is_doomed = True
                self.table.free(entry.offset, entry.entry_bytes)  # a kept pool's next engine must not take it in
        return num_found

    def drop_namespace(self, namespace: int) -> tuple[int, int]:
        """Forget every block of ``namespace`` (a RESET), as ``drop`` forgets one: each unused
        entry now; one a lease, a load or a copy still uses (a SAVE writing it, a disk read
        or write) is never served again and dropped when that ends.  A kept pool's entries
        not taken in yet go too.  Returns (how many, how many of them were held so)."""
        entries, num_dropped, num_held = self.entries, 0, 0
        for key in [k for k, e in entries.items() if k[0] == namespace and not e.is_doomed]:
            entry = entries[key]
            num_dropped += 1
            if is_unused(entry):
                self.drop_entry(key)
            else:
                entry.is_doomed = True
                num_held += 1
                self.table.free(entry.offset, entry.entry_bytes)  # a kept pool's next engine must not take it in
        return num_dropped + self.kept.drop_namespace(namespace), num_held

    def expire_leases(self, now: float) -> int:
        expired = [lease_id for lease_id, lease in self.leases.items() if lease.expires_at <= now]
        for lease_id in expired:
            self.release(lease_id)
        self.counters.lease_expiries += len(expired)
        return len(expired)

    def release_slot(self, slot: int) -> None:
        """A client went away: end its leases and drop the blocks it left half-written."""
        for lease_id in [i for i, lease in self.leases.items() if lease.slot == slot]:
            self.release(lease_id)
        for key in [k for k, e in self.writing.items() if e.owner_slot == slot]:
            entry = self.entries[key]
            if entry.pending_mask == 0:
                self.drop_entry(key)
            else:
                entry.owner_slot = ORPHAN  # dropped when its copy lands

    def reserve(self, key: Key, entry_bytes: int, num_layers: int, slot: int) -> Entry | None:
        """The entry for ``key``, allocating (and evicting) if absent; None if the pool is full."""
        return self.reserve_many([key], entry_bytes, num_layers, slot)[0]

    def reserve_many(self, keys: list[Key], entry_bytes: int, num_layers: int,
                     slot: int, writer: tuple[int, int] = (0, 0)) -> list[Entry | None]:
        """``reserve`` for many keys at once (the SAVE hot path): one entry per key, None
        where the pool is full or the stored entry has another size."""
        entries = self.entries
        found = [entries.get(key) for key in keys]
        missing = list(dict.fromkeys(k for k, e in zip(keys, found) if e is None))
        if missing:
            offsets = self.pool.alloc_many(entry_bytes, len(missing))
            while len(offsets) < len(missing) and self._evict_one():
                offsets += self.pool.alloc_many(entry_bytes, len(missing) - len(offsets))
            now, mask = time.monotonic(), (1 << num_layers) - 1
            for key, offset in zip(missing, offsets):
                entries[key] = self.writing[key] = Entry(offset, entry_bytes, mask, slot, now,
                                                         writer=writer)
            self.table.writing(offsets, entry_bytes, missing[:len(offsets)], num_layers)
            found = [entries.get(key) for key in keys]
        return [e if e is not None and e.entry_bytes == entry_bytes else None for e in found]

    def adopt_table(self) -> int:
        """Take in the entries a kept pool table lists (``KeptEntries.adopt_table``)."""
        return self.kept.adopt_table()

    def grow(self, ready_bytes: int) -> int:
        """The pool's first ``ready_bytes`` are pinned (``KeptEntries.grow``)."""
        return self.kept.grow(ready_bytes)

    def _evict_one(self) -> bool:
        victim = self.policy.pick(lambda key: self.entries[key].refs == 0)
        if victim is None:
            return False
        self.drop_entry(victim)
        self.counters.evictions += 1
        return True

    def drop_entry(self, key: Key) -> None:
        """Forget ``key``: its entry, its place in the pool and in the pool table."""
        entry = self.entries.pop(key)
        self.writing.pop(key, None)
        self.policy.remove(key)
        self.table.free(entry.offset, entry.entry_bytes)
        self.pool.free(entry.offset)

    def drop_stale_writes(self, older_than: float) -> int:
        """Drop entries still incomplete (nothing in flight) that started before ``older_than``:
        a client saved some layers of a block and never the rest."""
        stale = [k for k, e in self.writing.items() if is_unused(e) and e.started_at < older_than]
        for key in stale:
            self.drop_entry(key)
        return len(stale)

    def mark_layers_done(self, keys: list[Key], mask: int) -> int:
        """Those layers of ``keys`` are in the pool; returns how many entries became READY."""
        return self.writes.mark_layers_done(keys, mask)

    def mark_voted(self, keys: list[Key]) -> int:
        """A vote came for ``keys`` (``Writes.mark_voted``); returns how many became READY."""
        return self.writes.mark_voted(keys)

    def abandon_layers(self, key: Key, mask: int) -> None:
        """A save's copy failed: forget those layers (``Writes.abandon_layers``)."""
        self.writes.abandon_layers(key, mask)


def _position(keys: list[Key], key: Key) -> int:
    """Where ``key`` first appears in ``keys``, or -1."""
    try:
        return keys.index(key)
    except ValueError:
        return -1
