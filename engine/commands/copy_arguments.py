"""What a SAVE or LOAD copies, checked against its client's registration: which layers
(one, all, or a KV cache group's), block ids inside every region they name, and events
inside the client's pool (``pegaflow.platform.protocol`` says what each field means)."""

from __future__ import annotations

import numpy as np

from pegaflow.platform.errors import CommandError
from pegaflow.platform.protocol import layer_event
from pegaflow.platform.wire import ALL_LAYERS, Status

from ..clients.client import ClientState


def copied_blocks(client: ClientState, command):
    """Validated (block ids, keys, layer placements, layer mask) of a SAVE or LOAD."""
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
    return block_ids, command.keys(), placements, mask

def checked_event(client: ClientState, first_event: int | None, count: int) -> int | None:
    """``first_event``, once the ``count`` events from it lie in the client's pool."""
    if first_event is not None and layer_event(first_event, count) > client.num_events:
        raise CommandError(Status.BAD_ARGUMENT, f"event {first_event}+{count} outside the client's pool")
    return first_event
