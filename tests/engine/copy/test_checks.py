"""engine/copy/checks.py: a copy op outside its client's memory, the pool or the client's
events is refused whole, with the status a client can act on."""

from __future__ import annotations

import numpy as np
import pytest

from engine.copy.base import CopyOp, Direction, LayerPlacement
from engine.copy.checks import Region, check_op
from pegaflow.platform.errors import CommandError
from pegaflow.platform.wire import Status

PAGE = 4096
NUM_BLOCKS = 10
LAYER_BYTES = NUM_BLOCKS * PAGE
NUM_LAYERS = 2
POOL = 8 * NUM_LAYERS * PAGE  # eight entries of every layer
REGIONS = {(0, 0): Region(0, b"h", 0x10000, NUM_LAYERS * LAYER_BYTES),
           (0, 1): Region(1, b"g", 0x90000, NUM_LAYERS * LAYER_BYTES)}


def _op(block_ids=(0, 9), entries=(0, 7), region_id=0, layers=range(NUM_LAYERS), **kw) -> CopyOp:
    placements = [LayerPlacement(i, region_id, i * LAYER_BYTES, PAGE) for i in layers]
    return CopyOp(1, Direction.SAVE, 0, placements, PAGE, np.asarray(block_ids, np.int64),
                  np.asarray(entries, np.int64) * NUM_LAYERS * PAGE, **kw)


def _refused(op: CopyOp, num_events: int = 4, pool: int | None = POOL) -> Status:
    with pytest.raises(CommandError) as info:
        check_op(op, REGIONS, pool, num_events)
    return info.value.status


def test_check_op_in_bounds_gives_each_layers_region():
    # 1. The first and last block of the region, the first and last entry of the pool.
    regions = check_op(_op(), REGIONS, POOL, 0)
    assert regions == [REGIONS[(0, 0)]] * NUM_LAYERS
    # 2. No blocks at all: nothing to bound.
    assert check_op(_op(block_ids=(), entries=()), REGIONS, POOL, 0) == [REGIONS[(0, 0)]] * 2


@pytest.mark.parametrize("op,status", [
    (_op(block_ids=(0, 10)), Status.BLOCK_OUT_OF_RANGE),   # one block past the region
    (_op(block_ids=(-1, 3)), Status.BLOCK_OUT_OF_RANGE),   # before it
    (_op(entries=(0, 8)), Status.BLOCK_OUT_OF_RANGE),      # one entry past the pool
    (_op(entries=(-1, 3)), Status.BLOCK_OUT_OF_RANGE),     # before it
    (_op(region_id=5), Status.UNKNOWN_REGION),
    (_op(block_ids=(1, 2, 3)), Status.BAD_PAYLOAD),        # ids and entries disagree
    (_op(layers=()), Status.BAD_PAYLOAD),
])
def test_check_op_out_of_bounds_refused_with_its_status(op, status):
    assert _refused(op) == status


def test_check_op_layers_on_two_devices_refused():
    op = _op()
    op.layers[1] = LayerPlacement(1, 1, LAYER_BYTES, PAGE)
    assert _refused(op) == Status.BAD_ARGUMENT


def test_check_op_without_a_pool_is_an_internal_error():
    assert _refused(_op(), pool=None) == Status.INTERNAL


@pytest.mark.parametrize("fields,is_ok", [
    ({"wait_event": 3}, True), ({"wait_event": 4}, False), ({"wait_event": -1}, False),
    ({"wait_event": 2, "wait_per_layer": True}, True),    # events 2 and 3
    ({"wait_event": 3, "wait_per_layer": True}, False),   # events 3 and 4: 4 is past the pool
    ({"record_events": 2}, True), ({"record_events": 3}, False), ({"record_events": -1}, False),
])
def test_check_op_events_must_lie_in_the_clients_pool(fields, is_ok):
    op = _op(**fields)
    if is_ok:
        check_op(op, REGIONS, POOL, 4)
    else:
        assert _refused(op, num_events=4) == Status.BAD_ARGUMENT


def test_check_op_pool_bound_counts_every_layer_of_the_last_entry():
    # 1. An entry whose last layer's page ends exactly at the end of the pool fits...
    fits = _op(block_ids=(0,), entries=(0,))
    fits.entry_offsets = np.array([POOL - NUM_LAYERS * PAGE], np.int64)
    check_op(fits, REGIONS, POOL, 0)
    # 2. ...one page later its last layer would be past it.
    late = _op(block_ids=(0,), entries=(0,))
    late.entry_offsets = np.array([POOL - NUM_LAYERS * PAGE + PAGE], np.int64)
    assert _refused(late) == Status.BLOCK_OUT_OF_RANGE


def test_check_op_negative_layer_index_or_offset_refused():
    # 1. A layer numbered below 0 would address pool bytes before its entry.
    below = _op()
    below.layers[0] = LayerPlacement(-1, 0, 0, PAGE)
    assert _refused(below) == Status.BLOCK_OUT_OF_RANGE
    # 2. A layer placed before its region's first byte.
    before = _op(block_ids=(0, 1))
    before.layers[0] = LayerPlacement(0, 0, -PAGE, PAGE)
    assert _refused(before) == Status.BLOCK_OUT_OF_RANGE
