"""Per-process CUDA state of the copy backend: each GPU's streams, events and kernel, the
client allocations opened through IPC (once per device), and readying the pool (pre-faulting
it, then one DMA write of every page)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from engine.copy.base import COPY_ENGINE, KERNEL, Direction
from engine.copy.kernels import CopyKernel
from pegaflow.cuda import driver
from pegaflow.errors import CudaError

_TOUCH_STRIDE = 4096
_DMA_CHUNK = 64 << 20


class IpcMappings:
    """Each client allocation is opened once per process and device, shared by count
    (a second ``cuIpcOpenMemHandle`` of one allocation in one context fails)."""

    def __init__(self) -> None:
        self._open: dict[tuple[int, bytes], list[int]] = {}  # -> [address, references]

    def acquire(self, device: int, handle: bytes) -> int:
        entry = self._open.get((device, handle))
        if entry is None:
            entry = self._open[(device, handle)] = [driver.open_ipc_mem(handle), 0]
        entry[1] += 1
        return entry[0]

    def release(self, device: int, handle: bytes) -> None:
        entry = self._open[(device, handle)]
        entry[1] -= 1
        if entry[1] == 0:
            del self._open[(device, handle)]
            driver.close_ipc_mem(entry[0])


MAPPINGS = IpcMappings()


class Device:
    """One GPU: its primary context, layer streams, compiled kernel and idle events."""

    def __init__(self, device: int, num_ctas: int) -> None:
        self.device = device
        driver.use_device(device)
        self.kernel = CopyKernel(device, num_ctas)
        self.streams: dict[tuple[int, Direction], object] = {}
        self.idle_events: list = []
        # Per path, the events of the latest SAVE layer copies, oldest first.
        self.save_chains: dict[str, list] = {KERNEL: [], COPY_ENGINE: []}
        self.paths: dict[tuple[int, Direction], str] = {}
        self.unmeasured: set[int] = set()  # page sizes whose measurement waits for a quiet moment
        self.pool_base = 0
        self.staging = None  # a staged.DeviceStaging, when the staged path is on

    def stream(self, layer: int, direction: Direction):
        stream = self.streams.get((layer, direction))
        if stream is None:
            stream = self.streams[(layer, direction)] = driver.create_stream(low_priority=True)
        return stream

    def event(self):
        return self.idle_events.pop() if self.idle_events else driver.create_event()

    def close(self) -> None:
        driver.use_device(self.device)
        for stream in self.streams.values():
            driver.destroy_stream(stream)
        for event in self.idle_events:
            driver.destroy_event(event)
        if self.staging is not None:
            self.staging.close()
            self.staging = None
        self.kernel.close()


def prefault(segment, num_threads: int) -> None:
    """Fault every page of ``segment`` in, in parallel, without changing a byte."""
    view = segment.array(np.uint8, segment.size)
    chunk = -(-segment.size // num_threads // _TOUCH_STRIDE) * _TOUCH_STRIDE or _TOUCH_STRIDE

    def touch(start: int) -> None:
        part = view[start:start + chunk:_TOUCH_STRIDE]
        np.bitwise_or(part, 0, out=part)

    with ThreadPoolExecutor(num_threads) as pool:
        list(pool.map(touch, range(0, segment.size, chunk)))


def dma_write_once(pool_base: int, size: int) -> None:
    """Read the registered pool (device address ``pool_base``) into device memory and write
    it back by DMA, on the current device: the bytes do not change.

    The copy engine's first write to a host page is slower than the later ones (reads are
    not affected; figures in docs/benchmarks.md), and once per page is enough: this moves
    that cost from the first SAVEs to the engine's start, where it is a small part next to
    faulting the pool in and pinning it.  Written from one GPU: whether a page written
    by one GPU is also faster for another was not measured.
    """
    chunk = min(_DMA_CHUNK, size)
    buffers, streams = [], []
    try:
        for _ in range(2):  # two chunks in flight: reads and writes share the duplex link
            buffers.append(driver.device_alloc(chunk))
            streams.append(driver.create_stream(low_priority=False))
        for i, start in enumerate(range(0, size, chunk)):
            num_bytes = min(chunk, size - start)
            buffer, stream = buffers[i % 2], streams[i % 2]
            driver.memcpy_async(buffer, pool_base + start, num_bytes, stream)
            driver.memcpy_async(pool_base + start, buffer, num_bytes, stream)
    finally:  # every resource released even if one release fails; the first error raised
        release_all([(driver.synchronize_stream, s) for s in streams]
                     + [(driver.destroy_stream, s) for s in streams]
                     + [(driver.device_free, b) for b in buffers])


def release_all(steps) -> None:
    first = None
    for release, what in steps:
        try:
            release(what)
        except CudaError as exc:
            first = first or exc
    if first is not None:
        raise first
