"""Blocks of the disk store's tests (test_store.py, test_scan.py): keys as the engine keys
them, random aligned data, a write or read waited for, and stores closed after the test."""

from __future__ import annotations

import hashlib
import time
from contextlib import contextmanager

import numpy as np

from engine.disk.blockfile import HEADER_BYTES, aligned_buffer
from engine.disk.store import DiskDone, DiskStore

BLOCK_BYTES = 64 << 10
FILE_BYTES = HEADER_BYTES + BLOCK_BYTES


def block_key(i: int, namespace: int = 7) -> tuple[int, bytes]:
    return namespace, hashlib.sha256(str(i).encode()).digest() + bytes([32])  # digest + length, as the engine keys


def random_block(num_bytes: int = BLOCK_BYTES, seed: int = 0) -> np.ndarray:
    buf = aligned_buffer(num_bytes)
    buf[:] = np.random.default_rng(seed).integers(0, 256, num_bytes, dtype=np.uint8)
    return buf


def poll_until(store: DiskStore, num_done: int, deadline_s: float = 10.0) -> list[DiskDone]:
    done: list[DiskDone] = []
    deadline = time.monotonic() + deadline_s
    while len(done) < num_done:
        assert time.monotonic() < deadline, f"{len(done)} of {num_done} results after {deadline_s} s"
        done += store.poll()
        time.sleep(0.001)
    assert len(done) == num_done
    return done


def write_block(store: DiskStore, key, src, token: int = 1) -> DiskDone:
    assert store.try_write(key, src, token)
    (done,) = poll_until(store, 1)
    assert done.error is None and not done.is_read and done.token == token
    return done


def read_block(store: DiskStore, key, num_bytes: int = BLOCK_BYTES) -> tuple[DiskDone, np.ndarray]:
    dst = aligned_buffer(num_bytes)
    assert store.try_read(key, dst, 99)
    (done,) = poll_until(store, 1)
    return done, dst


@contextmanager
def disk_stores(tmp_path):
    """A ``make(paths=None, size_bytes=..., **kwargs)`` of DiskStores on ``tmp_path``, each closed at the end."""
    stores: list[DiskStore] = []

    def make(paths=None, size_bytes: int = 100 * FILE_BYTES, **kwargs) -> DiskStore:
        stores.append(DiskStore(paths or [tmp_path], size_bytes, **kwargs))
        return stores[-1]

    try:
        yield make
    finally:
        for store in stores:
            store.close()
