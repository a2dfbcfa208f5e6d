"""The staged copy path: pool entries packed in device memory, then one DMA per run.

Page by page, the copy engine takes a descriptor per page (20 000 for a 10k-token prefix
of an 8B model), whose issue alone holds the dispatcher for longer than the copy's share
of it (docs/benchmarks.md).  Here the pages take a detour
through a device buffer laid out like the pool (entry by entry, layer by layer inside an
entry): the gather kernel packs them at device-memory speed, and a run of consecutive pool
entries crosses PCIe as one copy, as fast as one large pinned copy (figures: "The staged
path" in ``docs/benchmarks.md``)::

    SAVE, per sub-chunk of up to ``per_buffer`` entries:
      gather stream   [wait: the buffer's last use]  gather kernel -> buffer    record packed
      copy stream     wait packed                    buffer -> pool, per run    record buffer free
    LOAD, the mirror:
      copy stream     [wait: the buffer's last use]  pool -> buffer, per run    record landed
      gather stream   wait landed                    scatter kernel -> client   record buffer free

A device has one set of buffers and one stream pair per direction, so loads never queue
behind saves, and the stream order of a direction keeps its ops in turn.  The first
sub-chunk of a SAVE waits for the client's events (per layer before that layer's
gather); a LOAD's scatter waits for its client event.  A LOAD whose client waits layer
by layer on our events is staged too (``paths.py``): every layer's event is recorded
after the last sub-chunk's scatter, so no layer is ready before the whole load.  With
``load_groups`` > 1 (``--load-layer-groups``) such a fenced LOAD goes a group of consecutive
layers at a time instead (``StagedOp.issue_grouped``), so vLLM's first layers run while the
rest is on its way: per group and sub-chunk, one copy per entry moves the group's slice of the
entry (its layers are back to back in it) into a buffer, the kernel scatters it to the
client's layers, and once the group's last sub-chunk is scattered its layers' events are
recorded, before the next group starts.  In a buffer every entry takes the room of the
largest group (``slot_bytes``), so one list of local offsets serves every group::

    LOAD by groups, per group, per sub-chunk:
      copy stream     [wait: the buffer's last use]  pool slices -> buffer, a copy per entry   record landed
      gather stream   wait landed                    scatter kernel -> client                 record buffer free
    after the group:  gather stream records the group's layer events

Such loads share the direction's one stream pair with the unfenced (asynchronous) ones.
What is not staged: an op over one layer or over layers that are not consecutive in the
pool entry, and an entry larger than a buffer.
"""

from __future__ import annotations

import numpy as np

from pegaflow.platform.cuda import driver
from pegaflow.platform.errors import CudaError
from pegaflow.platform.protocol import layer_event

from .base import CopyOp, Direction
from .checks import Region
from .cuda_device import release_all

BUFFERS_PER_DIRECTION = 2  # the gather of one sub-chunk runs while the other crosses PCIe
# ``auto`` stages pages up to this size: staged is ahead of (or level with) the copy engine
# page by page up to 256 KiB pages at every prefix length, and behind it for 1 MiB pages
# at short prefixes ("The staged path" in docs/benchmarks.md).
AUTO_MAX_PAGE_BYTES = 256 << 10


class _Side:
    """One direction's buffers and streams on one device."""

    def __init__(self, base: int, buffer_bytes: int) -> None:
        self.buffers = [base + i * buffer_bytes for i in range(BUFFERS_PER_DIRECTION)]
        self.gather_stream = driver.create_stream(low_priority=True)
        try:
            self.copy_stream = driver.create_stream(low_priority=True)
        except CudaError:
            driver.destroy_stream(self.gather_stream)
            raise
        self.free_events: list = [None] * BUFFERS_PER_DIRECTION  # each buffer's last use ends
        self.cursor = 0

    def next_buffer(self) -> int:
        index = self.cursor
        self.cursor = (self.cursor + 1) % len(self.buffers)
        return index

    def streams(self) -> tuple:
        return self.gather_stream, self.copy_stream


