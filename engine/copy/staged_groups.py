"""A fenced staged LOAD a layer group at a time (``--load-layer-groups``, ``staged.py``).

vLLM's forward waits on our event of each layer before that layer's attention.  Staged as one
piece, a LOAD records every layer's event after its last sub-chunk: the forward's first layer
waits for the whole load.  Here the LOAD goes a group of consecutive layers at a time: per group
and sub-chunk, one copy per entry moves the group's slice of the entry (its layers are back to
back in it) into a staging buffer, the kernel scatters it to the client's layers, and once the
group's last sub-chunk is scattered its layers' events are recorded, before the next group
starts.  In a buffer every entry takes the room of the largest group (``slot_bytes``), so one
list of local offsets serves every group::

    per group, per sub-chunk:
      copy stream     [wait: the buffer's last use]  pool slices -> buffer, a copy per entry   record landed
      gather stream   wait landed                    scatter kernel -> client                 record buffer free
    after the group:  gather stream records the group's layer events
"""

from __future__ import annotations

import numpy as np

from pegaflow.platform.cuda import driver
from pegaflow.platform.protocol import layer_event

from .base import CopyOp


def slot_bytes(op: CopyOp, groups: list[range]) -> int:
    """The room one entry of ``op`` takes in a staging buffer: its largest group's pages."""
    return max(len(group) for group in groups) * op.page_bytes


def issue_grouped(staged_op, groups: list[range]) -> None:
    """Enqueue ``staged_op`` (a ``staged._StagedOp`` of a fenced LOAD) group by group."""
    op, side, gather, copy = staged_op.op, staged_op.side, staged_op.gather, staged_op.copy
    slot = slot_bytes(op, groups)
    per_buffer = staged_op.staging.buffer_bytes // slot
    first = True
    for group in groups:
        for start in range(0, len(op.block_ids), per_buffer):
            count = min(per_buffer, len(op.block_ids) - start)
            index = side.next_buffer()
            buffer = side.buffers[index]
            if side.free_events[index] is not None:
                driver.wait(copy, side.free_events[index])
            entries = op.entry_offsets[start:start + count]
            src = staged_op.pool_base + entries + (op.layers[0].layer + group.start) * op.page_bytes
            dst = buffer + np.arange(count, dtype=np.int64) * slot
            driver.memcpy_batch_async(dst, src, len(group) * op.page_bytes, copy)
            driver.wait(gather, staged_op.recorded(copy))
            scatter_group(staged_op, group, start, count, buffer, first)
            first = False
            side.free_events[index] = staged_op.recorded(gather)
        for k in group:  # the group is in: its layers may run
            driver.record(staged_op.client_events[layer_event(op.record_events, k)], gather)
    staged_op.inflight.done = staged_op.recorded(gather)


def scatter_group(staged_op, group: range, start: int, count: int, buffer: int, first: bool) -> None:
    """The kernel's part for one group: its pages from the buffer to the client's layers (the
    LOAD's first scatter waits for the client's event first, with AFTER_CLIENT)."""
    op, regions, gather, kernel = staged_op.op, staged_op.regions, staged_op.gather, staged_op.kernel
    if first and op.wait_event is not None:
        driver.wait(gather, staged_op.client_events[op.wait_event])
    ids = staged_op.ids_address + 8 * start
    offsets = staged_op.local_offsets_address
    if staged_op.layer_step is not None:
        a = group.start
        kernel.launch(gather, ids, offsets, count, regions[a].base + op.layers[a].offset_bytes,
                      op.layers[a].block_stride_bytes, buffer, op.page_bytes, False, len(group),
                      staged_op.layer_step, op.page_bytes)
        return
    for k in group:
        kernel.launch(gather, ids, offsets, count, regions[k].base + op.layers[k].offset_bytes,
                      op.layers[k].block_stride_bytes, buffer + (k - group.start) * op.page_bytes,
                      op.page_bytes, False)
