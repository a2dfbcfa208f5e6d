"""engine/commands/copy_arguments.py: what a SAVE or LOAD copies, checked against its client's
registration before anything is planned (through a real engine: test_dispatcher.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from engine.clients.client import ClientState
from engine.commands.copy_arguments import checked_event, copied_blocks
from engine.copy.base import LayerPlacement
from pegaflow.platform.errors import CommandError
from pegaflow.platform.protocol import Save, hash_records
from pegaflow.platform.wire import Status

HASHES = [bytes([i]) * 32 for i in range(3)]


def _client(num_layers: int = 2, num_blocks: int = 8, revoked: bool = False) -> ClientState:
    # Two layers in region 0 (8 blocks), group 5 holding layer 1 alone, 4 events.
    view = SimpleNamespace(revoked=np.array([int(revoked)]))
    client = ClientState(0, view, None, None, is_attached=True)
    client.layers = {i: LayerPlacement(i, 0, i * 4096, 4096 * num_layers) for i in range(num_layers)}
    client.groups, client.region_blocks = {5: [1]}, {0: num_blocks}
    client.page_bytes, client.num_events = 4096, 4
    return client


def _save(block_ids, **fields) -> Save:
    return Save(9, np.array(block_ids, np.int32), hash_records(HASHES[:len(block_ids)]), **fields)


def test_copy_arguments_all_layers_give_every_placement_and_the_full_mask():
    block_ids, placements, mask = copied_blocks(_client(), _save([0, 7, 3]))
    assert block_ids.tolist() == [0, 7, 3]
    assert [p.layer for p in placements] == [0, 1] and mask == 0b11


def test_copy_arguments_one_layer_or_one_group_give_its_placements_only():
    assert [p.layer for p in copied_blocks(_client(), _save([1], layer=0))[1]] == [0]
    _, placements, mask = copied_blocks(_client(), _save([1], group=5))
    assert [p.layer for p in placements] == [1] and mask == 0b10


@pytest.mark.parametrize("client, save, status", [
    (_client(num_layers=0), _save([0]), Status.UNKNOWN_REGION),  # nothing registered
    (_client(revoked=True), _save([0]), Status.BAD_ARGUMENT),  # it gave up on its copies
    (_client(), _save([0], group=2), Status.BAD_ARGUMENT),  # no such group
    (_client(), _save([0], layer=3), Status.BAD_ARGUMENT),  # no such layer
    (_client(), _save([8]), Status.BLOCK_OUT_OF_RANGE),  # one past the region's blocks
    (_client(), _save([-1]), Status.BLOCK_OUT_OF_RANGE),
])
def test_copy_arguments_refuse_what_the_registration_does_not_cover(client, save, status):
    with pytest.raises(CommandError) as refused:
        copied_blocks(client, save)
    assert refused.value.status == status


def test_copy_arguments_event_range_must_lie_in_the_clients_pool():
    client = _client()  # 4 events
    assert checked_event(client, None, 2) is None and checked_event(client, 2, 2) == 2
    with pytest.raises(CommandError) as refused:
        checked_event(client, 3, 2)
    assert refused.value.status == Status.BAD_ARGUMENT
