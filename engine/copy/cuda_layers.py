"""``LayerCopier``: an op copied layer by layer on a device's layer streams, by the kernel or
the copy engine.

Each of the op's layers goes on that layer's stream for its direction (``Device.stream``):
a SAVE layer first waits for the client's event (one for the op, or the layer's own), a
LOAD records the client's event ``record_events + k`` after layer k.  Inside one op, layer
k starts after layer k - depth ends (the kernel's depth is ``layers_in_flight``: it bounds
the SMs taken from vLLM's compute; the copy engine's, for saves, ``dma_layers_in_flight``),
and every SAVE of a path joins that path's chain with the same rule, so however many
saves are queued, at most depth layer copies of a path run at once.  The kernel reads an
op's block ids and pool offsets from a slice of the pinned staging ring (``stage_ids``).
The copier holds that ring and the two depths; the device (``Device``) comes with each call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from pegaflow.platform.cuda import driver
from pegaflow.platform.errors import CudaError

from .base import COPY_ENGINE, KERNEL, CopyOp, Direction
from .checks import Region
from .kernels import StagingRing

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Inflight:
    """One op issued: the engine events and streams it used, its staging slice, the event
    after its last copy (``done``)."""
    token: int
    slot: int
    device: int
    staging: list | None
    events: list = field(default_factory=list)   # engine events, recycled when done
    streams: list = field(default_factory=list)
    done: object = None

    def drain(self) -> None:
        """Wait for what this op issued on each of its streams (after a failed enqueue)."""
        for stream in self.streams:
            try:
                driver.synchronize_stream(stream)
            except CudaError:
                logger.exception("draining copy %d", self.token)


class LayerCopier:
    """Ops issued layer by layer: ``ring`` holds the kernel's block ids and offsets;
    ``layers_in_flight`` bounds the kernel's layers running at once in an op,
    ``dma_layers_in_flight`` the copy engine's for saves."""

    def __init__(self, ring: StagingRing, layers_in_flight: int, dma_layers_in_flight: int) -> None:
        self.ring = ring
        self.layers_in_flight = layers_in_flight
        self.dma_layers_in_flight = dma_layers_in_flight

    def stage_ids(self, op: CopyOp, offsets: np.ndarray | None = None) -> list | None:
        """A slice of the ring holding the op's block ids, then ``offsets`` (by default its
        entry offsets), for the kernel to read; None if the ring is full."""
        n = len(op.block_ids)
        offsets = op.entry_offsets if offsets is None else offsets
        entry = self.ring.try_alloc(n + len(offsets))
        if entry is not None:
            start = entry[0]
            self.ring.words[start:start + n] = op.block_ids
            self.ring.words[start + n:start + n + len(offsets)] = offsets
        return entry

    def copy_layer(self, dev, path: str, stream, op: CopyOp, client_base: int, client_stride: int,
                   pool_base: int, to_pool: bool, staging: list | None) -> None:
        """One layer of ``op`` on ``stream``: one kernel launch, or one batch of page copies."""
        if path == KERNEL:
            n = len(op.block_ids)
            ids = self.ring.address(staging[0])
            dev.kernel.launch(stream, ids, ids + 8 * n, n, client_base, client_stride,
                              pool_base, op.page_bytes, to_pool)
            return
        client = op.block_ids * client_stride + client_base  # int64 (CopyOp), no copy first
        pool = op.entry_offsets + pool_base
        dst, src = (pool, client) if to_pool else (client, pool)
        driver.memcpy_batch_async(dst, src, op.page_bytes, stream)

    def issue(self, dev, op: CopyOp, regions: list[Region], path: str, f: Inflight, events: list) -> None:
        """Enqueue ``op`` on ``dev``'s layer streams (current device: ``dev``'s); ``events``:
        the client's IPC events on this device."""
        to_pool = op.direction == Direction.SAVE
        depth = self.dma_layers_in_flight if to_pool and path == COPY_ENGINE else self.layers_in_flight
        before = dev.save_chains[path] if to_pool else []  # behind this path's earlier saves
        for k, (layer, region) in enumerate(zip(op.layers, regions)):
            stream = dev.stream(layer.layer, op.direction)
            f.streams.append(stream)
            if k >= depth:
                driver.wait(stream, f.events[k - depth])
            elif len(before) + k >= depth:
                driver.wait(stream, before[len(before) + k - depth])
            if op.wait_event is not None:
                driver.wait(stream, events[op.wait_event + (k if op.wait_per_layer else 0)])
            client_base = region.base + layer.offset_bytes
            pool_base = dev.pool_base + layer.layer * op.page_bytes
            self.copy_layer(dev, path, stream, op, client_base, layer.block_stride_bytes,
                            pool_base, to_pool, f.staging)
            if op.record_events is not None:
                driver.record(events[op.record_events + k], stream)
            f.events.append(dev.event())
            driver.record(f.events[-1], stream)
        last = f.streams[-1]
        for event in f.events[max(0, len(f.events) - depth):-1]:
            driver.wait(last, event)
        if to_pool:
            dev.save_chains[path] = (before + f.events)[-depth:]
        f.done = dev.event()
        f.events.append(f.done)
        driver.record(f.done, last)

    def release(self, dev, f: Inflight) -> None:
        """A finished op's events back to ``dev``'s idle ones (out of its save chains and staging
        buffers' last uses first: they may be reused) and its block ids out of the ring."""
        recycled = {id(event) for event in f.events}
        for path, chain in dev.save_chains.items():
            if chain:
                dev.save_chains[path] = [e for e in chain if id(e) not in recycled]
        if dev.staging is not None:
            dev.staging.forget(recycled)
        dev.idle_events.extend(f.events)
        f.events = []
        if f.staging is not None:
            self.ring.free(f.staging)
            f.staging = None
