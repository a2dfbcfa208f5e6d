"""What a client exports to the engine: KV memory as IPC handles, and a pool of IPC events.

Memory.  ``cuIpcGetMemHandle`` names a whole allocation, and torch's caching allocator
sub-allocates, so the engine's ``cuIpcOpenMemHandle`` returns the allocation's base:
``export_allocation`` sends ``ptr - base`` (from ``cuMemGetAddressRange``) with the handle.

Events.  ``EventPool`` creates its events once, with ``CU_EVENT_INTERPROCESS |
CU_EVENT_DISABLE_TIMING``, and hands their 64-byte handles to the engine.  A wait binds to
the most recent record *already issued*, so every use of an event is sequenced through
the ring: the client records before it submits a SAVE that waits on the event, and
waits on a LOAD's events only after the engine has accepted (and so recorded) them.

A device is named to the engine by its UUID, not by this process's ordinal for it: under
CUDA_VISIBLE_DEVICES (a Kubernetes pod's one GPU) this process's device 0 may be the engine's
device 3.

Pointers and streams are plain ints (``tensor.data_ptr()``, ``stream.cuda_stream``);
nothing here imports torch.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import numpy as np

from pegaflow.platform import wire
from pegaflow.platform.cuda import driver
from pegaflow.platform.errors import CudaError

logger = logging.getLogger(__name__)


class ExportedAllocation(NamedTuple):
    handle: bytes      # 64-byte cuIpcMemHandle of the whole allocation
    base_offset: int   # ptr - allocation base
    alloc_bytes: int   # size of the whole allocation
    device: int        # device ordinal as this process numbers it
    gpu_uuid: bytes    # that device's UUID, as every process names it (wire.REGION.gpu_uuid)


def export_allocation(ptr: int) -> ExportedAllocation:
    """The IPC handle of the allocation holding device pointer ``ptr``, and ``ptr``'s offset."""
    driver.init()
    device = driver.pointer_device(ptr)
    driver.ensure_context(device)
    base, size = driver.address_range(ptr)
    return ExportedAllocation(driver.ipc_mem_handle(base), ptr - base, size, device,
                              driver.device_uuid(device))


class EventPool:
    """``num_events`` interprocess events of one device, shared with the engine by handle."""

    def __init__(self, num_events: int, device: int = 0) -> None:
        if num_events < 1:
            raise CudaError("an event pool needs at least one event")
        self.device = device
        driver.ensure_context(device)
        self._events = [driver.create_event(interprocess=True) for _ in range(num_events)]

    def __len__(self) -> int:
        return len(self._events)

    def handles(self) -> np.ndarray:
        """One ``wire.EVENT_HANDLE`` record per event, in index order."""
        records = np.zeros(len(self._events), dtype=wire.EVENT_HANDLE)
        raw = records.view(np.uint8).reshape(len(self._events), wire.IPC_HANDLE_BYTES)
        for i, event in enumerate(self._events):
            raw[i] = np.frombuffer(driver.ipc_event_handle(event), dtype=np.uint8)
        return records

    def record(self, indices, stream: int) -> None:
        """Record each event of ``indices`` on ``stream`` (e.g. after a layer's KV is written)."""
        driver.ensure_context(self.device)
        for index in indices:
            driver.record(self._events[index], stream)

    def wait(self, indices, stream: int) -> None:
        """Make ``stream`` wait, on the GPU, for the last issued record of each event of
        ``indices``."""
        driver.ensure_context(self.device)
        for index in indices:
            driver.wait(stream, self._events[index])

    def query(self, index: int) -> bool:
        """True once the work before the last record of event ``index`` is done."""
        driver.ensure_context(self.device)
        return driver.event_done(self._events[index])

    def close(self) -> None:
        driver.ensure_context(self.device)
        for event in self._events:
            driver.destroy_event(event)
        self._events = []


def region_record(exported: ExportedAllocation, num_layers: int, num_blocks: int,
                  page_bytes: int) -> np.ndarray:
    """A one-record ``wire.REGION`` array describing ``exported`` for REGISTER.

    The region starts at the exported pointer; layer offsets are relative to it.
    """
    region = np.zeros(1, dtype=wire.REGION)
    region["kind"] = wire.RegionKind.CUDA_IPC
    region["client_device"] = exported.device
    region["gpu_uuid"] = np.void(exported.gpu_uuid)
    region["num_layers"], region["num_blocks"] = num_layers, num_blocks
    region["page_bytes"] = page_bytes
    region["base_offset"], region["alloc_bytes"] = exported.base_offset, exported.alloc_bytes
    region["handle"] = np.void(exported.handle)
    return region
