"""What a SAVE or LOAD copies, checked against its client's registration: which layers
(one, all, or a KV cache group's), block ids inside every region they name, events inside
the client's pool (``pegaflow.platform.protocol`` says what each field means), and for a
LOAD, where its blocks are stored."""

from __future__ import annotations

import numpy as np

from pegaflow.platform.errors import CommandError
from pegaflow.platform.protocol import layer_event
from pegaflow.platform.wire import ALL_LAYERS, Status

from .clients import ClientState


def copied_blocks(client: ClientState, command):
    """Validated (block ids, layer placements, layer mask) of a SAVE or LOAD (its keys are
    built a chunk at a time: ``engine/transfers.py``)."""
    if not client.is_complete():
        raise CommandError(Status.UNKNOWN_REGION, "register every layer's KV memory first")
    if client.revoked:  # sent before the client gave up: its blocks may be someone else's
        raise CommandError(Status.BAD_ARGUMENT, "this client revoked its copies")
    block_ids = command.block_ids.astype(np.int64)
    layer, group = command.layer, command.group
    if group is not None:
        if group not in client.groups:
            raise CommandError(Status.BAD_ARGUMENT, f"no layer is registered in group {group}")
        placements = [client.layers[i] for i in client.groups[group]]
    elif layer == ALL_LAYERS:
        placements = [client.layers[i] for i in range(client.num_layers)]
    elif layer in client.layers:
        placements = [client.layers[layer]]
    else:
        raise CommandError(Status.BAD_ARGUMENT, f"layer {layer} is not registered")
    limit = min(client.region_blocks[p.region_id] for p in placements)
    if len(block_ids) and (block_ids.min() < 0 or block_ids.max() >= limit):
        raise CommandError(Status.BLOCK_OUT_OF_RANGE, f"block ids must lie in [0, {limit})")
    mask = sum(1 << p.layer for p in placements)
    return block_ids, placements, mask

def checked_event(client: ClientState, first_event: int | None, count: int) -> int | None:
    """``first_event``, once the ``count`` events from it lie in the client's pool."""
    if first_event is not None and layer_event(first_event, count) > client.num_events:
        raise CommandError(Status.BAD_ARGUMENT, f"event {first_event}+{count} outside the client's pool")
    return first_event


def stored_offsets(index, keys: list, entry_bytes: int) -> np.ndarray:
    """The pool offsets of ``keys`` for a LOAD, every one stored with this geometry."""
    get_ready, offsets = index.get_ready, []
    for key in keys:
        entry = get_ready(key)
        if entry is None or entry.entry_bytes != entry_bytes:
            missing = sum(get_ready(k) is None for k in keys)
            if missing:
                raise CommandError(Status.MISSING_BLOCK, f"{missing} of {len(keys)} blocks are not stored")
            raise CommandError(Status.BAD_ARGUMENT, "stored blocks have another geometry")
        offsets.append(entry.offset)
    return np.array(offsets, np.int64)
