"""pegaflow.connector.taint: which saves would store the garbage of a failed load."""

from types import SimpleNamespace

from pegaflow.connector.taint import TAINT_STEPS, Taint


def _save(req_id, *block_ids):
    return SimpleNamespace(req_id=req_id, block_ids=block_ids)


def test_taint_spreads_to_readers_of_failed_blocks_and_lasts_two_steps():
    taint = Taint()
    # 1. x's load of blocks 1-2 failed: x's saves and any save holding 1 or 2 are dropped,
    #    the request of such a save (c) is tainted too; d is untouched.
    taint.failed_load("x", (1, 2))
    assert [s.req_id for s in taint.clean([_save("x", 4), _save("c", 2, 3), _save("d", 7)])] == ["d"]
    # 2. The next step (TAINT_STEPS = 2): x and c still dropped, even on other blocks.
    assert TAINT_STEPS == 2
    taint.next_step()
    assert [s.req_id for s in taint.clean([_save("x", 5), _save("c", 6), _save("d", 8)])] == ["d"]
    # 3. The step after: all clean again (vLLM has recomputed), block 1 included.
    taint.next_step()
    assert [s.req_id for s in taint.clean([_save("x", 1), _save("c", 9)])] == ["x", "c"]
