"""REGISTER and REGISTER_EVENTS: a client's KV memory and events, checked before use.

A region is refused (BAD_ARGUMENT / BAD_PAYLOAD, nothing changed) unless its id is new,
its page size is at least MIN_PAGE_BYTES, every layer's pages lie inside it without
overlapping (checked in Python integers: no 64-bit wrap-around lets a huge stride pass),
page sizes agree across the client's regions, layer indices are new and below MAX_LAYERS,
and one block of all layers fits a slab.  Layers may share memory (the KV cache groups of a
hybrid model overlay each other: vLLM gives a block id to one group at a time).  Each layer
names its group; a SAVE or LOAD of one group (LAYER_GROUP) copies only its layers.  Events
are registered once per connection.
"""

from __future__ import annotations

import logging

import numpy as np

from pegaflow.platform import shm
from pegaflow.platform.errors import CommandError, ConfigError, PegaflowError
from pegaflow.platform.protocol import Register, RegisterEvents
from pegaflow.platform.wire import RegionKind, Status

from ..copy.base import CopyBackend, LayerPlacement
from ..memory.pool import PagePool
from .client import ClientState

logger = logging.getLogger(__name__)

MAX_LAYERS = 1024
# The smallest KV page of a real model is ~1 KiB (16 tokens x 1 head x 32 dims x fp8, K+V);
# tiny pages would make one slab a free list of millions of entries.
MIN_PAGE_BYTES = 512


def register_region(client: ClientState, register: Register, backend: CopyBackend,
                    pool: PagePool) -> None:
    """REGISTER: check a region's geometry, open its memory, record where each layer lives."""
    region_id, region, layers = register.region_id, register.region, register.layers
    num_layers = len(layers)
    if not 0 < num_layers <= MAX_LAYERS:
        raise CommandError(Status.BAD_PAYLOAD, "REGISTER wants one REGION and num_items LAYERs")
    if region_id in client.region_blocks:  # remapping it could pull memory from under copies
        raise CommandError(Status.BAD_ARGUMENT, f"region {region_id} is already registered")
    page_bytes = _check_region(client, region, layers, pool)
    _check_owner(client, region)
    try:
        backend.register_region(client.slot, region_id, region)
    except PegaflowError as exc:
        raise CommandError(Status.BAD_ARGUMENT, f"cannot open region: {exc}") from exc
    client.page_bytes = page_bytes
    client.region_blocks[region_id] = int(region["num_blocks"])
    for layer in layers:
        client.layers[int(layer["layer"])] = LayerPlacement(
            int(layer["layer"]), region_id, int(layer["offset_bytes"]),
            int(layer["block_stride_bytes"]))
        members = client.groups.setdefault(int(layer["group"]), [])
        members.append(int(layer["layer"]))
        members.sort()
    logger.info("slot %d (pid %d) registered region %d: %d layers x %d blocks, %d-byte pages",
                client.slot, client.pid, region_id, num_layers,
                int(region["num_blocks"]), page_bytes)

def _check_owner(client: ClientState, region: np.void) -> None:
    """Host memory is registered only by the process that made it and maps it: never
    another client's buffer, never the engine's own segments (CUDA IPC handles name one
    allocation of the sender's already)."""
    if int(region["kind"]) != RegionKind.HOST_SHM or not client.ring_name:
        return
    name = bytes(region["shm_name"]).rstrip(b"\0").decode(errors="replace")
    if not (shm.is_private_buffer_of(name, client.pid) and shm.maps_segment(client.pid, name)):
        raise CommandError(Status.BAD_ARGUMENT, f"{name!r} is not a buffer of pid {client.pid}: "
                                                f"register memory this process made and maps")


def _check_region(client: ClientState, region: np.void, layers: np.ndarray, pool: PagePool) -> int:
    page, num_blocks = int(region["page_bytes"]), int(region["num_blocks"])
    limit = int(region["alloc_bytes"]) - int(region["base_offset"])
    if num_blocks <= 0 or limit <= 0:
        raise CommandError(Status.BAD_ARGUMENT, "region needs positive blocks and bytes")
    if not MIN_PAGE_BYTES <= page <= limit:
        raise CommandError(Status.BAD_ARGUMENT, f"page size {page} outside [{MIN_PAGE_BYTES}, "
                                                f"{limit}] (the region's bytes)")
    if client.page_bytes and page != client.page_bytes:
        raise CommandError(Status.BAD_ARGUMENT, f"page size {page} != {client.page_bytes} registered")
    for offset, stride in zip(layers["offset_bytes"].tolist(), layers["block_stride_bytes"].tolist()):
        if offset < 0 or stride < page or offset + (num_blocks - 1) * stride + page > limit:
            raise CommandError(Status.BAD_ARGUMENT, "a layer's pages overlap or fall outside the region")
    if (layers["layer"] >= MAX_LAYERS).any() or len(np.unique(layers["layer"])) != len(layers):
        raise CommandError(Status.BAD_ARGUMENT, "layer indices repeat or exceed the maximum")
    if any(int(i) in client.layers for i in layers["layer"]):
        raise CommandError(Status.BAD_ARGUMENT, "a layer is already registered")
    try:
        pool.check_entry_bytes(page * (len(client.layers) + len(layers)))
    except ConfigError as exc:
        raise CommandError(Status.BAD_ARGUMENT, str(exc)) from exc
    return page


def register_events(client: ClientState, events: RegisterEvents, backend: CopyBackend) -> None:
    """REGISTER_EVENTS: open the client's pool of IPC events."""
    num_events = len(events.handles)
    if client.num_events:  # reopening them could close events copies still record
        raise CommandError(Status.BAD_ARGUMENT, "events are already registered")
    try:
        backend.register_events(client.slot, events.handles)
    except PegaflowError as exc:
        raise CommandError(Status.BAD_ARGUMENT, f"cannot open events: {exc}") from exc
    client.num_events = num_events
