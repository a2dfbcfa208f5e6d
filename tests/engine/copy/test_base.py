"""CopyOp: what every backend may assume of an op."""

from __future__ import annotations

import numpy as np

from engine.copy.base import CopyOp, Direction, LayerPlacement

LAYERS = [LayerPlacement(0, 0, 0, 4096)]


def _op(block_ids, entry_offsets) -> CopyOp:
    return CopyOp(7, Direction.SAVE, 3, LAYERS, 4096, np.asarray(block_ids, np.int64),
                  np.asarray(entry_offsets, np.int64), wait_event=2, wait_per_layer=True)


def test_in_pool_order_sorts_by_pool_offset_and_keeps_every_pair():
    rng = np.random.default_rng(0)
    blocks = rng.permutation(500)
    offsets = rng.choice(10_000, 500, replace=False) * 8192
    op = _op(blocks, offsets)
    ordered = op.in_pool_order()
    assert np.all(np.diff(ordered.entry_offsets) > 0)
    assert dict(zip(ordered.entry_offsets.tolist(), ordered.block_ids.tolist())) == \
        dict(zip(offsets.tolist(), blocks.tolist()))
    assert (ordered.token, ordered.slot, ordered.wait_event, ordered.wait_per_layer) == (7, 3, 2, True)
    assert np.array_equal(op.entry_offsets, offsets)  # the caller's op is not changed


def test_in_pool_order_returns_an_ordered_op_itself():
    op = _op([5, 1, 9], [0, 8192, 8192 * 4])
    assert op.in_pool_order() is op
    single = _op([5], [8192])
    assert single.in_pool_order() is single
