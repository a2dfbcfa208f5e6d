"""engine.copy.cuda_clients against a fake driver (no GPU): a slot's allocations are mapped
once per (device, handle) and unmapped with the slot, its events opened on each device its
memory is on and destroyed with it, and a malformed region is refused before anything opens."""

from __future__ import annotations

import numpy as np
import pytest

from engine.copy import cuda_clients
from pegaflow.platform import wire
from pegaflow.platform.errors import CudaError


class FakeDriver:
    def __init__(self, monkeypatch):
        self.mapped: dict[bytes, int] = {}
        self.events: list = []
        monkeypatch.setattr(cuda_clients.driver, "use_device", lambda device: None)
        monkeypatch.setattr(cuda_clients.driver, "open_ipc_event", self.open_event)
        monkeypatch.setattr(cuda_clients.driver, "destroy_event", self.events.remove)
        monkeypatch.setattr(cuda_clients.MAPPINGS, "acquire", self.acquire)
        monkeypatch.setattr(cuda_clients.MAPPINGS, "release", lambda device, handle: self.mapped.pop(handle))
        self.unmapped: list[int] = []
        monkeypatch.setattr(cuda_clients.driver, "close_ipc_mem", self.unmapped.append)

    def acquire(self, device: int, handle: bytes) -> int:
        self.mapped[handle] = 0x7000_0000 + 0x100_0000 * len(self.mapped)
        return self.mapped[handle]

    def open_event(self, handle: bytes):
        event = (handle, len(self.events))
        self.events.append(event)
        return event


def _region(handle: bytes, offset: int = 0, kind=wire.RegionKind.CUDA_IPC) -> np.void:
    r = np.zeros(1, wire.REGION)[0]
    r["kind"], r["client_device"], r["base_offset"], r["alloc_bytes"] = kind, 0, offset, 1 << 20
    r["handle"] = handle.ljust(wire.IPC_HANDLE_BYTES, b"\0")
    return r


def _handles(n: int) -> np.ndarray:
    h = np.zeros(n, wire.EVENT_HANDLE)
    for i in range(n):
        h[i]["handle"] = bytes([i + 1]).ljust(wire.IPC_HANDLE_BYTES, b"\0")
    return h


def test_client_mappings_slot_is_mapped_with_its_events_and_closed_whole(monkeypatch):
    fake = FakeDriver(monkeypatch)
    m = cuda_clients.ClientMappings()
    m.map_region(3, 0, _region(b"a", offset=4096), device=0)
    m.set_events(3, _handles(4))
    region = m.regions[(3, 0)]
    assert region.base == fake.mapped[b"a".ljust(wire.IPC_HANDLE_BYTES, b"\0")] + 4096
    assert region.extent == (1 << 20) - 4096
    assert m.num_events(3) == 4 and len(m.events(3, 0)) == 4 and len(fake.events) == 4
    assert m.slots == {3}
    address = fake.mapped[b"a".ljust(wire.IPC_HANDLE_BYTES, b"\0")]
    # Forgotten at once; the driver calls that let go are the caller's to run (in order).
    steps = m.close_slot(3)
    assert m.regions == {} and fake.mapped == {} and m.num_events(3) == 0 and m.slots == set()
    assert len(fake.events) == 4 and fake.unmapped == []
    for release, handle in steps:
        release(handle)
    assert fake.events == [] and fake.unmapped == [address]


def test_client_mappings_new_event_pool_replaces_the_old_one(monkeypatch):
    fake = FakeDriver(monkeypatch)
    m = cuda_clients.ClientMappings()
    m.map_region(1, 0, _region(b"a"), device=0)
    m.set_events(1, _handles(2))
    m.set_events(1, _handles(3))
    assert len(fake.events) == 3 and m.num_events(1) == 3


@pytest.mark.parametrize("region", [_region(b"a", kind=wire.RegionKind.HOST_SHM),
                                    _region(b"a", offset=1 << 20)])
def test_check_region_refuses_other_kinds_and_offsets_past_the_allocation(region):
    with pytest.raises(CudaError):
        cuda_clients.check_region(region)
