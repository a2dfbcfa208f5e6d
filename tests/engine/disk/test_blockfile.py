"""engine/disk/blockfile.py: a block's file holds its key, size and checksum, and reads back
exactly; a damaged or misplaced file is told apart from a good one."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import resource
import signal
import tempfile
from pathlib import Path

import numpy as np
import pytest

from engine.disk import blockfile
from engine.disk.blockfile import HEADER_BYTES, aligned_buffer, block_path, decode_header, encode_header
from pegaflow.platform.errors import WireVersionError

SIZES = [5000, 64 << 10, 3 * (64 << 10), 4096 * 3 + 1]


def _key(i: int, namespace: int = 7) -> tuple[int, bytes]:
    return namespace, hashlib.sha256(str(i).encode()).digest() + bytes([32])  # digest + length, as the engine keys


def _data(num_bytes: int, seed: int = 0) -> np.ndarray:
    buf = aligned_buffer(num_bytes)
    buf[:] = np.random.default_rng(seed).integers(0, 256, num_bytes, dtype=np.uint8)
    return buf


def _supports_direct(path: Path) -> bool:
    probe = path / "direct-probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0)))
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    finally:
        probe.unlink(missing_ok=True)
    return hasattr(os, "O_DIRECT")


def test_header_roundtrip_returns_key_size_checksum_layers():
    # 1. A namespace with the top bit set and a full 32-byte digest (and its length byte) survive.
    key = (2**64 - 3, bytes(range(32)) + bytes([32]))
    raw = encode_header(key, 123456, 0xDEADBEEFCAFEF00D, num_layers=61)
    assert raw.nbytes == HEADER_BYTES
    assert raw.ctypes.data % 4096 == 0
    assert decode_header(raw) == (key, 123456, 0xDEADBEEFCAFEF00D, 61)


@pytest.mark.parametrize("field, value", [("magic", 0x1234), ("version", 99), ("header_bytes", 512)])
def test_decode_header_other_magic_version_or_size_raises_wire_version_error(field, value):
    raw = encode_header(_key(1), 10, 1)
    raw.view(blockfile.BLOCK_HEADER)[0][field] = value
    with pytest.raises(WireVersionError):
        decode_header(raw)


def test_decode_header_short_raises_wire_version_error():
    with pytest.raises(WireVersionError):
        decode_header(bytes(encode_header(_key(1), 10, 1))[:100])


def test_block_path_shards_by_namespace_and_hash_prefix(tmp_path):
    key = (0xAB, bytes([0xCD]) + bytes(31) + bytes([32]))
    hex_hash = key[1].hex()
    assert block_path(tmp_path, key) == tmp_path / "pegaflow-blocks" / "00000000000000ab" / "cd" / f"{hex_hash}.blk"


@pytest.mark.parametrize("num_bytes", SIZES)
def test_write_block_then_read_block_returns_same_bytes(tmp_path, num_bytes):
    # 1. Write a block from an aligned (or odd-sized) buffer; no tmp file remains.
    key, src = _key(num_bytes), _data(num_bytes, seed=num_bytes)
    path = block_path(tmp_path, key)
    blockfile.write_block(path, key, memoryview(src))
    assert path.stat().st_size == HEADER_BYTES + num_bytes
    assert list(path.parent.glob("*.tmp")) == []
    # 2. It reads back byte for byte, and checks out.
    dst = aligned_buffer(num_bytes)
    assert blockfile.read_block(path, key, memoryview(dst)) is None
    assert np.array_equal(dst, src)


def test_write_block_aligned_buffers_use_direct_io(tmp_path):
    if not _supports_direct(tmp_path):
        pytest.skip("this file system does not take O_DIRECT")
    key, src = _key(1), _data(64 << 10)
    assert blockfile.write_block(block_path(tmp_path, key), key, memoryview(src)) is True
    # An odd size (or an unaligned address) goes buffered.
    assert blockfile.write_block(block_path(tmp_path, _key(2)), _key(2), memoryview(src)[:5000]) is False
    unaligned = aligned_buffer(4096 * 5)[1:4096 * 4 + 1]
    assert blockfile.write_block(block_path(tmp_path, _key(3)), _key(3), memoryview(unaligned)) is False


def test_write_block_open_direct_einval_falls_back_to_buffered(tmp_path, monkeypatch):
    # 1. A file system that refuses O_DIRECT at open (as tmpfs does): EINVAL.
    real_open = os.open

    def open_without_direct(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(blockfile.os, "open", open_without_direct)
    # 2. Aligned buffers still write and read back, buffered.
    key, src = _key(1), _data(64 << 10)
    path = block_path(tmp_path, key)
    assert blockfile.write_block(path, key, memoryview(src)) is False
    dst = aligned_buffer(64 << 10)
    assert blockfile.read_block(path, key, memoryview(dst)) is None
    assert np.array_equal(dst, src)


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_write_block_on_tmpfs_round_trips():
    with tempfile.TemporaryDirectory(dir="/dev/shm") as root:
        key, src = _key(1), _data(64 << 10)
        path = block_path(Path(root), key)
        blockfile.write_block(path, key, memoryview(src))
        dst = aligned_buffer(64 << 10)
        assert blockfile.read_block(path, key, memoryview(dst)) is None
        assert np.array_equal(dst, src)


def test_write_block_parent_is_a_file_raises_and_makes_no_file(tmp_path):
    key = _key(1)
    path = block_path(tmp_path, key)
    path.parent.parent.mkdir(parents=True)
    path.parent.write_bytes(b"not a directory")
    with pytest.raises(OSError):
        blockfile.write_block(path, key, memoryview(_data(5000)))
    assert os.listdir(path.parent.parent) == [path.parent.name]  # the file in the way, alone


@contextlib.contextmanager
def _file_size_limit(num_bytes: int):
    """Writes past ``num_bytes`` of a file fail (EFBIG) in this process meanwhile."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death
    resource.setrlimit(resource.RLIMIT_FSIZE, (num_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)


@pytest.mark.parametrize("limit", [0, HEADER_BYTES + 4096])
def test_write_block_failing_midway_removes_its_tmp_file(tmp_path, limit):
    # 1. The tmp file is made, then a write into it fails (the file-size limit: EFBIG),
    #    before or after some of it is written.
    key = _key(1)
    path = block_path(tmp_path, key)
    path.parent.mkdir(parents=True)
    with _file_size_limit(limit), pytest.raises(OSError) as info:
        blockfile.write_block(path, key, memoryview(_data(64 << 10)))
    assert info.value.errno in (errno.EFBIG, errno.EIO)
    # 2. Neither the block nor its tmp file is left: the directory is empty.
    assert os.listdir(path.parent) == []


def test_read_block_flipped_data_byte_reports_checksum_mismatch(tmp_path):
    key, src = _key(1), _data(64 << 10)
    path = block_path(tmp_path, key)
    blockfile.write_block(path, key, memoryview(src))
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + 777)
        byte = f.read(1)
        f.seek(HEADER_BYTES + 777)
        f.write(bytes([byte[0] ^ 0x01]))
    assert "checksum" in blockfile.read_block(path, key, memoryview(aligned_buffer(64 << 10)))


