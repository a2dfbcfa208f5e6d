"""engine/disk/store.py: blocks written to disk read back exactly, across a restart; a damaged,
deleted or unwritable file is an answer, never an exception; the size limit evicts the disk
LRU but never a block being read."""

from __future__ import annotations

import hashlib
import os
import threading
import time

import numpy as np
import pytest

from engine.disk.blockfile import HEADER_BYTES, aligned_buffer, block_path
from engine.disk.store import DiskDone, DiskStore
from pegaflow.platform.errors import ConfigError

BLOCK_BYTES = 64 << 10
FILE_BYTES = HEADER_BYTES + BLOCK_BYTES


def _key(i: int, namespace: int = 7) -> tuple[int, bytes]:
    return namespace, hashlib.sha256(str(i).encode()).digest() + bytes([32])  # digest + length, as the engine keys


def _data(num_bytes: int = BLOCK_BYTES, seed: int = 0) -> np.ndarray:
    buf = aligned_buffer(num_bytes)
    buf[:] = np.random.default_rng(seed).integers(0, 256, num_bytes, dtype=np.uint8)
    return buf


def _poll_until(store: DiskStore, num_done: int, deadline_s: float = 10.0) -> list[DiskDone]:
    done: list[DiskDone] = []
    deadline = time.monotonic() + deadline_s
    while len(done) < num_done:
        assert time.monotonic() < deadline, f"{len(done)} of {num_done} results after {deadline_s} s"
        done += store.poll()
        time.sleep(0.001)
    assert len(done) == num_done
    return done


def _write(store: DiskStore, key, src, token: int = 1) -> DiskDone:
    assert store.try_write(key, src, token)
    (done,) = _poll_until(store, 1)
    assert done.error is None and not done.is_read and done.token == token
    return done


def _read(store: DiskStore, key, num_bytes: int = BLOCK_BYTES) -> tuple[DiskDone, np.ndarray]:
    dst = aligned_buffer(num_bytes)
    assert store.try_read(key, dst, 99)
    (done,) = _poll_until(store, 1)
    return done, dst


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.fixture
def make_store(tmp_path):
    stores: list[DiskStore] = []

    def make(paths=None, size_bytes: int = 100 * FILE_BYTES, **kwargs) -> DiskStore:
        stores.append(DiskStore(paths or [tmp_path], size_bytes, **kwargs))
        return stores[-1]

    yield make
    for store in stores:
        store.close()


@pytest.mark.parametrize("num_bytes", [5000, BLOCK_BYTES, 4 * BLOCK_BYTES, 4096])
def test_store_write_then_read_returns_same_bytes(make_store, num_bytes):
    # 1. The block is on disk only once its write's result is polled.
    store = make_store()
    key, src = _key(1), _data(num_bytes, seed=num_bytes)
    assert store.try_write(key, src, 5)
    assert not store.contains(key) and store.num_inflight() == 1
    (done,) = _poll_until(store, 1)
    assert done.error is None and done.num_bytes == num_bytes
    assert store.contains(key) and store.entry_bytes(key) == num_bytes and store.num_inflight() == 0
    # 2. Read into a slice of a larger pool: the slice equals the source, its neighbours untouched.
    pool = aligned_buffer(num_bytes + 8192)
    pool[:] = 0xAA
    assert store.try_read(key, pool[4096:4096 + num_bytes], 6)
    (done,) = _poll_until(store, 1)
    assert done.error is None and done.is_read and done.token == 6 and not done.is_corrupt
    assert np.array_equal(pool[4096:4096 + num_bytes], src)
    assert (pool[:4096] == 0xAA).all() and (pool[4096 + num_bytes:] == 0xAA).all()
    c = store.counters
    assert (c.blocks_written, c.blocks_read, c.bytes_written, c.bytes_read) == (1, 1, num_bytes, num_bytes)
    assert store.bytes_used == HEADER_BYTES + num_bytes and store.num_blocks == 1


def test_store_same_key_twice_or_wrong_dst_refused(make_store):
    store = make_store()
    key = _key(1)
    assert store.try_write(key, _data(), 1)
    assert not store.try_write(key, _data(), 2)  # being written
    _poll_until(store, 1)
    assert not store.try_write(key, _data(), 3)  # on disk
    assert not store.try_read(key, aligned_buffer(BLOCK_BYTES - 1), 4)
    assert not store.try_read(_key(2), aligned_buffer(BLOCK_BYTES), 5)
    assert store.counters.writes_refused == 0 and store.num_inflight() == 0


