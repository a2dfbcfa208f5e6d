"""pegaflow.connector.taint: which saves would store the garbage of a failed load."""

from types import SimpleNamespace

from pegaflow.connector.taint import Taint


def _save(req_id, *block_ids):
    return SimpleNamespace(req_id=req_id, block_ids=block_ids)


def _kept(taint, *saves):
    return [s.req_id for s in taint.clean(list(saves))]


def test_taint_spreads_to_readers_of_failed_blocks_until_the_scheduler_has_seen_it():
    taint = Taint()
    # 1. x's load of blocks 1-2 failed: x's saves and any save holding 1 or 2 are held
    #    back, and the request of such a save (c) is tainted too; d is untouched.
    taint.failed_load("x", (1, 2))
    assert _kept(taint, _save("x", 4), _save("c", 2, 3), _save("d", 7)) == ["d"]
    # 2. Steps planned before the scheduler saw the failure: still held back, whatever
    #    blocks x and c save.
    taint.acknowledge(set())
    assert _kept(taint, _save("x", 5), _save("c", 6), _save("d", 8)) == ["d"]
    # 3. The scheduler has seen blocks 1-2 fail (it rewound x and c): their recomputed
    #    blocks, 1 and 2 included, go out again.
    taint.acknowledge({1, 2})
    assert _kept(taint, _save("x", 1, 2), _save("c", 1, 9)) == ["x", "c"]


def test_taint_acknowledging_other_blocks_keeps_the_rest():
    taint = Taint()
    taint.failed_load("x", (1,))
    taint.failed_load("y", (5,))
    taint.acknowledge({1})
    assert _kept(taint, _save("x", 1), _save("y", 6), _save("z", 5)) == ["x"]
