"""cuda_device.PinnedPool (the pool pinned a chunk at a time) and the CUDA backend's growing
usable part, on a stand-in driver that records every call (no GPU needed)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from engine.copy import cuda, cuda_clients, cuda_device
from engine.copy.base import CopyOp, Direction, LayerPlacement
from engine.copy.checks import Region
from pegaflow.platform.errors import CommandError, CudaError
from pegaflow.platform.wire import Status

BASE, MIB = 0x7F0000000000, 1 << 20


class FakeDriver:
    """Registrations, DMA copies and device pointers as the driver would see them."""

    def __init__(self, monkeypatch, device_offset: int = 0):
        self.registered: dict[int, int] = {}  # address -> size
        self.calls: list[tuple] = []
        self.device_offset = device_offset  # where a registration lands in device space
        self.fail_copy = False
        for name in ("use_device", "host_register", "host_unregister", "host_device_pointer",
                     "device_alloc", "device_free", "create_stream", "destroy_stream",
                     "memcpy_async", "synchronize_stream"):
            monkeypatch.setattr(cuda_device.driver, name, getattr(self, name))

    def use_device(self, device): pass
    def device_alloc(self, size): return 1 << 40
    def device_free(self, ptr): self.calls.append(("free", ptr))
    def create_stream(self, low_priority=True): return object()
    def destroy_stream(self, stream): pass
    def synchronize_stream(self, stream): pass

    def host_register(self, address, size):
        assert not any(a <= address < a + n for a, n in self.registered.items()), "registered twice"
        self.registered[address] = size
        self.calls.append(("register", address, size))

    def host_unregister(self, address):
        del self.registered[address]
        self.calls.append(("unregister", address))

    def host_device_pointer(self, address):
        assert any(a <= address < a + n for a, n in self.registered.items()), "not registered"
        return address + self.device_offset * (address != BASE)

    def memcpy_async(self, dst, src, size, stream):
        if self.fail_copy:
            raise CudaError("cuMemcpyAsync: CUDA_ERROR_ILLEGAL_ADDRESS")
        self.calls.append(("copy", dst, src, size))


def test_pinned_pool_chunks_registered_in_order_each_written_once_and_unregistered_at_close(monkeypatch):
    fake = FakeDriver(monkeypatch)
    monkeypatch.setattr(cuda_device, "_DMA_CHUNK", 3 * MIB)
    pinned = cuda_device.PinnedPool(BASE, 10 * MIB, device=0)
    # 1. Three chunks (the last a short one): one registration each, at its place.
    for start, size in ((0, 4 * MIB), (4 * MIB, 4 * MIB), (8 * MIB, 2 * MIB)):
        pinned.pin(start, size)
    assert [c for c in fake.calls if c[0] == "register"] == [
        ("register", BASE, 4 * MIB), ("register", BASE + 4 * MIB, 4 * MIB),
        ("register", BASE + 8 * MIB, 2 * MIB)]
    assert pinned.chunks == [(0, 4 * MIB), (4 * MIB, 4 * MIB), (8 * MIB, 2 * MIB)] and pinned.unit == 4 * MIB
    # 2. Every pool byte written back by DMA exactly once, none outside a chunk it is in.
    writes = sorted((dst - BASE, n) for kind, dst, _, n in (c for c in fake.calls if c[0] == "copy")
                    if dst >= BASE)
    assert sum(n for _, n in writes) == 10 * MIB
    assert [d for d, _ in writes] == list(np.cumsum([0] + [n for _, n in writes[:-1]]))
    assert all(d // (4 * MIB) == (d + n - 1) // (4 * MIB) for d, n in writes)
    # 3. The DMA buffers went back after the last chunk; close unpins exactly what was pinned.
    assert sum(1 for c in fake.calls if c[0] == "free") == 2
    pinned.close()
    assert fake.registered == {} and pinned.chunks == []
    assert sorted(c[1] for c in fake.calls if c[0] == "unregister") == [
        BASE, BASE + 4 * MIB, BASE + 8 * MIB]


def test_pinned_pool_failed_dma_write_leaves_that_chunk_unpinned(monkeypatch):
    fake = FakeDriver(monkeypatch)
    pinned = cuda_device.PinnedPool(BASE, 8 * MIB, device=0)
    pinned.pin(0, 4 * MIB)
    # 1. The second chunk's DMA write fails: CudaError, and that chunk is unregistered again.
    fake.fail_copy = True
    with pytest.raises(CudaError, match="ILLEGAL_ADDRESS"):
        pinned.pin(4 * MIB, 4 * MIB)
    assert fake.registered == {BASE: 4 * MIB} and pinned.chunks == [(0, 4 * MIB)]
    # 2. Close unpins the first only, and gives the DMA buffers back.
    pinned.close()
    assert fake.registered == {} and sum(1 for c in fake.calls if c[0] == "free") == 2


def test_pinned_pool_chunk_at_another_device_address_is_refused(monkeypatch):
    # 1. A driver that maps every chunk but the first 1 MiB off its host address.
    FakeDriver(monkeypatch, device_offset=MIB)
    pinned = cuda_device.PinnedPool(BASE, 8 * MIB, device=0)
    pinned.pin(0, 4 * MIB)
    pinned.pin(4 * MIB, 4 * MIB)
    # 2. The first chunk lines up with the pool's base; the second does not: refused.
    pinned.check(BASE, 0, 4 * MIB)
    with pytest.raises(CudaError, match="chunk at 4194304 is at device address"):
        pinned.check(BASE, 4 * MIB, 8 * MIB)
    pinned.close()


def _backend(fake, pool_bytes: int) -> "cuda.CudaBackend":
    """A CudaBackend without a GPU: one device, an opened pool, one client region."""
    backend = object.__new__(cuda.CudaBackend)
    backend._pool, backend._usable_bytes = (BASE, pool_bytes), 0
    backend._pinned = cuda_device.PinnedPool(BASE, pool_bytes, 0)
    backend._devices = {0: SimpleNamespace(device=0, pool_base=0)}
    backend._clients = cuda_clients.ClientMappings()
    backend._clients.regions[(0, 0)] = Region(0, b"h", 1 << 40, 1 << 30)
    return backend


def _load(entry_offset: int) -> CopyOp:
    return CopyOp(1, Direction.LOAD, 0, [LayerPlacement(0, 0, 0, 4096)], 4096,
                  np.array([0], np.int64), np.array([entry_offset], np.int64))


def test_cuda_backend_copies_only_into_the_part_it_was_told_is_pinned(monkeypatch):
    fake = FakeDriver(monkeypatch)
    monkeypatch.setattr(cuda.driver, "use_device", fake.use_device)
    backend = _backend(fake, 8 * MIB)
    backend._pinned.pin(0, 4 * MIB)
    # 1. Before extend_pool: no pool page is open to copies (the entry is past the open part).
    with pytest.raises(CommandError, match="leave the pool") as info:
        backend._validate(_load(0))
    assert info.value.status == Status.BLOCK_OUT_OF_RANGE
    # 2. The first chunk opened: pages in it pass, pages of the second (pinned or not) do not.
    backend.extend_pool(4 * MIB)
    assert backend._devices[0].pool_base == BASE
    backend._validate(_load(4 * MIB - 4096))
    backend._pinned.pin(4 * MIB, 4 * MIB)
    with pytest.raises(CommandError, match="leave the pool") as info:
        backend._validate(_load(4 * MIB))
    assert info.value.status == Status.BLOCK_OUT_OF_RANGE
    backend.extend_pool(8 * MIB)
    backend._validate(_load(8 * MIB - 4096))
    backend._pinned.close()
