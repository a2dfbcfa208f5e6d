"""What the dispatcher asks of a copy backend: register memory, enqueue copies, poll.

A backend only enqueues; it never blocks the dispatcher on a copy.  ``poll`` reports
the copies that have finished.  The pool is made reachable a part at a time while the
engine serves (``engine/memory/pinning.py``): ``open_pool`` first, then ``pin_range`` of each
chunk (faulted in already) on the pinning thread, then ``extend_pool`` on the
dispatcher's thread, after which copies may use that part; ``attach_pool`` does all of
it for the whole pool at once (tools and tests).  Addresses are computed the same way by
every backend:

    client page (layer l, block b) = region base + layer.offset_bytes + b * layer.block_stride_bytes
    pool page   (layer l, entry e) = pool base + e.offset + l * page_bytes

``region base`` is the registered pointer: the allocation's base (the shared-memory
segment, or what ``cuIpcOpenMemHandle`` returns) plus ``REGION.base_offset``; the
backend adds ``base_offset``, ``LayerPlacement.offset_bytes`` never includes it.

where ``l`` is the client's global layer index and pages are ``page_bytes`` contiguous
bytes.  The pool holds one entry per block hash: ``num_layers * page_bytes`` bytes.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, replace

import numpy as np

from ..memory import fault_in

KERNEL = "kernel"            # a gather/scatter kernel per layer (SMs)
COPY_ENGINE = "copy-engine"  # cuMemcpyBatchAsync per layer (DMA, no SMs)
STAGED = "staged"            # packed in device memory, then one DMA per run of entries
AUTO = "auto"                # staged where it can be, else chosen per page size by a measurement
PATHS = (AUTO, KERNEL, COPY_ENGINE, STAGED)
DEVICE_STAGING_BYTES = 256 << 20  # per GPU, the staged path's slots: two of 64 MiB each way


class Direction(enum.IntEnum):
    SAVE = 1  # client (GPU) pages -> pool
    LOAD = 2  # pool -> client (GPU) pages


@dataclass(frozen=True, slots=True)
class LayerPlacement:
    """Where one layer of a client's KV cache lives inside a registered region."""

    layer: int
    region_id: int
    offset_bytes: int
    block_stride_bytes: int


@dataclass(slots=True)
class CopyOp:
    """One command's copies: the same blocks for every layer in ``layers``.

    ``wait_event``: index in the client's shared event pool that the copy must wait for
    before reading client memory (SAVE), or None; with ``wait_per_layer`` the k-th layer
    of ``layers`` waits for event ``wait_event + k`` instead.  ``record_events``: for LOAD, the
    first index of ``len(layers)`` consecutive client events, one recorded after each
    layer's copy is issued, or None.
    """

    token: int
    direction: Direction
    slot: int
    layers: list[LayerPlacement]
    page_bytes: int
    block_ids: np.ndarray      # int64, the client's block ids
    entry_offsets: np.ndarray  # int64, byte offsets of the pool entries
    wait_event: int | None = None
    record_events: int | None = None
    wait_per_layer: bool = False

    def in_pool_order(self) -> "CopyOp":
        """The same copies with the pool side in ascending address order (this op if it
        already is).  Every (block, entry) pair is its own copy, so their order is free;
        DMA writes to host memory run faster in address order (docs/benchmarks.md)."""
        offsets = self.entry_offsets
        if len(offsets) < 2 or bool((offsets[1:] >= offsets[:-1]).all()):
            return self
        order = np.argsort(offsets, kind="stable")
        return replace(self, block_ids=self.block_ids[order], entry_offsets=offsets[order])


@dataclass(frozen=True, slots=True)
class CopyDone:
    token: int
    error: str | None = None


class CopyBackend(abc.ABC):
    """Mechanism only: where bytes go is decided by the dispatcher and the index."""

    name: str

    @abc.abstractmethod
    def open_pool(self, pool_segment) -> None:
        """Know the pool (a ``pegaflow.platform.shm.Segment``); no copy touches it before
        ``extend_pool`` says how much of it is pinned."""

    def pin_range(self, start: int, num_bytes: int) -> None:
        """Pin ``[start, +num_bytes)`` of the pool, faulted in already, for copies: called on
        the pinning thread, for ranges in ascending order.  On failure it raises a
        ``PegaflowError`` and leaves nothing of the range pinned.  Nothing to pin here."""

    def extend_pool(self, num_bytes: int) -> None:
        """The pool's first ``num_bytes`` are pinned: copies may use them from now on.
        Called on the dispatcher's thread; a ``PegaflowError`` refuses the part."""

    def attach_pool(self, pool_segment, num_threads: int | None = None) -> None:
        """The whole pool at once, for tools and tests: opened, faulted in, pinned, usable."""
        self.open_pool(pool_segment)
        fault_in.advise_huge_pages(pool_segment)
        fault_in.fault_in(pool_segment, 0, pool_segment.size, num_threads or fault_in.default_threads())
        self.pin_range(0, pool_segment.size)
        self.extend_pool(pool_segment.size)

    @abc.abstractmethod
    def register_region(self, slot: int, region_id: int, region: np.void) -> None:
        """Open a client's memory (a ``wire.REGION`` record); raises on failure."""

    @abc.abstractmethod
    def register_events(self, slot: int, handles: np.ndarray) -> None:
        """Open a client's pool of IPC events (``wire.EVENT_HANDLE`` records)."""

    @abc.abstractmethod
    def unregister_client(self, slot: int) -> None:
        """Close everything ``slot`` registered (after its copies are done)."""

    def drop_held(self, slot: int) -> None:
        """Copies of ``slot`` held until its client's GPU has written their data, never
        issued (``--hold-saves``): ended now with an error, ``poll`` reports them.  Its client
        is gone (called for every client found dead): the data may never be written, and its
        slot waits for them; the CUDA backend also lets go of its handles off the engine's
        thread when it is unregistered (``releases.py``).  Nothing here."""

    @abc.abstractmethod
    def submit(self, op: CopyOp) -> None:
        """Enqueue ``op``; its completion comes back through ``poll``.  A ``PegaflowError``
        refuses it: it is not in flight then, and ``poll`` never reports it."""

    @abc.abstractmethod
    def poll(self) -> list[CopyDone]:
        """Ops finished since the last call; never blocks."""

    @abc.abstractmethod
    def num_inflight(self) -> int:
        """Ops submitted and not yet reported by ``poll``."""

    def close(self) -> None:
        """Release every resource; called once at shutdown after in-flight work ends."""
