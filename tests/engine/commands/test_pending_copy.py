"""engine/commands/pending_copy.py: how a SAVE is cut into chunks.  (SAVE and LOAD through
a dispatcher, with a held or a real backend, are in test_dispatcher.py.)"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from engine.commands.pending_copy import FIRST_CHUNK, MAX_CHUNK, chunk_bounds


@given(st.integers(0, 20000))
def test_chunk_bounds_cover_every_item_with_short_first_and_last_chunks(num_items):
    # 1. Chunks tile [0, num_items) in order, none empty, none over MAX_CHUNK.
    bounds = list(chunk_bounds(num_items))
    assert [b[0] for b in bounds[1:]] == [b[1] for b in bounds[:-1]]
    assert (bounds[0][0], bounds[-1][1]) == (0, num_items) if num_items else bounds == []
    assert all(0 < end - start <= MAX_CHUNK for start, end in bounds)
    # 2. The first and the last chunk are at most FIRST_CHUNK long.
    if bounds:
        assert bounds[0][1] - bounds[0][0] <= FIRST_CHUNK and bounds[-1][1] - bounds[-1][0] <= FIRST_CHUNK
    # 3. A chunk is at most twice the one before (its bookkeeping hides behind that copy);
    #    the last one is at most FIRST_CHUNK anyway.
    sizes = [end - start for start, end in bounds][:-1]
    assert all(after <= 2 * before for before, after in zip(sizes, sizes[1:]))
