"""engine/disk/store.py: blocks written to disk read back exactly; a damaged,
deleted or unwritable file is an answer, never an exception; the size limit evicts the disk
LRU but never a block being read."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from engine.disk.blockfile import HEADER_BYTES, aligned_buffer, block_path
from engine.disk.store import DiskStore
from pegaflow.platform.errors import ConfigError
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


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.fixture
def make_store(tmp_path):
    with disk_stores(tmp_path) as make:
        yield make


@pytest.mark.parametrize("num_bytes", [5000, BLOCK_BYTES, 4 * BLOCK_BYTES, 4096])
def test_store_write_then_read_returns_same_bytes(make_store, num_bytes):
    # 1. The block is on disk only once its write's result is polled.
    store = make_store()
    key, src = block_key(1), random_block(num_bytes, seed=num_bytes)
    assert store.try_write(key, src, 5)
    assert not store.contains(key) and store.num_inflight() == 1
    (done,) = poll_until(store, 1)
    assert done.error is None and done.num_bytes == num_bytes
    assert store.contains(key) and store.entry_bytes(key) == num_bytes and store.num_inflight() == 0
    # 2. Read into a slice of a larger pool: the slice equals the source, its neighbours untouched.
    pool = aligned_buffer(num_bytes + 8192)
    pool[:] = 0xAA
    assert store.try_read(key, pool[4096:4096 + num_bytes], 6)
    (done,) = poll_until(store, 1)
    assert done.error is None and done.is_read and done.token == 6 and not done.is_corrupt
    assert np.array_equal(pool[4096:4096 + num_bytes], src)
    assert (pool[:4096] == 0xAA).all() and (pool[4096 + num_bytes:] == 0xAA).all()
    c = store.counters
    assert (c.blocks_written, c.blocks_read, c.bytes_written, c.bytes_read) == (1, 1, num_bytes, num_bytes)
    assert store.bytes_used == HEADER_BYTES + num_bytes and store.num_blocks == 1


def test_store_same_key_twice_or_wrong_dst_refused(make_store):
    store = make_store()
    key = block_key(1)
    assert store.try_write(key, random_block(), 1)
    assert not store.try_write(key, random_block(), 2)  # being written
    poll_until(store, 1)
    assert not store.try_write(key, random_block(), 3)  # on disk
    assert not store.try_read(key, aligned_buffer(BLOCK_BYTES - 1), 4)
    assert not store.try_read(block_key(2), aligned_buffer(BLOCK_BYTES), 5)
    assert store.counters.writes_refused == 0 and store.num_inflight() == 0


@pytest.mark.parametrize("offset", [HEADER_BYTES + 12345, 24 + 5])  # a data byte, a byte of the hash
def test_store_flipped_byte_read_reports_corrupt_and_forgets(make_store, tmp_path, offset):
    # 1. A block on disk gets one byte flipped underneath.
    store = make_store()
    key = block_key(1)
    write_block(store, key, random_block())
    path = block_path(tmp_path, key)
    _flip(path, offset)
    # 2. Its read is reported corrupt (not served), counted, the key forgotten, the file gone.
    done, _ = read_block(store, key)
    assert done.is_corrupt and done.error and done.num_bytes == 0
    assert store.counters.checksum_failures == 1 and store.counters.io_errors == 0
    assert store.counters.blocks_read == 0
    assert not store.contains(key) and not path.exists() and store.bytes_used == 0


def test_store_size_limit_evicts_lru_respecting_touch(make_store, tmp_path):
    # 1. Room for three; write 0, 1, 2, then touch 0.
    store = make_store(size_bytes=3 * FILE_BYTES)
    for i in range(3):
        write_block(store, block_key(i), random_block(seed=i))
    store.touch(block_key(0))
    # 2. Writing 3 and 4 evicts 1 and 2, the least recently used.
    for i in (3, 4):
        write_block(store, block_key(i), random_block(seed=i))
    assert [store.contains(block_key(i)) for i in range(5)] == [True, False, False, True, True]
    assert not block_path(tmp_path, block_key(1)).exists() and not block_path(tmp_path, block_key(2)).exists()
    assert store.counters.evictions == 2 and store.bytes_used <= 3 * FILE_BYTES


def test_store_block_larger_than_path_refused(make_store):
    store = make_store(size_bytes=FILE_BYTES)
    assert not store.try_write(block_key(1), random_block(BLOCK_BYTES + 1), 1)
    assert store.counters.writes_refused == 1 and store.num_inflight() == 0 and store.bytes_used == 0


def test_store_block_being_read_not_evicted(make_store):
    # 1. Room for three; 0, 1, 2 written; a read of 0 starts, then 1 and 2 are touched so 0
    #    is the least recently used.
    store = make_store(size_bytes=3 * FILE_BYTES)
    sources = [random_block(seed=i) for i in range(3)]
    for i, src in enumerate(sources):
        write_block(store, block_key(i), src)
    dst = aligned_buffer(BLOCK_BYTES)
    assert store.try_read(block_key(0), dst, 10)
    store.touch(block_key(1))
    store.touch(block_key(2))
    # 2. A write before the read is polled evicts 1, not 0.
    assert store.try_write(block_key(3), random_block(seed=3), 11)
    assert store.contains(block_key(0)) and not store.contains(block_key(1))
    # 3. The read is served intact.
    done = {d.token: d for d in poll_until(store, 2)}
    assert done[10].error is None and np.array_equal(dst, sources[0])


def test_store_every_block_being_read_write_refused(make_store):
    store = make_store(size_bytes=2 * FILE_BYTES)
    for i in range(2):
        write_block(store, block_key(i), random_block(seed=i))
    for i in range(2):
        assert store.try_read(block_key(i), aligned_buffer(BLOCK_BYTES), 10 + i)
    # Nothing can be evicted: refused, and nothing was evicted.
    assert not store.try_write(block_key(2), random_block(), 20)
    assert store.counters.writes_refused == 1 and store.counters.evictions == 0
    assert all(d.error is None for d in poll_until(store, 2))
    assert store.contains(block_key(0)) and store.contains(block_key(1))


def test_store_file_deleted_underneath_read_reports_io_error(make_store, tmp_path):
    store = make_store()
    key = block_key(1)
    write_block(store, key, random_block())
    os.unlink(block_path(tmp_path, key))
    done, _ = read_block(store, key)
    assert done.error and not done.is_corrupt
    assert store.counters.io_errors == 1 and store.counters.checksum_failures == 0
    assert not store.contains(key) and store.bytes_used == 0 and store.num_blocks == 0


def test_store_shard_dir_is_a_file_write_reports_io_error(make_store, tmp_path):
    # 1. The directory the block's file goes in is a regular file (fails for root too).
    store = make_store()
    key = block_key(1)
    shard_dir = block_path(tmp_path, key).parent
    shard_dir.parent.mkdir(parents=True)
    shard_dir.write_bytes(b"in the way")
    # 2. The write is queued, and fails as an answer: counted, nothing on disk, room given back.
    assert store.try_write(key, random_block(), 1)
    (done,) = poll_until(store, 1)
    assert done.error and not done.is_corrupt and done.num_bytes == 0
    assert store.counters.io_errors == 1 and store.counters.blocks_written == 0
    assert not store.contains(key) and store.bytes_used == 0 and not store.is_busy(key)


def test_store_two_paths_writes_go_to_most_free(make_store, tmp_path):
    # 1. Path b starts with a block more; the next two writes go to a, then they alternate.
    path_a, path_b = tmp_path / "a", tmp_path / "b"
    store = make_store(paths=[path_a, path_b], size_bytes=10 * FILE_BYTES)
    assert store.bytes_total == 20 * FILE_BYTES
    write_block(store, block_key(0), random_block())
    assert block_path(path_a, block_key(0)).exists()
    for i in range(1, 6):
        write_block(store, block_key(i), random_block(seed=i))
    on_a = [block_path(path_a, block_key(i)).exists() for i in range(6)]
    on_b = [block_path(path_b, block_key(i)).exists() for i in range(6)]
    assert on_a == [True, False, True, False, True, False]
    assert on_b == [not x for x in on_a]


def test_store_two_paths_full_one_evicts_on_its_own_path(make_store, tmp_path):
    path_a, path_b = tmp_path / "a", tmp_path / "b"
    store = make_store(paths=[path_a, path_b], size_bytes=FILE_BYTES)
    write_block(store, block_key(0), random_block())  # to a
    write_block(store, block_key(1), random_block())  # to b
    write_block(store, block_key(2), random_block())  # both full: a's oldest (key 0) goes
    assert [store.contains(block_key(i)) for i in range(3)] == [False, True, True]
    assert block_path(path_a, block_key(2)).exists() and store.bytes_used == 2 * FILE_BYTES


def test_store_remove_during_read_unlinks_after_read(make_store, tmp_path):
    store = make_store()
    key = block_key(1)
    src = random_block()
    write_block(store, key, src)
    dst = aligned_buffer(BLOCK_BYTES)
    assert store.try_read(key, dst, 2)
    # 1. Removed while being read: gone from the index at once, its file kept for the read.
    assert store.remove(key) and not store.remove(key)
    assert not store.contains(key) and store.is_busy(key) and not store.try_write(key, src, 3)
    # 2. Once the read is polled the file is gone too.
    (done,) = poll_until(store, 1)
    assert done.error is None and np.array_equal(dst, src)
    assert not block_path(tmp_path, key).exists() and store.num_blocks == 0 and store.bytes_used == 0


def test_store_remove_during_write_never_lands(make_store, tmp_path):
    store = make_store()
    key = block_key(1)
    assert store.try_write(key, random_block(), 1)
    assert store.remove(key)
    (done,) = poll_until(store, 1)
    assert done.error is None
    assert not store.contains(key) and not block_path(tmp_path, key).exists() and store.bytes_used == 0


def test_store_wake_called_once_per_result(make_store):
    num_wakes = []
    lock = threading.Lock()

    def wake() -> None:
        with lock:
            num_wakes.append(1)

    store = make_store(wake=wake, num_threads=2)
    for i in range(3):
        assert store.try_write(block_key(i), random_block(seed=i), i)
    poll_until(store, 3)
    assert len(num_wakes) == 3


def test_store_close_waits_for_queued_io(make_store):
    store = make_store(num_threads=1)
    for i in range(8):
        assert store.try_write(block_key(i), random_block(seed=i), i)
    store.close()
    assert len(store.poll()) == 8
    assert all(store.contains(block_key(i)) for i in range(8))
    assert not store.try_write(block_key(99), random_block(), 99)


@pytest.mark.parametrize("kwargs", [{"paths": []}, {"size_bytes": 0}, {"num_threads": 0}])
def test_store_unusable_config_raises_config_error(tmp_path, kwargs):
    args = {"paths": [tmp_path], "size_bytes": FILE_BYTES, "num_threads": 1} | kwargs
    with pytest.raises(ConfigError):
        DiskStore(args.pop("paths"), **args)
