"""engine/disk/ownership.py: the disk tier takes in only this user's files, in directories
no one else may write, and keeps them private.  As root (CI), chown stands in for a second
user and ``setpriv`` runs a reader as an unprivileged one; skipped where this process may
not do either."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

from engine.disk import blockfile
from engine.disk.blockfile import BLOCKS_DIR, aligned_buffer, block_path
from engine.disk.ownership import check_disk_path, secure_tree
from pegaflow.platform.errors import ConfigError

OTHER_UID = 54321
NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand a file to another uid")


def _key(i: int, namespace: int = 7) -> tuple[int, bytes]:
    return namespace, hashlib.sha256(str(i).encode()).digest() + bytes([32])


def _plant(root: Path, i: int = 1) -> Path:
    """A valid block file (right place, header, checksum) under ``root``; its path."""
    src = aligned_buffer(16 << 10)
    src[:] = np.random.default_rng(i).integers(0, 256, src.size, dtype=np.uint8)
    path = block_path(root, _key(i))
    blockfile.write_block(path, _key(i), memoryview(src))
    return path


@pytest.fixture
def open_dir():
    """A directory every user may enter (not under pytest's private tmp): what another user
    could reach of the tier is what its own modes allow."""
    path = Path(tempfile.mkdtemp(dir="/tmp", prefix="pegaflow-own-"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path)


@needs_root
def test_ownership_disk_path_of_another_user_is_refused(tmp_path):
    path = tmp_path / "d"
    path.mkdir(mode=0o700)
    os.chown(path, OTHER_UID, OTHER_UID)
    with pytest.raises(ConfigError, match=f"owned by uid {OTHER_UID}"):
        check_disk_path(path)


def test_ownership_world_writable_disk_path_is_refused_a_private_one_taken(tmp_path):
    path = tmp_path / "d"
    path.mkdir()
    os.chmod(path, 0o777)
    with pytest.raises(ConfigError, match="mode 777"):
        check_disk_path(path)
    os.chmod(path, 0o755)
    check_disk_path(path)


@needs_root
@pytest.mark.parametrize("what", ["file", "dir"])
def test_ownership_entry_of_another_user_in_the_tree_is_refused(tmp_path, what):
    planted = _plant(tmp_path)
    os.chown(planted if what == "file" else planted.parent, OTHER_UID, OTHER_UID)
    with pytest.raises(ConfigError, match=f"owned by uid {OTHER_UID}"):
        secure_tree(tmp_path / BLOCKS_DIR)


def test_ownership_link_and_world_writable_directory_in_the_tree_are_refused(tmp_path):
    planted = _plant(tmp_path)
    os.chmod(planted.parent, 0o777)
    with pytest.raises(ConfigError, match="mode 777"):
        secure_tree(tmp_path / BLOCKS_DIR)
    os.chmod(planted.parent, 0o700)
    os.symlink(planted, planted.with_name("other.blk"))
    with pytest.raises(ConfigError, match="is a link"):
        secure_tree(tmp_path / BLOCKS_DIR)


def test_ownership_new_files_are_private_and_an_old_tree_is_tightened(tmp_path):
    # 1. What write_block makes: 0600 files in 0700 directories, up to the tree's root.
    planted = _plant(tmp_path)
    for path in (planted.parent, planted.parent.parent, tmp_path / BLOCKS_DIR):
        assert path.stat().st_mode & 0o777 == 0o700, path
    assert planted.stat().st_mode & 0o777 == 0o600
    # 2. A tree an earlier engine wrote with looser modes is made private at start.
    os.chmod(planted, 0o644)
    os.chmod(planted.parent, 0o755)
    assert secure_tree(tmp_path / BLOCKS_DIR) == 2
    assert planted.stat().st_mode & 0o777 == 0o600 and planted.parent.stat().st_mode & 0o777 == 0o700


@needs_root
def test_ownership_file_of_another_user_is_neither_listed_nor_read(tmp_path):
    planted = _plant(tmp_path)
    os.chown(planted, OTHER_UID, OTHER_UID)
    found, _ = blockfile.list_blocks(tmp_path)
    assert found == []
    dst = aligned_buffer(16 << 10)
    assert blockfile.read_block(planted, _key(1), memoryview(dst)) == "the file is not a regular file of this user"
    assert not dst.any()  # not a byte of it read


@needs_root
def test_ownership_engine_refuses_a_disk_path_another_user_made(engine_factory, tmp_path):
    # 1. Another user made the directory first and put a valid block in it.
    path = tmp_path / "d"
    _plant(path)
    for dirpath, dirnames, filenames in os.walk(path):
        for name in [dirpath, *(os.path.join(dirpath, n) for n in dirnames + filenames)]:
            os.chown(name, OTHER_UID, OTHER_UID)
    # 2. The engine does not start on it, and says why in one line.
    engine = engine_factory(wait=False, pool_size="2MiB", extra=("--disk-path", str(path)))
    engine.is_clean_exit_expected = False
    assert engine.proc.wait(30) != 0
    errors = [line for line in engine.stderr_text().splitlines() if line.startswith("pegaflow-engine: ")]
    assert len(errors) == 1 and f"owned by uid {OTHER_UID}" in errors[0], engine.stderr_text()


@needs_root
def test_ownership_engine_blocks_on_disk_are_unreadable_by_another_user(engine_factory, kv_client, rng,
                                                                       open_dir):
    # 1. An engine writes blocks to a disk path in a directory every user may enter.
    engine = engine_factory(pool_size="2MiB", extra=("--disk-path", str(open_dir / "d"),
                                                     "--disk-admission", "all"))
    kv_client(engine).store(rng, 9, [0, 1])
    engine.wait_stats(lambda s: s["disk_blocks_written"] >= 2)
    files = sorted((open_dir / "d" / BLOCKS_DIR).rglob("*.blk"))
    assert len(files) == 2
    # 2. Files 0600, directories 0700 (the disk path itself too: the engine made it).
    assert {f.stat().st_mode & 0o777 for f in files} == {0o600}
    assert (open_dir / "d").stat().st_mode & 0o777 == 0o700
    # 3. An unprivileged user cannot read one.
    if shutil.which("setpriv") is None:
        pytest.skip("no setpriv to read as another user")
    result = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                             "cat", str(files[0])], capture_output=True)
    # (refused by the file's mode: a setpriv that failed by itself says something else)
    assert result.returncode != 0 and result.stdout == b"" and b"Permission denied" in result.stderr