@pytest.mark.parametrize("offset", [HEADER_BYTES + 12345, 24 + 5])  # a data byte, a byte of the hash
def test_store_flipped_byte_read_reports_corrupt_and_forgets(make_store, tmp_path, offset):
    # 1. A block on disk gets one byte flipped underneath.
    store = make_store()
    key = _key(1)
    _write(store, key, _data())
    path = block_path(tmp_path, key)
    _flip(path, offset)
    # 2. Its read is reported corrupt (not served), counted, the key forgotten, the file gone.
    done, _ = _read(store, key)
    assert done.is_corrupt and done.error and done.num_bytes == 0
    assert store.counters.checksum_failures == 1 and store.counters.io_errors == 0
    assert store.counters.blocks_read == 0
    assert not store.contains(key) and not path.exists() and store.bytes_used == 0


def test_store_restart_scan_takes_in_blocks_and_removes_leftovers(make_store, tmp_path):
    # 1. Three blocks written (layers kept), a fourth truncated, a torn tmp file; close.
    store = make_store()
    sources = {i: _data(seed=i) for i in range(4)}
    for i, src in sources.items():
        assert store.try_write(_key(i), src, i, num_layers=i + 1)
    _poll_until(store, 4)
    store.close()
    truncated = block_path(tmp_path, _key(3))
    os.truncate(truncated, HEADER_BYTES + 100)
    tmp_file = block_path(tmp_path, _key(9)).with_suffix(".blk.tmp")
    tmp_file.parent.mkdir(parents=True, exist_ok=True)
    tmp_file.write_bytes(b"torn")
    # 2. A new store on the same path takes in the three and removes the rest.
    store = make_store()
    assert store.scan() == 3
    assert not truncated.exists() and not tmp_file.exists()
    assert not store.contains(_key(3)) and store.bytes_used == 3 * FILE_BYTES
    for i in range(3):
        assert store.block_meta(_key(i)) == (BLOCK_BYTES, i + 1)
        done, dst = _read(store, _key(i))
        assert done.error is None and np.array_equal(dst, sources[i])


def test_store_scan_over_size_evicts_oldest_by_mtime(make_store, tmp_path):
    # 1. Three blocks, their mtimes set so that key 1 is the oldest, then key 0.
    store = make_store()
    for i in range(3):
        _write(store, _key(i), _data(seed=i))
    store.close()
    for i, age_s in ((0, 20), (1, 30), (2, 10)):
        mtime = time.time() - age_s
        os.utime(block_path(tmp_path, _key(i)), (mtime, mtime))
    # 2. A store with room for two evicts the oldest: key 1.
    store = make_store(size_bytes=2 * FILE_BYTES)
    assert store.scan() == 2
    assert [store.contains(_key(i)) for i in range(3)] == [True, False, True]
    assert store.counters.evictions == 1 and not block_path(tmp_path, _key(1)).exists()


def test_store_size_limit_evicts_lru_respecting_touch(make_store, tmp_path):
    # 1. Room for three; write 0, 1, 2, then touch 0.
    store = make_store(size_bytes=3 * FILE_BYTES)
    for i in range(3):
        _write(store, _key(i), _data(seed=i))
    store.touch(_key(0))
    # 2. Writing 3 and 4 evicts 1 and 2, the least recently used.
    for i in (3, 4):
        _write(store, _key(i), _data(seed=i))
    assert [store.contains(_key(i)) for i in range(5)] == [True, False, False, True, True]
    assert not block_path(tmp_path, _key(1)).exists() and not block_path(tmp_path, _key(2)).exists()
    assert store.counters.evictions == 2 and store.bytes_used <= 3 * FILE_BYTES


def test_store_block_larger_than_path_refused(make_store):
    store = make_store(size_bytes=FILE_BYTES)
    assert not store.try_write(_key(1), _data(BLOCK_BYTES + 1), 1)
    assert store.counters.writes_refused == 1 and store.num_inflight() == 0 and store.bytes_used == 0


def test_store_block_being_read_not_evicted(make_store):
    # 1. Room for three; 0, 1, 2 written; a read of 0 starts, then 1 and 2 are touched so 0
    #    is the least recently used.
    store = make_store(size_bytes=3 * FILE_BYTES)
    sources = [_data(seed=i) for i in range(3)]
    for i, src in enumerate(sources):
        _write(store, _key(i), src)
    dst = aligned_buffer(BLOCK_BYTES)
    assert store.try_read(_key(0), dst, 10)
    store.touch(_key(1))
    store.touch(_key(2))
    # 2. A write before the read is polled evicts 1, not 0.
    assert store.try_write(_key(3), _data(seed=3), 11)
    assert store.contains(_key(0)) and not store.contains(_key(1))
    # 3. The read is served intact.
    done = {d.token: d for d in _poll_until(store, 2)}
    assert done[10].error is None and np.array_equal(dst, sources[0])


def test_store_every_block_being_read_write_refused(make_store):
    store = make_store(size_bytes=2 * FILE_BYTES)
    for i in range(2):
        _write(store, _key(i), _data(seed=i))
    for i in range(2):
        assert store.try_read(_key(i), aligned_buffer(BLOCK_BYTES), 10 + i)
    # Nothing can be evicted: refused, and nothing was evicted.
    assert not store.try_write(_key(2), _data(), 20)
    assert store.counters.writes_refused == 1 and store.counters.evictions == 0
    assert all(d.error is None for d in _poll_until(store, 2))
    assert store.contains(_key(0)) and store.contains(_key(1))


