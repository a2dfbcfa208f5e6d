"""The disk tier's storage: one file per block under one or more paths, with an LRU index.

Mechanism only; the engine's main thread decides what moves.  Every method runs on the main
thread; ``num_threads`` worker threads do the file I/O and checksums and queue a DiskDone::

    scan()                     at start: index the blocks the files hold, remove leftovers
    try_write(key, src, token) queue a write (evicting the disk LRU to make room); the key is
                               on disk once its DiskDone has been polled OK
    try_read(key, dst, token)  queue a read into dst; the key is not evicted until it is polled
    poll() -> [DiskDone]       the results that arrived, the index brought up to date
    touch / remove / contains / entry_bytes / block_meta / is_busy

A buffer handed to try_write or try_read must stay valid (and a write's unchanged) until the
DiskDone of its token is polled.  Each path holds at most ``size_bytes`` of files; a write
reserves its file's bytes when it is queued.  The LRU is rebuilt from the files' mtimes at
scan, so across a restart it is write order.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pegaflow.platform.errors import ConfigError

from ..blocks.entries import Key
from . import blockfile, scan
from .blockfile import BLOCKS_DIR, HEADER_BYTES
from .workers import DiskDone, DiskJob, IoWorkers

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class DiskCounters:
    blocks_written: int = 0
    blocks_read: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    write_ns: int = 0
    read_ns: int = 0
    checksum_failures: int = 0
    io_errors: int = 0
    writes_refused: int = 0  # no room: larger than a path, or every candidate victim being read
    evictions: int = 0


@dataclass(slots=True)
class Block:
    path_index: int
    file_bytes: int
    num_layers: int = 0
    num_readers: int = 0
    is_doomed: bool = False  # removed: unlinked once its reads (or its write) end


class DiskStore:
    def __init__(self, paths: list[Path], size_bytes: int, num_threads: int = 8,
                 wake: Callable[[], None] | None = None) -> None:
        self._paths = [Path(path) for path in paths]
        self._roots = [str(path) for path in self._paths]  # for block_path_text
        if not self._paths or len(set(self._paths)) != len(self._paths):
            raise ConfigError(f"disk tier paths must be distinct and at least one: {paths}")
        if size_bytes <= 0 or num_threads < 1:
            raise ConfigError(f"disk tier size {size_bytes} bytes or {num_threads} threads is unusable")
        if size_bytes <= HEADER_BYTES:
            logger.warning("disk tier: %d bytes per path hold no block (each takes %d bytes of header "
                           "beside its data): every write is refused", size_bytes, HEADER_BYTES)
        for path in self._paths:
            blockfile.make_private_dirs(path / BLOCKS_DIR)
        self._size_bytes = size_bytes
        self._used_bytes = [0] * len(self._paths)
        self._blocks: collections.OrderedDict[Key, Block] = collections.OrderedDict()  # oldest first
        self._writing: dict[Key, Block] = {}
        self._num_inflight = 0
        self._is_closed = False
        self.counters = DiskCounters()
        self._workers = IoWorkers(num_threads, wake)

    @property
    def bytes_used(self) -> int:
        """Bytes of block files on all paths, writes in flight included."""
        return sum(self._used_bytes)

    @property
    def bytes_total(self) -> int:
        return self._size_bytes * len(self._paths)

    @property
    def num_blocks(self) -> int:
        """Blocks whose files are indexed (removed ones included until their reads end)."""
        return len(self._blocks)

    def has_results(self) -> bool:
        """Whether finished I/O waits to be polled (never blocks)."""
        return self._workers.has_results()

    def num_inflight(self) -> int:
        return self._num_inflight

    def contains(self, key: Key) -> bool:
        block = self._blocks.get(key)
        return block is not None and not block.is_doomed

    def entry_bytes(self, key: Key) -> int | None:
        return self._blocks[key].file_bytes - HEADER_BYTES if self.contains(key) else None

    def block_meta(self, key: Key) -> tuple[int, int] | None:
        """(entry_bytes, num_layers) of a block on disk, None if it is not."""
        if not self.contains(key):
            return None
        block = self._blocks[key]
        return block.file_bytes - HEADER_BYTES, block.num_layers

    def is_busy(self, key: Key) -> bool:
        """A write, a read or a removal of ``key`` is under way."""
        block = self._blocks.get(key)
        return key in self._writing or block is not None and (block.num_readers > 0 or block.is_doomed)

    def touch(self, key: Key) -> None:
        if key in self._blocks:
            self._blocks.move_to_end(key)

    def try_write(self, key: Key, src, token: int, num_layers: int = 0) -> bool:
        """Queue a write of ``src`` as ``key``'s file (``num_layers`` is kept for ``block_meta``);
        False if the key is on disk or being written, or there is no room (writes_refused)."""
        view = memoryview(src).cast("B")
        if self._is_closed or key in self._blocks or key in self._writing:
            return False
        file_bytes = HEADER_BYTES + view.nbytes
        path_index = self._make_room(file_bytes)
        if path_index is None:
            self.counters.writes_refused += 1
            return False
        self._used_bytes[path_index] += file_bytes
        self._writing[key] = Block(path_index, file_bytes, num_layers)
        self._submit(DiskJob(token, key, False, self._path_of(path_index, key), view, num_layers))
        return True

    def try_read(self, key: Key, dst, token: int) -> bool:
        """Queue a read of ``key`` into ``dst``; it also makes ``key`` the most recently used."""
        view = memoryview(dst).cast("B")
        if view.readonly:
            raise TypeError("a disk read needs a writable buffer")
        block = self._blocks.get(key)
        if self._is_closed or block is None or block.is_doomed or block.file_bytes != HEADER_BYTES + view.nbytes:
            return False
        block.num_readers += 1
        self._blocks.move_to_end(key)
        self._submit(DiskJob(token, key, True, self._path_of(block.path_index, key), view))
        return True

    def remove(self, key: Key) -> bool:
        """Forget ``key`` and unlink its file (after its reads or its write end); False if unknown."""
        block = self._blocks.get(key) or self._writing.get(key)
        if block is None or block.is_doomed:
            return False
        if key in self._blocks:
            self._forget(key)
        else:
            block.is_doomed = True
        return True

    def keys_of(self, namespace: int) -> list[Key]:
        """The keys of ``namespace`` on disk or being written (removed ones left out)."""
        return [key for key, block in itertools.chain(self._blocks.items(), self._writing.items())
                if key[0] == namespace and not block.is_doomed]

    def poll(self) -> list[DiskDone]:
        done_list = []
        for done in self._workers.take_results():
            self._num_inflight -= 1
            if done.is_read:
                self._finish_read(done)
            else:
                self._finish_write(done)
            done_list.append(done)
        return done_list

    def scan(self) -> int:
        """Rebuild the index from the files under every path (``scan.py``); the number of
        blocks indexed."""
        assert self._num_inflight == 0, "scan runs before any I/O"
        self._blocks.clear()
        self._used_bytes = [0] * len(self._paths)
        return scan.scan(self)

    def take_in(self, block: blockfile.FoundBlock, path_index: int) -> None:
        """Index a block file found under path ``path_index`` (at scan)."""
        self._blocks[block.key] = Block(path_index, block.file_bytes, block.num_layers)
        self._used_bytes[path_index] += block.file_bytes

    def close(self, timeout_s: float = 5.0, drop_queued: bool = False) -> bool:
        """Stop the workers once the queued I/O ends (``drop_queued``: once the I/O under way
        ends), waiting at most ``timeout_s``; False if a worker may still be running."""
        if self._is_closed:
            return True
        self._is_closed = True
        return self._workers.close(timeout_s, drop_queued)

    def _path_of(self, path_index: int, key: Key) -> str:
        return blockfile.block_path_text(self._roots[path_index], key)

    def _submit(self, job: DiskJob) -> None:
        self._num_inflight += 1
        self._workers.submit(job)

    def _make_room(self, file_bytes: int) -> int | None:
        """The path to write ``file_bytes`` to (most free first), its LRU victims evicted; None if
        no path can make room (all or nothing: nothing is evicted then)."""
        if file_bytes > self._size_bytes:
            return None
        for path_index in sorted(range(len(self._paths)), key=self._used_bytes.__getitem__):
            num_needed = self._used_bytes[path_index] + file_bytes - self._size_bytes
            victims = self._pick_victims(path_index, num_needed)
            if victims is not None:
                for key in victims:
                    self._evict(key)
                return path_index
        return None

    def _pick_victims(self, path_index: int, num_needed: int) -> list[Key] | None:
        """The oldest blocks of the path, none being read, freeing ``num_needed`` bytes."""
        victims: list[Key] = []
        num_freed = 0
        for key, block in self._blocks.items():
            if num_freed >= num_needed:
                break
            if block.path_index == path_index and block.num_readers == 0:
                victims.append(key)
                num_freed += block.file_bytes
        return victims if num_freed >= num_needed else None

    def _shrink(self, path_index: int) -> int:
        victims = self._pick_victims(path_index, self._used_bytes[path_index] - self._size_bytes) or []
        for key in victims:
            self._evict(key)
        return len(victims)

    def _evict(self, key: Key) -> None:
        self.counters.evictions += 1
        self._drop(key)

    def _forget(self, key: Key) -> None:
        """Mark ``key`` removed; drop it (and its file) now unless reads of it are in flight."""
        block = self._blocks[key]
        block.is_doomed = True
        if block.num_readers == 0:
            self._drop(key)

    def _drop(self, key: Key) -> None:
        block = self._blocks.pop(key)
        self._used_bytes[block.path_index] -= block.file_bytes
        self._unlink(self._path_of(block.path_index, key))

    def _unlink(self, path: Path | str) -> int:
        """Remove one file on the main thread; 1 if it was there."""
        try:
            os.unlink(path)
        except FileNotFoundError:  # deleted underneath already: the goal is met
            return 0
        except OSError as exc:
            self.counters.io_errors += 1
            self._workers.log_os_error(exc, "unlink")
            return 0
        return 1

    def _finish_write(self, done: DiskDone) -> None:
        block = self._writing.pop(done.key)
        if done.error is not None:
            self.counters.io_errors += 1
            self._used_bytes[block.path_index] -= block.file_bytes
            return
        self.counters.blocks_written += 1
        self.counters.bytes_written += done.num_bytes
        self.counters.write_ns += done.elapsed_ns
        self._blocks[done.key] = block
        if block.is_doomed:
            self._forget(done.key)

    def _finish_read(self, done: DiskDone) -> None:
        block = self._blocks[done.key]  # a read in flight keeps its block indexed
        block.num_readers -= 1
        if done.error is None:
            self.counters.blocks_read += 1
            self.counters.bytes_read += done.num_bytes
            self.counters.read_ns += done.elapsed_ns
        elif done.is_corrupt:
            self.counters.checksum_failures += 1
            level = logging.WARNING if self.counters.checksum_failures == 1 else logging.DEBUG
            logger.log(level, "disk block %s is corrupt (%s): removed; further ones are counted in "
                       "checksum_failures", self._path_of(block.path_index, done.key), done.error)
        else:
            self.counters.io_errors += 1
        if done.error is not None or block.is_doomed:
            self._forget(done.key)
