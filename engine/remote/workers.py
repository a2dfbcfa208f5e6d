"""The remote tier's threads, one per kind of store call, so that none waits behind another:

    query    a lookup's existence check: which keys after its local prefix the store holds
             (one RPC to the master), and the first one's header (its block size)
    fetch    data objects into reserved pool entries (their headers into the thread's
             slots), each block's key, length and checksum checked
    publish  READY blocks' data straight from their pool pages with their headers, then
             the header objects

Each queues a RemoteDone for the engine's thread (``take_results``) and rings ``wake``.
Nothing here touches the index.  The publish queue is bounded: ``try_publish`` refuses
when it is full (the caller counts the drop).
"""

from __future__ import annotations

import collections
import enum
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..blocks.entries import Key
from ..threads import join_within
from . import header
from .store import NOT_FOUND

logger = logging.getLogger(__name__)

MAX_QUERY_BLOCKS = 2048  # keys one existence check asks for (32k tokens of 16-token blocks)
MAX_PUT_BATCH = 256      # blocks one publishing call puts
MAX_PUTS_QUEUED = 4096   # blocks waiting to be published; past it new ones are dropped


class Kind(enum.IntEnum):
    QUERY = 0
    FETCH = 1
    PUT = 2     # (the publish thread's queue also takes REMOVE jobs)
    REMOVE = 3  # a DROP's blocks: their objects leave the store too


class FetchStatus(enum.IntEnum):
    OK = 0
    FAILED = 1   # missing (gone since the query) or the call failed
    CORRUPT = 2  # wrong length or checksum: never served


@dataclass(slots=True)
class RemoteJob:
    kind: Kind
    token: int
    keys: list[Key]
    offsets: list[int] = field(default_factory=list)  # pool offsets (fetch, put)
    sizes: list[int] = field(default_factory=list)
    num_layers: int = 0  # a put's


@dataclass(slots=True)
class RemoteDone:
    kind: Kind
    tokens: list[int]
    results: list  # query: (entry_bytes, num_layers) or None per key; fetch: FetchStatus; put: bool
    num_bytes: int
    elapsed_ns: int
    num_errors: int  # calls or objects that failed for the store's sake (not a plain miss)


