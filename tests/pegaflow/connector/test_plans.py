"""pegaflow/connector/plans.py: which blocks a planned load or save covers."""

from types import SimpleNamespace

from pegaflow.connector.plans import NULL_BLOCK, extend_tables, load_spec, next_save

HASHES = [bytes([i]) * 32 for i in range(6)]


def test_plans_next_save_covers_the_newly_full_blocks_only():
    # 1. Two of the request's blocks are saved; four are computed in full.
    request = SimpleNamespace(request_id="r", block_hashes=HASHES)
    planned = next_save(request, [[10, 11, 12, 13, 14]], num_saved=2, num_computed_blocks=4)
    # 2. The save covers positions 2 and 3, with their own hashes.
    assert planned.num_full == 4
    assert (planned.spec.block_ids, planned.spec.hashes) == ((12, 13), tuple(HASHES[2:4]))
    # 3. Nothing newly full: no save.
    assert next_save(request, [[10, 11, 12, 13, 14]], num_saved=4, num_computed_blocks=4) is None


def test_plans_window_positions_let_go_are_left_out_of_each_group():
    # A hybrid request: group 1 (a sliding window) let position 0 go (the null block).
    tables = [[20, 21, 22], [NULL_BLOCK, 31, 32]]
    spec = load_spec("r", tables, 0, 3, tuple(HASHES[:3]), (7,), True)
    assert [(p.group, p.block_ids, p.hashes) for p in spec.groups] == [
        (0, (20, 21, 22), tuple(HASHES[:3])), (1, (31, 32), tuple(HASHES[1:3]))]
    assert spec.block_ids == (20, 21, 22, 31, 32)


def test_plans_extend_tables_grows_every_group():
    tables = [[1]]
    extend_tables(tables, [[2], [3, 4]])
    assert tables == [[1, 2], [3, 4]]
