"""What a copy op must satisfy before any of its copies is issued: every region known and
on one device, every page inside its allocation and inside the pool, every event inside the
client's pool.  A copy outside its memory would fault the GPU or overwrite bytes that are
not the client's, so the CUDA backend refuses such an op whole (``CommandError``)."""

from __future__ import annotations

from dataclasses import dataclass

from pegaflow.platform.errors import CommandError
from pegaflow.platform.wire import Status

from .base import CopyOp


@dataclass(slots=True)
class Region:
    """A client allocation as the backend opened it."""

    device: int
    handle: bytes
    base: int    # our address of the region's first byte
    extent: int  # bytes from ``base`` to the end of the allocation


def check_op(op: CopyOp, regions: dict[tuple[int, int], Region], pool_bytes: int | None,
             num_events: int) -> list[Region]:
    """The regions of ``op``'s layers, in order; raises if any part of it is out of bounds.
    ``regions`` maps (slot, region id) to what is open, ``pool_bytes`` is None without a
    pool, ``num_events`` is the size of the slot's event pool."""
    if pool_bytes is None:
        raise CommandError(Status.INTERNAL, "no pool attached")
    if len(op.block_ids) != len(op.entry_offsets) or not op.layers:
        raise CommandError(Status.BAD_PAYLOAD, "block ids, entry offsets and layers disagree")
    found = [regions.get((op.slot, layer.region_id)) for layer in op.layers]
    if None in found:
        raise CommandError(Status.UNKNOWN_REGION, f"slot {op.slot}: unknown region")
    if len({r.device for r in found}) != 1:
        raise CommandError(Status.BAD_ARGUMENT, "one op spans several devices")
    check_events(op, num_events)
    if len(op.block_ids):
        check_bounds(op, found, pool_bytes)
    return found


def check_bounds(op: CopyOp, regions: list[Region], pool_bytes: int) -> None:
    """Every client page inside its region's allocation, every pool page inside the pool."""
    b_lo, b_hi = int(op.block_ids.min()), int(op.block_ids.max())
    for layer, region in zip(op.layers, regions):
        ends = (b_lo * layer.block_stride_bytes, b_hi * layer.block_stride_bytes)
        if layer.offset_bytes + min(ends) < 0 or \
                layer.offset_bytes + max(ends) + op.page_bytes > region.extent:
            raise CommandError(Status.BLOCK_OUT_OF_RANGE,
                               f"layer {layer.layer}: blocks {b_lo}..{b_hi} leave the region")
    e_lo, e_hi = int(op.entry_offsets.min()), int(op.entry_offsets.max())
    l_hi = max(layer.layer for layer in op.layers)
    if e_lo < 0 or min(layer.layer for layer in op.layers) < 0 or \
            e_hi + (l_hi + 1) * op.page_bytes > pool_bytes:
        raise CommandError(Status.BLOCK_OUT_OF_RANGE, "pool entries leave the pool")


def check_events(op: CopyOp, num_events: int) -> None:
    """The events ``op`` waits on or records lie in the client's pool of ``num_events``."""
    if op.wait_event is None and op.record_events is None:
        return
    last_wait = (op.wait_event or 0) + (len(op.layers) - 1 if op.wait_per_layer else 0)
    if op.wait_event is not None and not 0 <= op.wait_event <= last_wait < num_events:
        raise CommandError(Status.BAD_ARGUMENT, f"wait event {op.wait_event} of {num_events}")
    if op.record_events is not None and \
            not 0 <= op.record_events <= num_events - len(op.layers):
        raise CommandError(Status.BAD_ARGUMENT,
                           f"events {op.record_events}+{len(op.layers)} of {num_events}")
