"""engine/disk/scan.py: a restarted disk tier takes in every whole block under its paths, with
its layers, removes the leftovers (torn, truncated), and evicts the oldest by mtime to fit."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from engine.disk.blockfile import HEADER_BYTES, block_path
from tests.engine.disk.disk_blocks import (
    BLOCK_BYTES,
    FILE_BYTES,
    block_key,
    disk_stores,
    poll_until,
    random_block,
    read_block,
    write_block,
)


@pytest.fixture
def make_store(tmp_path):
    with disk_stores(tmp_path) as make:
        yield make


def test_store_restart_scan_takes_in_blocks_and_removes_leftovers(make_store, tmp_path):
    # 1. Three blocks written (layers kept), a fourth truncated, a torn tmp file; close.
    store = make_store()
    sources = {i: random_block(seed=i) for i in range(4)}
    for i, src in sources.items():
        assert store.try_write(block_key(i), src, i, num_layers=i + 1)
    poll_until(store, 4)
    store.close()
    truncated = block_path(tmp_path, block_key(3))
    os.truncate(truncated, HEADER_BYTES + 100)
    tmp_file = block_path(tmp_path, block_key(9)).with_suffix(".blk.tmp")
    tmp_file.parent.mkdir(parents=True, exist_ok=True)
    tmp_file.write_bytes(b"torn")
    # 2. A new store on the same path takes in the three and removes the rest.
    store = make_store()
    assert store.scan() == 3
    assert not truncated.exists() and not tmp_file.exists()
    assert not store.contains(block_key(3)) and store.bytes_used == 3 * FILE_BYTES
    for i in range(3):
        assert store.block_meta(block_key(i)) == (BLOCK_BYTES, i + 1)
        done, dst = read_block(store, block_key(i))
        assert done.error is None and np.array_equal(dst, sources[i])


def test_store_scan_over_size_evicts_oldest_by_mtime(make_store, tmp_path):
    # 1. Three blocks, their mtimes set so that key 1 is the oldest, then key 0.
    store = make_store()
    for i in range(3):
        write_block(store, block_key(i), random_block(seed=i))
    store.close()
    for i, age_s in ((0, 20), (1, 30), (2, 10)):
        mtime = time.time() - age_s
        os.utime(block_path(tmp_path, block_key(i)), (mtime, mtime))
    # 2. A store with room for two evicts the oldest: key 1.
    store = make_store(size_bytes=2 * FILE_BYTES)
    assert store.scan() == 2
    assert [store.contains(block_key(i)) for i in range(3)] == [True, False, True]
    assert store.counters.evictions == 1 and not block_path(tmp_path, block_key(1)).exists()


def test_scan_same_block_on_two_paths_keeps_the_older_copy(make_store, tmp_path):
    # 1. One block written on path a; a copy of its file on path b, written later.
    a, b = tmp_path / "a", tmp_path / "b"
    store = make_store(paths=[a])
    write_block(store, block_key(0), random_block(seed=0))
    store.close()
    older, newer = block_path(a, block_key(0)), block_path(b, block_key(0))
    newer.parent.mkdir(parents=True)
    newer.write_bytes(older.read_bytes())
    os.utime(older, (time.time() - 60, time.time() - 60))
    # 2. A store on both paths takes in one block, from a; b's copy is removed.
    store = make_store(paths=[a, b])
    assert store.scan() == 1 and store.bytes_used == FILE_BYTES
    assert older.exists() and not newer.exists()
    done, _ = read_block(store, block_key(0))
    assert done.error is None