def test_read_block_other_key_or_size_reports_mismatch(tmp_path):
    key, src = _key(1), _data(8192)
    path = block_path(tmp_path, key)
    blockfile.write_block(path, key, memoryview(src))
    assert "another key" in blockfile.read_block(path, _key(2), memoryview(aligned_buffer(8192)))
    assert "bytes" in blockfile.read_block(path, key, memoryview(aligned_buffer(4096)))


def test_read_block_truncated_file_reports_short_file(tmp_path):
    key, src = _key(1), _data(8192)
    path = block_path(tmp_path, key)
    blockfile.write_block(path, key, memoryview(src))
    os.truncate(path, HEADER_BYTES + 100)
    assert "ends after 100" in blockfile.read_block(path, key, memoryview(aligned_buffer(8192)))


def test_list_blocks_tells_blocks_from_leftovers(tmp_path):
    # 1. Two good blocks, one truncated, one moved to another key's place, a tmp file and
    #    a file that is not ours.
    for i in range(4):
        blockfile.write_block(block_path(tmp_path, _key(i)), _key(i), memoryview(_data(5000, seed=i)))
    os.truncate(block_path(tmp_path, _key(2)), HEADER_BYTES + 10)
    misplaced = block_path(tmp_path, _key(99))
    misplaced.parent.mkdir(parents=True, exist_ok=True)
    os.rename(block_path(tmp_path, _key(3)), misplaced)
    tmp_file = block_path(tmp_path, _key(5)).with_suffix(".blk.tmp")
    tmp_file.parent.mkdir(parents=True, exist_ok=True)
    tmp_file.write_bytes(b"torn")
    foreign = tmp_path / "pegaflow-blocks" / "README"
    foreign.write_text("hello")
    # 2. Only the good ones are found; the others are leftovers; the foreign file is neither.
    found, leftovers = blockfile.list_blocks(tmp_path)
    assert sorted(block.key for block in found) == sorted([_key(0), _key(1)])
    assert all(block.file_bytes == HEADER_BYTES + 5000 for block in found)
    assert sorted(leftovers) == sorted([block_path(tmp_path, _key(2)), misplaced, tmp_file])
