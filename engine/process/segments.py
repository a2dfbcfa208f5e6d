"""Everything the engine creates in shared memory, created once and unlinked once.

Start-up first holds the engine's name (``name_lock``: a running engine holds it, so
another start is refused there), then creates the control segment exclusively.  One
found under the name can only be a dead engine's (a crash left it behind): its segments
are removed first, and so are the in-place KV caches of its CPU workers that are gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time

import numpy as np
import posix_ipc

from pegaflow.platform import in_place_segments, shm
from pegaflow.platform.errors import EngineNotRunningError, ForeignSegmentError
from pegaflow.platform.locks import ControlLock, lock_path, remove_lock_dir_if_empty
from pegaflow.platform.ring import RingSegmentView, reset_slots, ring_segment_bytes
from pegaflow.platform.wire import (
    CLIENT_STATS,
    CONTROL_HEADER,
    FINGERPRINT,
    MAGIC,
    SLOT,
    STATS,
    WIRE_VERSION,
    SlotState,
)

from ..config import MAX_SLOTS, EngineConfig
from ..memory.host_capacity import check_room
from ..memory.pool_table import PoolTable, table_bytes
from .name_lock import claim_name, name_lock_path, release_name

logger = logging.getLogger(__name__)


KEPT = ("pool", "pool.table")  # what --keep-pool leaves for the next engine


def _what_names(num_slots: int, keep_pool: bool = False) -> tuple[list[str], list[str]]:
    segments = ["control", "stats"] + ([] if keep_pool else list(KEPT)) + \
        [f"ring.{i}" for i in range(num_slots)]
    semaphores = ["doorbell"] + [f"cq.{i}" for i in range(num_slots)]
    return segments, semaphores


def recorded_header(control_name: str):
    """The header of an engine's control segment (None: none there, empty, not a control
    segment, or another user's: never read, a warning logged)."""
    try:
        old = shm.attach_segment(control_name, readonly=True)
    except ForeignSegmentError as exc:
        logger.warning("%s", exc)
        return None
    except EngineNotRunningError:  # none, or empty: its creator died before sizing it
        return None
    try:
        header = old.array(CONTROL_HEADER, 1)[0].copy()
    finally:
        old.close()
    return header if int(header["magic"]) == MAGIC else None


def _create_replacing(name: str, create, unlink):
    """``create()`` a segment or semaphore under ``name``; one found there (we hold the name:
    a leftover, or planted by another user) is removed first, with one line.  Another
    user's that we may not remove, or one planted again at once: ForeignSegmentError."""
    try:
        return create()
    except posix_ipc.ExistentialError:
        logger.warning("removing %s, which was there before this engine made it", name)
    unlink(name)
    try:
        return create()
    except posix_ipc.ExistentialError:
        raise ForeignSegmentError(f"{name} was made again as soon as this engine removed it: "
                                  f"another process plants it; find and stop it") from None


def _remove_dead_in_place(name: str) -> None:
    """The KV caches that CPU workers of this engine's name, killed since, left in /dev/shm."""
    removed = in_place_segments.remove_orphans(name)
    if removed:
        logger.warning("removed %d KV cache segment(s) (%.1f MiB) that CPU workers of an engine "
                       "named %r left when they were killed (pids %s)", len(removed),
                       sum(s.num_bytes for s in removed) / 2**20, name,
                       ", ".join(str(s.pid) for s in removed))