class DeviceStaging:
    """``total_bytes`` of device memory on the current device, half per direction."""

    def __init__(self, total_bytes: int, load_groups: int = 1) -> None:
        self.load_groups = load_groups
        buffer_bytes = total_bytes // (2 * BUFFERS_PER_DIRECTION) // 256 * 256
        if buffer_bytes <= 0:
            raise CudaError(f"device staging of {total_bytes} bytes leaves no buffer")
        self.buffer_bytes = buffer_bytes
        self._memory = driver.device_alloc(2 * BUFFERS_PER_DIRECTION * buffer_bytes)
        half = BUFFERS_PER_DIRECTION * buffer_bytes
        self.sides = {}
        try:
            for direction, base in ((Direction.SAVE, self._memory),
                                    (Direction.LOAD, self._memory + half)):
                self.sides[direction] = _Side(base, buffer_bytes)
        except CudaError:
            self.close()
            raise

    def groups_of(self, op: CopyOp) -> list[range]:
        """The layer groups ``op`` goes in, as positions in ``op.layers``: one group but for a
        fenced LOAD under ``load_groups`` > 1 (at most one layer a group)."""
        count = len(op.layers)
        if op.direction != Direction.LOAD or op.record_events is None or self.load_groups < 2:
            return [range(count)]
        bounds = np.linspace(0, count, min(self.load_groups, count) + 1).round().astype(int)
        return [range(a, b) for a, b in zip(bounds[:-1], bounds[1:])]

    def forget(self, recycled: set[int]) -> None:
        """Events of a finished op go back to the pool: a buffer whose last use was one of
        them is free (the op ended after every one of its uses)."""
        for side in self.sides.values():
            side.free_events = [None if e is not None and id(e) in recycled else e
                                for e in side.free_events]

    def close(self) -> None:
        """Streams and memory given back, each even if another fails (the first error raised)."""
        release_all([(driver.destroy_stream, s) for side in self.sides.values() for s in side.streams()]
                    + [(driver.device_free, self._memory)])


def slot_bytes(op: CopyOp, groups: list[range]) -> int:
    """The room one entry of ``op`` takes in a staging buffer by groups: its largest group's pages."""
    return max(len(group) for group in groups) * op.page_bytes


def run_bytes(op: CopyOp) -> int:
    """Bytes of one entry the op moves: its layers' pages, back to back in the entry."""
    return len(op.layers) * op.page_bytes


def can_stage(op: CopyOp, buffer_bytes: int, allow_fenced: bool = False) -> bool:
    """Whether ``op`` takes the staged path: more than one layer, consecutive in the entry,
    an entry's run fitting a buffer, and no client waiting layer by layer on our events
    unless ``allow_fenced`` (then every layer's event is recorded once the last sub-chunk is in)."""
    if op.record_events is not None and not allow_fenced or len(op.layers) < 2 or run_bytes(op) > buffer_bytes:
        return False
    first = op.layers[0].layer
    return all(p.layer == first + k for k, p in enumerate(op.layers))


