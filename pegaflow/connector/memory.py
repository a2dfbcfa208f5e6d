"""How a worker exposes its KV memory to the engine: host shared memory or CUDA IPC.

``HostMemory`` serves the host backend: the KV caches are CPU tensors inside a
``pegaflow.client.host_memory.HostKVBuffer`` (tests, tools) or, under vLLM's CPU build, tensors of
the worker's private memory that ``share`` moves into shared memory in place
(``pegaflow/client/in_place.py``; docs/cpu.md).  ``CudaMemory`` exports each CUDA
allocation with an IPC handle and owns the pool of IPC events that order copies
against vLLM's compute stream.
"""

from __future__ import annotations

import numpy as np

from pegaflow.client.host_memory import HostKVBuffer, find_buffer
from pegaflow.client.in_place import share_in_place
from pegaflow.connector.layout import TensorInfo, span_bytes
from pegaflow.platform.errors import LayoutError


class HostMemory:
    has_events = False

    def __init__(self, engine_name: str) -> None:
        self.engine_name = engine_name  # the moved buffers are named for it (found by --clean, pegaflow-stat)
        self.moved: list[HostKVBuffer] = []  # the buffers ``share`` made (this side unlinks them)

    def share(self, tensors) -> None:
        """Each torch storage behind ``tensors`` that no ``HostKVBuffer`` holds is moved into
        shared memory where it lies (vLLM's CPU build: one private mapping for every layer)."""
        storages = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors}
        for address, num_bytes in sorted(storages):
            if find_buffer(address, num_bytes) is None:
                self.moved.append(share_in_place(address, num_bytes, self.engine_name))

    def region_of(self, info: TensorInfo) -> tuple[object, int, np.ndarray]:
        """(allocation key, offset of ``info`` in it, a REGION record for the allocation)."""
        found = find_buffer(info.data_ptr, span_bytes(info))
        if found is None:
            raise LayoutError(f"{info.name}: a CPU KV cache must live in a "
                              f"pegaflow.client.host_memory.HostKVBuffer for the host backend")
        buffer, offset = found
        return buffer.name, offset, buffer.region_record(0, 0, 0)

    def create_events(self, num_events: int) -> None:
        """Host copies are synchronous: no events."""

    def close(self) -> None:
        """Unlink what ``share`` made (its pages stay mapped where the tensors are, until
        vLLM frees them); other buffers belong to whoever created them."""
        for buffer in self.moved:
            buffer.close()
        self.moved = []


class CudaMemory:
    has_events = True

    def __init__(self, device: int):
        self.device = device
        self.events = None

    def create_events(self, num_events: int) -> None:
        from pegaflow.platform.cuda.ipc import EventPool
        self.events = EventPool(num_events, self.device)

    def region_of(self, info: TensorInfo) -> tuple[object, int, np.ndarray]:
        from pegaflow.platform.cuda.ipc import export_allocation, region_record
        exported = export_allocation(info.data_ptr)
        # The region is the whole allocation; layer offsets count from its base.
        region = region_record(exported._replace(base_offset=0), 0, 0, 0)
        return info.data_ptr - exported.base_offset, exported.base_offset, region

    def current_stream(self) -> int:
        import torch
        return torch.cuda.current_stream().cuda_stream

    def close(self) -> None:
        if self.events is not None:
            self.events.close()
