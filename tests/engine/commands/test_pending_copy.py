"""engine/commands/pending_copy.py: how a SAVE is cut into chunks, and a copy's timing as
logged.  (SAVE and LOAD through a dispatcher, with a held or a real backend, are in
test_dispatcher.py.)"""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

from engine.commands.pending_copy import FIRST_CHUNK, MAX_CHUNK, PendingCopy, chunk_bounds
from engine.commands.received import Received
from pegaflow.platform.wire import Opcode


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


def test_pending_copy_log_timing_says_where_a_saves_time_went(caplog):
    # A SAVE of 4 blocks of 1 MB, received 10 ms ago, its first copy issued 2 ms after that.
    now = time.perf_counter()
    received = Received(SimpleNamespace(slot=3), 7, Opcode.SAVE, 4, now - 0.010)
    pending = PendingCopy(received.client, received, Opcode.SAVE, 1, 10**6, is_timed=True,
                          num_blocks=4, first_issued_at=now - 0.008)
    with caplog.at_level(logging.DEBUG, logger="engine.commands.transfers"):
        pending.log_timing(logging.getLogger("engine.commands.transfers"))
    message = caplog.records[-1].getMessage()
    assert message.startswith("slot 3: SAVE of 4 blocks (4.0 MB): first copy handed to the backend after 2.")
    assert "all after nan ms" in message  # never sealed