class EngineSegments:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.epoch = secrets.randbits(63) or 1
        self._segments: list[shm.Segment] = []
        self._semaphores: list[str] = []
        self.pool: shm.Segment | None = None
        self.is_pool_kept = False  # the pool and its table are an earlier engine's, kept
        self.pool_table: shm.Segment | None = None  # with --keep-pool only
        self.has_started = False   # the pool opened (``mark_started``): only then is a new pool kept
        self.is_unlinking = False  # ``unlink_all`` has begun
        self._name_lock = claim_name(config.name)
        try:  # a failed start leaves nothing behind, its lock files neither
            _remove_dead_in_place(config.name)
            self.control = self._create_control()
            self._create_rest()
        except BaseException:
            self.unlink_all()
            raise

    def _create_control(self) -> shm.Segment:
        size = CONTROL_HEADER.itemsize + self.config.num_slots * SLOT.itemsize
        name = shm.ipc_name(self.config.name, "control")
        try:
            segment = shm.create_segment(name, size)
        except posix_ipc.ExistentialError:
            self._remove_stale(name)
            segment = shm.create_segment(name, size)
        self._segments.append(segment)
        return segment

    def _remove_stale(self, control_name: str) -> None:
        """We hold the name's lock, so whatever carries the name was left by a dead engine
        (or planted by another user: never read, removed all the same).  The pid it
        recorded is only named: another process may have it by now."""
        header = recorded_header(control_name)
        pid = 0 if header is None else int(header["engine_pid"])
        logger.warning("removing segments left by a dead engine named %r (pid %d)",
                       self.config.name, pid)
        # every name the dead engine may have created (it may have had more slots than we do)
        old_slots = 0 if header is None else min(int(header["num_slots"]), MAX_SLOTS)
        segments, semaphores = _what_names(max(old_slots, self.config.num_slots),
                                           self.config.keep_pool)
        for what in segments:
            shm.unlink_segment(shm.ipc_name(self.config.name, what))
        for what in semaphores:
            shm.unlink_semaphore(shm.ipc_name(self.config.name, what))

    def _create_rest(self) -> None:
        cfg = self.config
        ring_bytes = ring_segment_bytes(cfg.ring_slots, cfg.arena_bytes)
        # The pool's slot table is for a pool kept for the next engine (--keep-pool) only.
        table_size = table_bytes(cfg.usable_pool_bytes, cfg.slab_bytes) if cfg.keep_pool else 0
        kept = self._kept_pool(cfg.usable_pool_bytes, table_size)
        if kept:
            self.pool, self.pool_table = kept
            self._segments += kept
            self.is_pool_kept = True
        # A kept pool's memory is in use already: neither /dev/shm nor the host must hold it again.
        stats_bytes = STATS.itemsize + cfg.num_slots * CLIENT_STATS.itemsize
        check_room((0 if kept else cfg.usable_pool_bytes + table_size) + stats_bytes
                   + cfg.num_slots * ring_bytes, 0 if kept else cfg.usable_pool_bytes)
        self.stats = self._segment("stats", stats_bytes)
        if not kept:
            self.pool = self._segment("pool", cfg.usable_pool_bytes)
            self.pool_table = self._segment("pool.table", table_size) if table_size else None
        self.rings = [RingSegmentView(self._segment(f"ring.{i}", ring_bytes), cfg.ring_slots,
                                      cfg.arena_bytes) for i in range(cfg.num_slots)]
        # Generations are counted here: the copies in shared memory are the clients' to overwrite.
        self._ring_generations = [0] * cfg.num_slots
        self._slot_generations = [0] * cfg.num_slots
        for slot in range(cfg.num_slots):
            self.reset_ring(slot)
        self.lock = ControlLock.create(self.config.name)
        self.doorbell = self._semaphore("doorbell")
        self.completion_bells = [self._semaphore(f"cq.{i}") for i in range(cfg.num_slots)]
        self.slots = self.control.array(SLOT, cfg.num_slots, CONTROL_HEADER.itemsize)
        # Every slot's state word, for has_claims: a check cheap enough for every wake-up.
        self._slot_states = memoryview(self.slots.view(np.uint8).reshape(-1)).cast("I")[::SLOT.itemsize // 4]
        self.header = self.control.array(CONTROL_HEADER, 1)
        # The magic last: a client that reads it set finds every other field written.
        self.header[0] = (0, WIRE_VERSION, cfg.num_slots, FINGERPRINT, os.getpid(), self.epoch,
                          time.time_ns(), cfg.ring_slots, 0, cfg.arena_bytes, 0, 0)
        self.header["magic"] = MAGIC
        flag_at = CONTROL_HEADER.fields["engine_sleeping"][1]
        self.engine_sleeping = memoryview(self.control.array(np.uint8, 4, flag_at)).cast("I")

    def _kept_pool(self, pool_bytes: int, table_size: int) -> tuple | None:
        """The pool and table an earlier engine of this name left (with --keep-pool), if we
        keep pools and they fit this pool's geometry; any other leftover of them is removed
        (we hold the name: nothing else can be using them)."""
        names = [shm.ipc_name(self.config.name, what) for what in KEPT]
        found, foreign = [], None
        for name in names:
            try:
                found.append(shm.attach_segment(name))
            except ForeignSegmentError as exc:
                foreign = str(exc)
            except EngineNotRunningError:
                pass
        if not found and foreign is None:
            return None
        if foreign is not None:
            why = foreign
        elif not self.config.keep_pool:
            why = "this engine does not keep pools (--keep-pool)"
        elif len(found) < len(names):
            why = "the pool or its table is missing"
        elif (found[0].size, found[1].size) != (pool_bytes, table_size):
            why = f"it is {found[0].size} bytes with a {found[1].size}-byte table, not {pool_bytes}"
        else:
            why = PoolTable.mismatch(found[1].array(np.uint8, table_size), pool_bytes,
                                     self.config.slab_bytes)
        if why is None:
            return found[0], found[1]
        logger.warning("removing the pool an earlier engine named %r kept: %s",
                       self.config.name, why)
        for segment in found:
            segment.close()
        for name in names:
            shm.unlink_segment(name)
        return None

    def _segment(self, what: str, size: int) -> shm.Segment:
        name = shm.ipc_name(self.config.name, what)
        segment = _create_replacing(name, lambda: shm.create_segment(name, size), shm.unlink_segment)
        self._segments.append(segment)
        if what != "pool":  # the pool's pages are the backend's to fault in or allocate
            shm.reserve(segment)  # a full /dev/shm is refused now, never a SIGBUS later
        return segment

    def _semaphore(self, what: str, initial: int = 0) -> posix_ipc.Semaphore:
        name = shm.ipc_name(self.config.name, what)
        sem = _create_replacing(name, lambda: shm.create_semaphore(name, initial), shm.unlink_semaphore)
        self._semaphores.append(name)
        return sem

    def reset_ring(self, slot: int) -> None:
        """Slot ``slot``'s ring as new, for its next client (nothing of it is read back)."""
        view = self.rings[slot]
        reset_slots(view.submissions)
        reset_slots(view.completions)
        self._ring_generations[slot] = (self._ring_generations[slot] + 1) % 2**64
        view.header[0] = (MAGIC, WIRE_VERSION, len(view.submissions), len(view.arena),
                          self._ring_generations[slot], 0, 0, 0)

    def mark_started(self) -> None:
        """The pool is open: from here on, --keep-pool keeps even a new pool."""
        self.has_started = True

    def mark_serving(self) -> None:
        """Clients may attach from now on (until now their claims would wait)."""
        self.header["is_serving"] = 1

    def mark_stopping(self) -> None:
        self.header["is_stopping"] = 1

    def unlink_all(self, release_pool: bool = True) -> None:
        """Unlink every segment and semaphore this engine created (its name becomes free),
        but the pool and its table with --keep-pool.  With ``release_pool`` (no copy may
        still touch it), a pool not kept gives its memory back first: an engine started
        under the name as soon as it is free must find the room."""
        self.is_unlinking = True
        try:
            self._unlink_segments(release_pool)
        finally:  # the name free again, whatever failed above
            self._release_locks()

    def unlink_names(self) -> None:
        """Only the names of what ``unlink_all`` would unlink, and the lock files: for a stop
        that cannot finish (``stop_watch.py``), from another thread, just before the process
        exits (nothing is closed or given back: the exit does it)."""
        kept = self._kept_names()
        for segment in list(self._segments):
            if segment.name not in kept:
                shm.unlink_segment(segment.name)
        for name in list(self._semaphores):
            shm.unlink_semaphore(name)
        for path in (lock_path(self.config.name, "claims"), name_lock_path(self.config.name)):
            with contextlib.suppress(FileNotFoundError):  # removed already
                os.unlink(path)
        remove_lock_dir_if_empty(name_lock_path(self.config.name))

    def _kept_names(self) -> set[str]:
        # With --keep-pool, a kept pool always stays (it still holds its blocks), a new one
        # only if the engine started (a failed start leaves nothing behind).
        keep = self.config.keep_pool and (self.is_pool_kept or self.has_started)
        return {shm.ipc_name(self.config.name, what) for what in KEPT} if keep else set()

    def _unlink_segments(self, release_pool: bool) -> None:
        kept = self._kept_names()
        if kept and self.pool is not None:
            logger.info("keeping the pool and its table for the next engine named %r (--keep-pool)",
                        self.config.name)
        if release_pool and self.pool is not None and not kept:
            # The name first: giving a large pool back takes seconds (64 GiB: more than a
            # container's 10 s stop grace), and a stop killed meanwhile must not leave the
            # pool's file holding memory in /dev/shm; the name lock, held until the end,
            # keeps the next engine out until the room is there.
            shm.unlink_segment(self.pool.name)
            self.pool.discard()
        for segment in self._segments:
            if segment.name not in kept:
                shm.unlink_segment(segment.name)
        for name in self._semaphores:
            shm.unlink_semaphore(name)
        self._segments.clear()
        self._semaphores.clear()

    def _release_locks(self) -> None:
        """The control lock's file and the name's removed (the name last: it keeps the next
        engine out until everything is gone), then their directory if nothing else is in it."""
        if getattr(self, "lock", None) is not None:
            try:
                os.unlink(self.lock.path)
            except FileNotFoundError:
                pass
            self.lock.close()
            self.lock = None
        if self._name_lock is not None:
            release_name(self.config.name, self._name_lock)  # free for the next engine
            self._name_lock = None
            remove_lock_dir_if_empty(name_lock_path(self.config.name))

    def free_slot(self, slot: int) -> None:
        self._slot_generations[slot] = (self._slot_generations[slot] + 1) % 2**64
        self.slots["pid"][slot] = 0
        self.slots["generation"][slot] = self._slot_generations[slot]
        self.slots["state"][slot] = SlotState.FREE

    def has_claims(self) -> bool:
        """Whether some client has claimed a slot that is not yet accepted."""
        return SlotState.CLAIMED in self._slot_states  # a scan in C, without numpy's overhead

    def claimed_slots(self) -> np.ndarray:
        return np.flatnonzero(self.slots["state"] == SlotState.CLAIMED)