class RemoteWorkers:
    def __init__(self, store, pool: np.ndarray, wake: Callable[[], None] | None = None) -> None:
        self.store, self.pool, self._wake = store, pool, wake
        self._pool_ptr = pool.ctypes.data
        self._headers = {Kind.QUERY: np.zeros(header.HEADER_BYTES, np.uint8),
                         Kind.FETCH: np.zeros(MAX_QUERY_BLOCKS * header.HEADER_BYTES, np.uint8),
                         Kind.PUT: np.zeros(MAX_PUT_BATCH * header.HEADER_BYTES, np.uint8)}
        for buffer in self._headers.values():
            store.register(buffer.ctypes.data, buffer.nbytes)
        self._queues = {Kind.QUERY: queue.Queue(), Kind.FETCH: queue.Queue(),
                        Kind.PUT: queue.Queue(MAX_PUTS_QUEUED)}
        self._results: collections.deque[RemoteDone] = collections.deque()
        self._threads = [threading.Thread(target=self._work, args=(kind,), name=f"pegaflow-remote-{kind.name.lower()}",
                                          daemon=True) for kind in self._queues]
        for thread in self._threads:
            thread.start()

    def submit(self, job: RemoteJob) -> None:
        """Queue a query or a fetch (never refused: the tier bounds them)."""
        self._queues[job.kind].put(job)

    def try_publish(self, job: RemoteJob) -> bool:
        """Queue a put or a remove; False if the publish queue is full."""
        try:
            self._queues[Kind.PUT].put_nowait(job)
        except queue.Full:
            return False
        return True

    def has_results(self) -> bool:
        return bool(self._results)

    def take_results(self):
        while self._results:
            yield self._results.popleft()

    def close(self, timeout_s: float) -> bool:
        """Stop the threads (queued jobs are dropped) within ``timeout_s``; whether all stopped
        (one stuck in a store call still uses the pool's pages and the store)."""
        for q in self._queues.values():
            while True:
                try:
                    q.get_nowait()
                except queue.Empty:
                    break
            q.put(None)
        num_alive = join_within(self._threads, timeout_s)
        if num_alive:
            logger.warning("%d remote tier threads still in a store call %.1f s after close", num_alive, timeout_s)
        return num_alive == 0

    def _work(self, kind: Kind) -> None:
        run = {Kind.QUERY: self._query, Kind.FETCH: self._fetch, Kind.PUT: self._put}[kind]
        jobs = self._queues[kind]
        while (job := jobs.get()) is not None:
            batch = [job]
            while job.kind is Kind.PUT and len(batch) < MAX_PUT_BATCH:
                try:
                    more = jobs.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    jobs.put(None)  # (the stop, seen after this batch)
                    break
                if more.kind is not Kind.PUT:
                    self._remove([more])
                    continue
                batch.append(more)
            if job.kind is Kind.REMOVE:
                self._remove(batch)
                continue
            start_ns = time.perf_counter_ns()
            try:
                done = run(batch)
            except Exception:  # a worker's boundary: the engine's thread must still get its answer
                logger.exception("remote %s failed", kind.name.lower())
                done = RemoteDone(kind, [j.token for j in batch], _failed(kind, batch), 0, 0, 1)
            done.elapsed_ns = time.perf_counter_ns() - start_ns
            self._results.append(done)
            if self._wake is not None:
                self._wake()

    def _remove(self, batch: list[RemoteJob]) -> None:
        names = [name for job in batch for key in job.keys for name in (header.header_name(key),
                                                                        header.data_name(key))]
        num_failed = sum(code < 0 and code != NOT_FOUND for code in self.store.remove(names))
        if num_failed:
            logger.warning("remote store: %d of %d objects of dropped blocks not removed", num_failed, len(names))

    def _query(self, batch: list[RemoteJob]) -> RemoteDone:
        job = batch[0]
        keys, slot = job.keys[:MAX_QUERY_BLOCKS], self._headers[Kind.QUERY]
        held = self.store.exists([header.data_name(k) for k in keys])
        num_errors = sum(code < 0 for code in held)
        num_held = next((i for i, code in enumerate(held) if code != 1), len(held))
        results: list = [None] * len(keys)
        if num_held:  # the run's block size: the first one's header object says
            code = self.store.get([header.header_name(keys[0])], [slot.ctypes.data], [header.HEADER_BYTES])[0]
            meta = header.read_header(slot, keys[0]) if code == header.HEADER_BYTES else None
            num_errors += code < 0 and code != NOT_FOUND
            if meta is not None:
                results[:num_held] = [meta[:2]] * num_held
        return RemoteDone(Kind.QUERY, [job.token], results, header.HEADER_BYTES, 0, num_errors)

    def _fetch(self, batch: list[RemoteJob]) -> RemoteDone:
        job, pool, slots, size = batch[0], self.pool, self._headers[Kind.FETCH], header.HEADER_BYTES
        base = slots.ctypes.data
        codes = self.store.get_parts([header.data_name(k) for k in job.keys],
                                     [[self._pool_ptr + o, base + i * size] for i, o in enumerate(job.offsets)],
                                     [[n, size] for n in job.sizes])
        results, num_bytes = [], 0
        for i, (key, offset, num, code) in enumerate(zip(job.keys, job.offsets, job.sizes, codes)):
            meta = header.read_header(slots[i * size:(i + 1) * size], key) if code == num + size else None
            if code < 0:
                results.append(FetchStatus.FAILED)
            elif meta is None or meta[0] != num or header.checksum(pool[offset:offset + num]) != meta[2]:
                results.append(FetchStatus.CORRUPT)
            else:
                results.append(FetchStatus.OK)
                num_bytes += num
        num_errors = sum(code < 0 and code != NOT_FOUND for code in codes)
        return RemoteDone(Kind.FETCH, [job.token], results, num_bytes, 0, num_errors)

    def _put(self, batch: list[RemoteJob]) -> RemoteDone:
        pool, slots, size = self.pool, self._headers[Kind.PUT], header.HEADER_BYTES
        base = slots.ctypes.data
        for i, job in enumerate(batch):
            offset, num_bytes = job.offsets[0], job.sizes[0]
            header.write_header(slots[i * size:(i + 1) * size], job.keys[0], num_bytes, job.num_layers,
                                header.checksum(pool[offset:offset + num_bytes]))
        codes = self.store.put_parts([header.data_name(j.keys[0]) for j in batch],
                                     [[self._pool_ptr + j.offsets[0], base + i * size] for i, j in enumerate(batch)],
                                     [[j.sizes[0], size] for j in batch])
        stored = [i for i, code in enumerate(codes) if code == 0]  # a header object only after its data
        head_codes = self.store.put([header.header_name(batch[i].keys[0]) for i in stored],
                                    [base + i * size for i in stored], [size] * len(stored)) if stored else []
        is_ok = [False] * len(batch)
        for i, code in zip(stored, head_codes):
            is_ok[i] = code == 0
        num_bytes = sum(j.sizes[0] for j, ok in zip(batch, is_ok) if ok)
        return RemoteDone(Kind.PUT, [j.token for j in batch], is_ok, num_bytes, 0, is_ok.count(False))


def _failed(kind: Kind, batch: list[RemoteJob]) -> list:
    if kind is Kind.QUERY:
        return [None] * len(batch[0].keys)
    if kind is Kind.FETCH:
        return [FetchStatus.FAILED] * len(batch[0].keys)
    return [False] * len(batch)
