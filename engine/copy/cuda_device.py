"""Per-process CUDA state of the copy backend: each GPU's streams, events and kernel, the
client allocations opened through IPC (once per device), and the pinned pool (registered a
chunk at a time, each page written once by DMA)."""

from __future__ import annotations

import logging

from pegaflow.platform.cuda import driver
from pegaflow.platform.errors import CudaError

from .base import COPY_ENGINE, KERNEL, Direction
from .kernels import CopyKernel

logger = logging.getLogger(__name__)

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

    def release(self, device: int, handle: bytes) -> int | None:
        """One reference let go; the address to unmap (``driver.close_ipc_mem``, by the
        caller, on ``device``) once it was the last, else None."""
        entry = self._open[(device, handle)]
        entry[1] -= 1
        if entry[1] == 0:
            del self._open[(device, handle)]
            return entry[0]
        return None


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


class DmaWriter:
    """Writes pinned pool memory once by DMA, on the current device: each chunk is read into
    device memory and written back, so its bytes do not change.

    The copy engine's first write to a host page is slower than the later ones (reads are
    not affected; figures in docs/benchmarks.md), and once per page is enough: this moves
    that cost from the first SAVEs to the pinning of the pool, a small part next to
    faulting it in and pinning it.  Written from one GPU: whether a page written by one
    GPU is also faster for another was not measured.  Its buffers and streams are made once
    and serve every chunk (``close`` gives them back).
    """

    def __init__(self, max_bytes: int) -> None:
        self.chunk = min(_DMA_CHUNK, max_bytes)
        self._buffers, self._streams = [], []
        try:
            for _ in range(2):  # two chunks in flight: reads and writes share the duplex link
                self._buffers.append(driver.device_alloc(self.chunk))
                self._streams.append(driver.create_stream(low_priority=False))
        except CudaError:
            self.close()
            raise

    def write(self, device_address: int, size: int) -> None:
        """Read ``[device_address, +size)`` (pinned, mapped host memory) into device memory
        and write it back; returns when the writes are done."""
        try:
            for i, start in enumerate(range(0, size, self.chunk)):
                num_bytes = min(self.chunk, size - start)
                buffer, stream = self._buffers[i % 2], self._streams[i % 2]
                driver.memcpy_async(buffer, device_address + start, num_bytes, stream)
                driver.memcpy_async(device_address + start, buffer, num_bytes, stream)
        finally:  # nothing of it may still run when this returns (or raises)
            release_all([(driver.synchronize_stream, s) for s in self._streams])

    def close(self) -> None:
        """Streams and buffers given back, each even if another fails (the first error raised)."""
        streams, buffers, self._streams, self._buffers = self._streams, self._buffers, [], []
        release_all([(driver.synchronize_stream, s) for s in streams]
                    + [(driver.destroy_stream, s) for s in streams]
                    + [(driver.device_free, b) for b in buffers])


class PinnedPool:
    """The pool as the CUDA backend pins it: registered a chunk at a time, each page written
    once by DMA, every registration undone at the end.

        pin(start, num_bytes)     the pinning thread: cuMemHostRegister (PORTABLE |
                                  DEVICEMAP) of one chunk, then a DMA write of its pages
        check(pool_base, a, b)    the dispatcher: every chunk from ``a`` to ``b`` lies at
                                  ``pool_base`` + its offset in the current context
        close()                   once the pinning thread is over: cuMemHostUnregister of
                                  each registration, exactly those made

    Kernels and copies address the pool as one ``pool_base`` plus an offset, whichever
    registration a page is in.  With unified addressing (CUDA IPC needs it) a registered
    range's device address is its host address, so the chunks line up; ``check`` makes sure
    of it per chunk and device, and a chunk that does not is never used.  No copy spans two
    registrations: a page lies in one entry, an entry in one slab, chunks are whole slabs,
    and the staged path cuts its runs at chunk ends (``unit``).
    """

    def __init__(self, address: int, size: int, device: int) -> None:
        self.address, self.size, self.device = address, size, device
        self.chunks: list[tuple[int, int]] = []  # (offset, size) registered, in order
        self.unit = 0  # the first chunk's size: every chunk starts at a multiple of it
        self._writer: DmaWriter | None = None

    def pin(self, start: int, num_bytes: int) -> None:
        """Register and write once ``[start, +num_bytes)``; on failure nothing of it stays
        registered (CudaError)."""
        assert start == sum(n for _, n in self.chunks), "chunks are pinned in order"
        driver.use_device(self.device)  # this thread's context: the device's primary one
        if self._writer is None:
            self._writer = DmaWriter(num_bytes)
        driver.host_register(self.address + start, num_bytes)
        try:
            self._writer.write(driver.host_device_pointer(self.address + start), num_bytes)
        except CudaError:
            try:
                driver.host_unregister(self.address + start)
            except CudaError:
                logger.exception("unpinning %d bytes at %d after a failed DMA write", num_bytes, start)
            raise
        self.unit = self.unit or num_bytes
        self.chunks.append((start, num_bytes))
        if start + num_bytes == self.size:
            self._close_writer()

    def check(self, pool_base: int, start: int, end: int) -> None:
        """CudaError unless every chunk starting in ``[start, end)`` lies at ``pool_base`` +
        its offset in the current context's address space."""
        for offset, _ in self.chunks:
            if not start <= offset < end:
                continue
            found = driver.host_device_pointer(self.address + offset)
            if found != pool_base + offset:
                raise CudaError(f"the pool's chunk at {offset} is at device address {found:#x}, "
                                f"not {pool_base + offset:#x}: kernels could not address it")

    def close(self) -> None:
        """Every registration undone (each even if another fails; the first error raised)."""
        driver.use_device(self.device)
        chunks, self.chunks = self.chunks, []
        steps = [(driver.host_unregister, self.address + offset) for offset, _ in chunks]
        if self._writer is not None:
            steps.append((lambda writer: writer.close(), self._writer))
            self._writer = None
        release_all(steps)

    def _close_writer(self) -> None:
        writer, self._writer = self._writer, None
        writer.close()


def release_all(steps) -> None:
    first = None
    for release, what in steps:
        try:
            release(what)
        except CudaError as exc:
            first = first or exc
    if first is not None:
        raise first
