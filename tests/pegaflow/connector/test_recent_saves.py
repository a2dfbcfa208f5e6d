"""pegaflow/connector/recent_saves.py: the window of a rank's recent SAVEs."""

from __future__ import annotations

from pegaflow.connector.recent_saves import RECENT_SAVE_STEPS, RecentSaves
from pegaflow.platform.wire import HASH, encode_hashes, hash_keys


def test_recent_saves_keeps_the_last_steps_and_joins_their_records_whole():
    # 1. Five steps, each with one SAVE of hashes of 16 and 32 bytes (short ones padded).
    saves = RecentSaves()
    for step in range(5):
        saves.new_step()
        saves.sent(10 + step, encode_hashes([bytes([step]) * 16, bytes([step]) * 32]))
    # 2. The last three steps' hashes come back as HASH records, key for key, and the
    #    first of their request ids; the window is empty after.
    hashes, since = saves.take()
    assert hashes.dtype == HASH and since == 12
    assert hash_keys(hashes) == hash_keys(encode_hashes(
        [bytes([s]) * n for s in (2, 3, 4) for n in (16, 32)]))
    assert len(saves) == 0 and saves.take() is None


def test_recent_saves_window_grows_with_pipeline_stages_and_ignores_saves_before_a_step():
    saves = RecentSaves(pipeline_stages=6)
    saves.sent(1, encode_hashes([b"x" * 32]))  # before any step: nothing to attach it to
    saves.new_step()
    assert saves.take() is None
    for _ in range(20):
        saves.new_step()
    assert len(saves) == 8 > RECENT_SAVE_STEPS and saves.take() is None
