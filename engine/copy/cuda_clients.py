"""What the CUDA copy backend holds open for each client slot: its KV allocations, mapped
through their IPC memory handles (``MAPPINGS`` shares one mapping per allocation and
device), and its pool of IPC events, opened on each device the slot's memory lives on.

Mechanism only: which copies may run, and when a slot may be closed, is the backend's.
"""

from __future__ import annotations

import numpy as np

from pegaflow.platform.cuda import driver
from pegaflow.platform.errors import CudaError
from pegaflow.platform.wire import RegionKind

from .checks import Region
from .cuda_device import MAPPINGS


def check_region(region: np.void) -> None:
    """A CUDA_IPC record whose offset lies inside its allocation, or CudaError."""
    if int(region["kind"]) != RegionKind.CUDA_IPC:
        raise CudaError(f"region kind {int(region['kind'])} is not CUDA_IPC")
    if int(region["base_offset"]) >= int(region["alloc_bytes"]):
        raise CudaError(f"region offset {int(region['base_offset'])} is past its allocation "
                        f"({int(region['alloc_bytes'])})")


class ClientMappings:
    def __init__(self) -> None:
        self.regions: dict[tuple[int, int], Region] = {}  # (slot, region id) -> its mapping
        self._event_handles: dict[int, list[bytes]] = {}
        self._events: dict[tuple[int, int], list] = {}  # (slot, device) -> opened events

    @property
    def slots(self) -> set[int]:
        return {k[0] for k in self.regions} | set(self._event_handles)

    def num_events(self, slot: int) -> int:
        return len(self._event_handles.get(slot, ()))

    def map_region(self, slot: int, region_id: int, region: np.void, device: int) -> None:
        """Open ``region`` (``check_region`` passed) on ``device``, in place of any earlier
        one of that id, and the slot's events there."""
        base_offset, alloc_bytes = int(region["base_offset"]), int(region["alloc_bytes"])
        handle = region["handle"].tobytes()
        address = MAPPINGS.acquire(device, handle)
        self._drop_region((slot, region_id))
        self.regions[(slot, region_id)] = Region(device, handle, address + base_offset,
                                                  alloc_bytes - base_offset)
        self.events(slot, device)

    def set_events(self, slot: int, handles: np.ndarray) -> None:
        """The slot's event pool, replacing its earlier one, opened where its memory is."""
        self._close_events(slot)
        self._event_handles[slot] = [h.tobytes() for h in handles["handle"]]
        for device in {r.device for (s, _), r in self.regions.items() if s == slot}:
            self.events(slot, device)

    def events(self, slot: int, device: int) -> list:
        """The slot's events opened on ``device`` (opened now if they were not)."""
        handles = self._event_handles.get(slot)
        if handles is None:
            return []
        events = self._events.get((slot, device))
        if events is None:
            driver.use_device(device)
            events = self._events[(slot, device)] = [driver.open_ipc_event(h) for h in handles]
        return events

    def close_slot(self, slot: int) -> list:
        """Forget the slot's memory and events (no copy of it may still run); returns the
        driver calls that let go of them, in order (``(release, handle)``, each device made
        current first), for the caller to run: at once, or off the engine's thread for a
        gone client (``releases.py``)."""
        steps = []
        for key in [k for k in self.regions if k[0] == slot]:
            steps += self._forget_region(key)
        steps += self._forget_events(slot)
        self._event_handles.pop(slot, None)
        return steps

    def _drop_region(self, key: tuple[int, int]) -> None:
        for release, handle in self._forget_region(key):
            release(handle)

    def _forget_region(self, key: tuple[int, int]) -> list:
        region = self.regions.pop(key, None)
        address = None if region is None else MAPPINGS.release(region.device, region.handle)
        return [] if address is None else [(driver.use_device, region.device), (driver.close_ipc_mem, address)]

    def _close_events(self, slot: int) -> None:
        for release, handle in self._forget_events(slot):
            release(handle)

    def _forget_events(self, slot: int) -> list:
        steps = []
        for key in [k for k in self._events if k[0] == slot]:
            steps.append((driver.use_device, key[1]))
            steps += [(driver.destroy_event, event) for event in self._events.pop(key)]
        return steps
