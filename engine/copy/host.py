"""The host backend: "device" memory is a client's shared-memory buffer, copies are memcpy.

Same protocol and index as the cuda backend, so every engine test runs without a GPU.
Copies complete synchronously inside ``submit``; ``poll`` hands them back in order.
"""

from __future__ import annotations

import numpy as np

from pegaflow.platform import shm
from pegaflow.platform.errors import ShmError
from pegaflow.platform.wire import RegionKind

from .base import CopyBackend, CopyDone, CopyOp, Direction
from .visible_gpus import VisibleGpus


class HostBackend(CopyBackend):
    name = "host"

    def __init__(self) -> None:
        self._pool: np.ndarray | None = None
        self._gpus = VisibleGpus.host()
        self._regions: dict[tuple[int, int], tuple[shm.Segment, np.ndarray]] = {}  # at base_offset
        self._done: list[CopyDone] = []

    def open_pool(self, pool_segment: shm.Segment) -> None:
        """The pool's pages are faulted in (allocated) before any part of it is used: a
        full /dev/shm cannot SIGBUS a copy later; there is nothing else to pin here."""
        self._pool = pool_segment.array(np.uint8, pool_segment.size)

    def register_region(self, slot: int, region_id: int, region: np.void) -> None:
        if int(region["kind"]) != RegionKind.HOST_SHM:
            raise ShmError("the host backend takes host shared-memory regions only")
        self._gpus.ordinal_of(region["gpu_uuid"].tobytes(), int(region["client_device"]))
        name = bytes(region["shm_name"]).decode()
        segment = shm.attach_segment(name)
        size, base = int(region["alloc_bytes"]), int(region["base_offset"])
        if size > segment.size or base > size:
            segment.close()
            raise ShmError(f"region {name} is {segment.size} bytes; {size} announced at {base}")
        old = self._regions.pop((slot, region_id), None)
        if old is not None:
            old[0].close()
        self._regions[(slot, region_id)] = (segment, segment.array(np.uint8, size - base, base))

    def register_events(self, slot: int, handles: np.ndarray) -> None:
        """Host copies are synchronous: there is nothing to order with events."""

    def unregister_client(self, slot: int) -> None:
        for key in [k for k in self._regions if k[0] == slot]:
            segment, _ = self._regions.pop(key)
            segment.close()

    def submit(self, op: CopyOp) -> None:
        pool, page = self._pool, op.page_bytes
        pairs = list(zip(op.block_ids.tolist(), op.entry_offsets.tolist()))
        for placement in op.layers:
            memory = self._regions[(op.slot, placement.region_id)][1]
            layer_at = placement.layer * page
            for block_id, entry_offset in pairs:
                src = placement.offset_bytes + block_id * placement.block_stride_bytes
                dst = entry_offset + layer_at
                if op.direction == Direction.SAVE:
                    pool[dst:dst + page] = memory[src:src + page]
                else:
                    memory[src:src + page] = pool[dst:dst + page]
        self._done.append(CopyDone(op.token))

    def poll(self) -> list[CopyDone]:
        done, self._done = self._done, []
        return done

    def num_inflight(self) -> int:
        return len(self._done)

    def close(self) -> None:
        for slot in {k[0] for k in self._regions}:
            self.unregister_client(slot)