def test_store_file_deleted_underneath_read_reports_io_error(make_store, tmp_path):
    store = make_store()
    key = _key(1)
    _write(store, key, _data())
    os.unlink(block_path(tmp_path, key))
    done, _ = _read(store, key)
    assert done.error and not done.is_corrupt
    assert store.counters.io_errors == 1 and store.counters.checksum_failures == 0
    assert not store.contains(key) and store.bytes_used == 0 and store.num_blocks == 0


def test_store_shard_dir_is_a_file_write_reports_io_error(make_store, tmp_path):
    # 1. The directory the block's file goes in is a regular file (fails for root too).
    store = make_store()
    key = _key(1)
    shard_dir = block_path(tmp_path, key).parent
    shard_dir.parent.mkdir(parents=True)
    shard_dir.write_bytes(b"in the way")
    # 2. The write is queued, and fails as an answer: counted, nothing on disk, room given back.
    assert store.try_write(key, _data(), 1)
    (done,) = _poll_until(store, 1)
    assert done.error and not done.is_corrupt and done.num_bytes == 0
    assert store.counters.io_errors == 1 and store.counters.blocks_written == 0
    assert not store.contains(key) and store.bytes_used == 0 and not store.is_busy(key)


def test_store_two_paths_writes_go_to_most_free(make_store, tmp_path):
    # 1. Path b starts with a block more; the next two writes go to a, then they alternate.
    path_a, path_b = tmp_path / "a", tmp_path / "b"
    store = make_store(paths=[path_a, path_b], size_bytes=10 * FILE_BYTES)
    assert store.bytes_total == 20 * FILE_BYTES
    _write(store, _key(0), _data())
    assert block_path(path_a, _key(0)).exists()
    for i in range(1, 6):
        _write(store, _key(i), _data(seed=i))
    on_a = [block_path(path_a, _key(i)).exists() for i in range(6)]
    on_b = [block_path(path_b, _key(i)).exists() for i in range(6)]
    assert on_a == [True, False, True, False, True, False]
    assert on_b == [not x for x in on_a]


def test_store_two_paths_full_one_evicts_on_its_own_path(make_store, tmp_path):
    path_a, path_b = tmp_path / "a", tmp_path / "b"
    store = make_store(paths=[path_a, path_b], size_bytes=FILE_BYTES)
    _write(store, _key(0), _data())  # to a
    _write(store, _key(1), _data())  # to b
    _write(store, _key(2), _data())  # both full: a's oldest (key 0) goes
    assert [store.contains(_key(i)) for i in range(3)] == [False, True, True]
    assert block_path(path_a, _key(2)).exists() and store.bytes_used == 2 * FILE_BYTES


def test_store_remove_during_read_unlinks_after_read(make_store, tmp_path):
    store = make_store()
    key = _key(1)
    src = _data()
    _write(store, key, src)
    dst = aligned_buffer(BLOCK_BYTES)
    assert store.try_read(key, dst, 2)
    # 1. Removed while being read: gone from the index at once, its file kept for the read.
    assert store.remove(key) and not store.remove(key)
    assert not store.contains(key) and store.is_busy(key) and not store.try_write(key, src, 3)
    # 2. Once the read is polled the file is gone too.
    (done,) = _poll_until(store, 1)
    assert done.error is None and np.array_equal(dst, src)
    assert not block_path(tmp_path, key).exists() and store.num_blocks == 0 and store.bytes_used == 0


def test_store_remove_during_write_never_lands(make_store, tmp_path):
    store = make_store()
    key = _key(1)
    assert store.try_write(key, _data(), 1)
    assert store.remove(key)
    (done,) = _poll_until(store, 1)
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
        assert store.try_write(_key(i), _data(seed=i), i)
    _poll_until(store, 3)
    assert len(num_wakes) == 3


def test_store_close_waits_for_queued_io(make_store):
    store = make_store(num_threads=1)
    for i in range(8):
        assert store.try_write(_key(i), _data(seed=i), i)
    store.close()
    assert len(store.poll()) == 8
    assert all(store.contains(_key(i)) for i in range(8))
    assert not store.try_write(_key(99), _data(), 99)


@pytest.mark.parametrize("kwargs", [{"paths": []}, {"size_bytes": 0}, {"num_threads": 0}])
def test_store_unusable_config_raises_config_error(tmp_path, kwargs):
    args = {"paths": [tmp_path], "size_bytes": FILE_BYTES, "num_threads": 1} | kwargs
    with pytest.raises(ConfigError):
        DiskStore(args.pop("paths"), **args)