def entry_runs(offsets: np.ndarray, step: int, split_bytes: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, counts)``: ``offsets`` cut where the next entry does not follow at
    ``step`` bytes, or lies in the next ``split_bytes`` of the pool (the pool is pinned
    in chunks of that size: no copy spans two registrations), each piece one copy."""
    is_cut = np.diff(offsets) != step
    if split_bytes:
        is_cut |= np.diff(offsets // split_bytes) != 0
    breaks = np.flatnonzero(is_cut) + 1
    starts = np.concatenate(([0], breaks))
    return starts, np.diff(np.concatenate((starts, [len(offsets)])))


def local_offsets(op: CopyOp, buffer_bytes: int, groups: list[range] | None = None) -> np.ndarray:
    """Where entry k of a sub-chunk lies in its buffer, for the kernel (k below the entries a
    buffer holds, or the op's own count if smaller); ``groups``: ``DeviceStaging.groups_of``."""
    step = slot_bytes(op, groups) if groups else run_bytes(op)
    return np.arange(min(buffer_bytes // step, len(op.block_ids)), dtype=np.int64) * step


def uniform_layers(op: CopyOp, regions: list[Region]) -> int | None:
    """The client-address step from one layer to the next if it is the same for all of
    the op's layers and their block strides agree (one launch covers them), else None."""
    bases = [r.base + p.offset_bytes for p, r in zip(op.layers, regions)]
    step = bases[1] - bases[0]
    if any(b - a != step for a, b in zip(bases, bases[1:])):
        return None
    if any(p.block_stride_bytes != op.layers[0].block_stride_bytes for p in op.layers):
        return None
    return step


def issue(staging: DeviceStaging, kernel, op: CopyOp, regions: list[Region], pool_base: int,
          ids_address: int, client_events: list, new_event, inflight, split_bytes: int = 0) -> None:
    """Enqueue ``op`` staged.  ``ids_address``: the op's block ids (int64, readable by the
    kernel), followed by its ``local_offsets``.  ``new_event()`` gives an engine event;
    every one used goes to ``inflight.events``, and ``inflight.done`` is recorded after
    the last copy.  ``split_bytes``: the pool's pinned chunks (``entry_runs``)."""
    StagedOp(staging, kernel, op, regions, pool_base, ids_address, client_events, new_event,
             inflight, split_bytes).issue()


class StagedOp:
    """One op through the staging buffers: per sub-chunk, the kernel packs (or scatters)
    its pages in a staging buffer and the copy engine moves the buffer in runs."""

    def __init__(self, staging: DeviceStaging, kernel, op: CopyOp, regions: list[Region], pool_base: int,
                 ids_address: int, client_events: list, new_event, inflight, split_bytes: int) -> None:
        self.kernel, self.op, self.regions = kernel, op, regions
        self.ids_address, self.client_events = ids_address, client_events
        self.new_event, self.inflight = new_event, inflight
        self.local_offsets_address = ids_address + 8 * len(op.block_ids)
        self.staging, self.pool_base = staging, pool_base
        self.side = staging.sides[op.direction]
        self.save = op.direction == Direction.SAVE
        self.step = run_bytes(op)
        self.per_buffer = staging.buffer_bytes // self.step
        self.layer_step = uniform_layers(op, regions)
        self.gather, self.copy = self.side.gather_stream, self.side.copy_stream
        inflight.streams += [self.gather, self.copy]
        self.groups = staging.groups_of(op)
        if len(self.groups) > 1:  # issue_grouped moves each entry's group slice: no runs
            return
        self.starts, self.counts = entry_runs(op.entry_offsets, self.step, split_bytes)
        self.run_of = np.repeat(np.arange(len(self.starts)), self.counts)
        self.pool_runs = op.entry_offsets[self.starts] + pool_base + op.layers[0].layer * op.page_bytes

    def issue(self) -> None:
        if len(self.groups) > 1:
            self.issue_grouped()
            return
        op, side, save, gather, copy = self.op, self.side, self.save, self.gather, self.copy
        for j, start in enumerate(range(0, len(op.block_ids), self.per_buffer)):
            count = min(self.per_buffer, len(op.block_ids) - start)
            index = side.next_buffer()
            buffer = side.buffers[index]
            if side.free_events[index] is not None:
                driver.wait(gather if save else copy, side.free_events[index])
            if save:
                self.pack(start, count, buffer, j == 0)
                driver.wait(copy, self.recorded(gather))
                self.move(start, count, buffer)
                side.free_events[index] = self.recorded(copy)
            else:
                self.move(start, count, buffer)
                driver.wait(gather, self.recorded(copy))
                self.pack(start, count, buffer, j == 0)
                side.free_events[index] = self.recorded(gather)
        if op.record_events is None:
            self.inflight.done = side.free_events[index]
            return
        for k in range(len(op.layers)):  # a fenced LOAD: every layer is in with the last scatter
            driver.record(self.client_events[layer_event(op.record_events, k)], gather)
        self.inflight.done = self.recorded(gather)  # done once the client's events are recorded too

    def recorded(self, stream):
        event = self.new_event()
        self.inflight.events.append(event)
        driver.record(event, stream)
        return event

    def move(self, start: int, count: int, buffer: int) -> None:
        """The copy engine's part: the sub-chunk between its staging buffer and the pool."""
        starts, counts, step = self.starts, self.counts, self.step
        runs = slice(self.run_of[start], self.run_of[start + count - 1] + 1)  # run_of: 0, 0, 1, 2, 2, ...
        lo = np.maximum(starts[runs], start)
        hi = np.minimum(starts[runs] + counts[runs], start + count)
        pool = self.pool_runs[runs] + (lo - starts[runs]) * step
        local = buffer + (lo - start) * step
        dst, src = (pool, local) if self.save else (local, pool)
        if len(lo) == 1:
            driver.memcpy_async(int(dst[0]), int(src[0]), int(hi[0] - lo[0]) * step, self.copy)
        else:
            driver.memcpy_batch_async(dst, src, (hi - lo) * step, self.copy)

    def pack(self, start: int, count: int, buffer: int, first: bool) -> None:
        """The kernel's part: the sub-chunk's pages between the client's layers and its buffer
        (the first sub-chunk of a SAVE waits for the client's events first)."""
        op, regions, gather = self.op, self.regions, self.gather
        ids = self.ids_address + 8 * start
        if self.layer_step is not None and not (first and op.wait_per_layer):
            if first and op.wait_event is not None:  # one event for the whole op
                driver.wait(gather, self.client_events[op.wait_event])
            base = regions[0].base + op.layers[0].offset_bytes
            self.kernel.launch(gather, ids, self.local_offsets_address, count, base,
                               op.layers[0].block_stride_bytes, buffer, op.page_bytes, self.save,
                               len(op.layers), self.layer_step, op.page_bytes)
            return
        for k, (layer, region) in enumerate(zip(op.layers, regions)):
            if first and op.wait_event is not None and (k == 0 or op.wait_per_layer):
                event = layer_event(op.wait_event, k) if op.wait_per_layer else op.wait_event
                driver.wait(gather, self.client_events[event])
            self.kernel.launch(gather, ids, self.local_offsets_address, count,
                               region.base + layer.offset_bytes, layer.block_stride_bytes,
                               buffer + k * op.page_bytes, op.page_bytes, self.save)

    def issue_grouped(self) -> None:
        """A fenced LOAD enqueued group by group, each group's layer events recorded as it lands."""
        op, side, gather, copy = self.op, self.side, self.gather, self.copy
        slot = slot_bytes(op, self.groups)
        per_buffer = self.staging.buffer_bytes // slot
        first = True
        for group in self.groups:
            for start in range(0, len(op.block_ids), per_buffer):
                count = min(per_buffer, len(op.block_ids) - start)
                index = side.next_buffer()
                buffer = side.buffers[index]
                if side.free_events[index] is not None:
                    driver.wait(copy, side.free_events[index])
                entries = op.entry_offsets[start:start + count]
                src = self.pool_base + entries + (op.layers[0].layer + group.start) * op.page_bytes
                dst = buffer + np.arange(count, dtype=np.int64) * slot
                driver.memcpy_batch_async(dst, src, len(group) * op.page_bytes, copy)
                driver.wait(gather, self.recorded(copy))
                self.scatter_group(group, start, count, buffer, first)
                first = False
                side.free_events[index] = self.recorded(gather)
            for k in group:  # the group is in: its layers may run
                driver.record(self.client_events[layer_event(op.record_events, k)], gather)
        self.inflight.done = self.recorded(gather)

    def scatter_group(self, group: range, start: int, count: int, buffer: int, first: bool) -> None:
        """The kernel's part for one group: its pages from the buffer to the client's layers (the
        LOAD's first scatter waits for the client's event first, with AFTER_CLIENT)."""
        op, regions, gather = self.op, self.regions, self.gather
        if first and op.wait_event is not None:
            driver.wait(gather, self.client_events[op.wait_event])
        ids = self.ids_address + 8 * start
        offsets = self.local_offsets_address
        if self.layer_step is not None:
            a = group.start
            self.kernel.launch(gather, ids, offsets, count, regions[a].base + op.layers[a].offset_bytes,
                               op.layers[a].block_stride_bytes, buffer, op.page_bytes, False, len(group),
                               self.layer_step, op.page_bytes)
            return
        for k in group:
            self.kernel.launch(gather, ids, offsets, count, regions[k].base + op.layers[k].offset_bytes,
                               op.layers[k].block_stride_bytes, buffer + (k - group.start) * op.page_bytes,
                               op.page_bytes, False)
