"""The disk tier in a real engine (host backend): blocks evicted from a small pool come back
from disk byte for byte, survive an engine restart, and a corrupt, missing or unwritable
block is a miss, never served, with the pool's blocks untouched."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pegaflow.platform.wire import Status
from tests.conftest import unique_engine_name

NAMESPACE = 9
POOL = dict(pool_size="2MiB")  # 1 MiB slabs of 16 KiB entries: 128 blocks


def _disk(path: Path, *more: str) -> dict:
    return dict(POOL, extra=("--disk-path", str(path), *more))


def _store_rounds(client, rng, rounds: int) -> list[tuple[list[bytes], np.ndarray]]:
    """``rounds`` x 64 blocks saved under new hashes (the client holds 64 blocks)."""
    return [client.store(rng, NAMESPACE, list(range(64))) for _ in range(rounds)]


def _files(path: Path) -> list[Path]:
    return sorted((path / "pegaflow-blocks").rglob("*.blk"))


def _wait_written(engine, count: int) -> dict:
    return engine.wait_stats(lambda s: s["disk_blocks_written"] >= count)


def _on_disk_then_stopped(engine_factory, kv_client, rng, path: Path, name: str, block_ids: list[int]):
    """An engine of ``name`` stores ``block_ids``, writes them to disk and stops: (hashes, bytes)."""
    first = engine_factory(name, **_disk(path))
    hashes, saved = kv_client(first).store(rng, NAMESPACE, block_ids)
    _wait_written(first, len(block_ids))
    assert first.stop() == 0
    return hashes, saved


def test_disk_tier_blocks_evicted_from_the_pool_come_back_byte_exact(engine_factory, kv_client, rng, tmp_path):
    # 1. 64 blocks saved go to disk (the pool is within the spill window of full from the start).
    engine = engine_factory(**_disk(tmp_path / "d"))
    client = kv_client(engine)
    first_hashes, first_bytes = client.store(rng, NAMESPACE, list(range(64)))
    _wait_written(engine, 64)
    # 2. Three more rounds (192 blocks) through the 128-block pool evict the first ones.
    _store_rounds(client, rng, 3)
    assert engine.wait_stats(lambda s: s["evictions"] >= 64)
    # 3. A lookup finds them all, on disk; the load of its lease brings the saved bytes.
    found, done, loaded = client.look_up_and_load(NAMESPACE, first_hashes)
    assert found.num_hit_blocks == 64 and found.num_disk_blocks > 0
    assert done.is_ok and np.array_equal(loaded, first_bytes)
    stats = engine.fresh_stats()
    assert stats["disk_blocks_read"] >= found.num_disk_blocks and stats["disk_checksum_failures"] == 0
    assert stats["lookup_disk_blocks"] >= found.num_disk_blocks


def test_disk_tier_blocks_outlive_an_engine_restart(engine_factory, kv_client, rng, tmp_path):
    # 1. An engine writes 64 blocks to disk and stops.
    name = unique_engine_name("disk")
    hashes, saved = _on_disk_then_stopped(engine_factory, kv_client, rng, tmp_path / "d", name, list(range(64)))
    # 2. A new engine on the same path takes them in and serves them from disk, exactly.
    second = engine_factory(name, **_disk(tmp_path / "d"))
    assert "64 blocks" in second.stderr_text()
    found, done, loaded = kv_client(second).look_up_and_load(NAMESPACE, hashes)
    assert found.num_hit_blocks == 64 and found.num_disk_blocks == 64
    assert done.is_ok and np.array_equal(loaded, saved)


def test_disk_tier_flipped_byte_is_a_miss_never_served(engine_factory, kv_client, rng, tmp_path):
    # 1. Blocks on disk, a fresh engine (an empty pool), one byte of one block's data flipped.
    name = unique_engine_name("diskc")
    hashes, saved = _on_disk_then_stopped(engine_factory, kv_client, rng, tmp_path / "d", name, [0, 1, 2, 3])
    files = _files(tmp_path / "d")
    assert len(files) == 4
    victim = files[0]
    with victim.open("r+b") as f:
        f.seek(victim.stat().st_size - 100)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))
    second = engine_factory(name, **_disk(tmp_path / "d"))
    client = kv_client(second)
    # 2. The load of a prefix through the bad block fails (vLLM recomputes), the bytes it
    #    brought are never handed over as the block's; the checksum failure is counted.
    found, done, _ = client.look_up_and_load(NAMESPACE, hashes)
    assert found.num_disk_blocks == 4
    assert done.status == Status.MISSING_BLOCK
    stats = second.fresh_stats()
    assert stats["disk_checksum_failures"] == 1 and not victim.exists()
    # 3. Asked again, the bad block is a miss; the good ones are served exactly.
    found, done, loaded = client.look_up_and_load(NAMESPACE, hashes)
    bad = next(i for i, h in enumerate(hashes) if h.hex() in victim.name)
    assert found.num_hit_blocks == bad
    assert done is None or (done.is_ok and np.array_equal(loaded, saved[:, :bad]))


def test_disk_tier_file_deleted_underneath_is_a_miss(engine_factory, kv_client, rng, tmp_path):
    name = unique_engine_name("diskd")
    hashes, _ = _on_disk_then_stopped(engine_factory, kv_client, rng, tmp_path / "d", name, [0, 1])
    for path in _files(tmp_path / "d"):
        path.unlink()
    second = engine_factory(name, **_disk(tmp_path / "d"))
    assert kv_client(second).num_hits(NAMESPACE, hashes) == 0  # nothing taken in, nothing served


def test_disk_tier_too_small_for_a_block_refuses_writes_and_keeps_the_pool(engine_factory, kv_client, rng,
                                                                          tmp_path):
    # A disk of 4 KiB holds no 16 KiB block: every write is refused, the pool serves as before.
    engine = engine_factory(**_disk(tmp_path / "d", "--disk-size", "4KiB"))
    client = kv_client(engine)
    hashes, saved = client.store(rng, NAMESPACE, [0, 1, 2, 3])
    stats = engine.wait_stats(lambda s: s["disk_writes_refused"] >= 4)
    assert stats["disk_blocks_written"] == 0 and stats["disk_bytes_used"] == 0
    found, done, loaded = client.look_up_and_load(NAMESPACE, hashes)
    assert found.num_hit_blocks == 4 and found.num_disk_blocks == 0
    assert done.is_ok and np.array_equal(loaded, saved)


def test_disk_tier_unwritable_path_is_a_clear_start_error(engine_factory, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    engine = engine_factory(wait=False, **_disk(blocker / "d"))
    assert engine.proc.wait(30) != 0
    engine.is_clean_exit_expected = False
    assert "--disk-path" in engine.stderr_text()


def test_disk_tier_path_whose_parent_is_missing_is_refused_and_nothing_made(engine_factory, tmp_path):
    # 1. A mistyped mount point: /mnt/nvme0 missing, the path under it.
    path = tmp_path / "nvme0" / "pegaflow"
    engine = engine_factory(wait=False, **_disk(path))
    # 2. The engine refuses to start, naming the missing parent, and creates no tree for it
    #    (which would land on the root disk and be sized at 90 % of it).
    assert engine.proc.wait(30) != 0
    engine.is_clean_exit_expected = False
    assert f"its parent {tmp_path / 'nvme0'} does not exist" in engine.stderr_text()
    assert not (tmp_path / "nvme0").exists()


def test_disk_tier_dropped_blocks_leave_the_disk_too(engine_factory, kv_client, rng, tmp_path):
    # 1. Blocks in the pool and on disk, leased by a lookup, when their writer finds them
    #    computed from bad data.
    name = unique_engine_name("diskx")
    first = engine_factory(name, **_disk(tmp_path / "d"))
    client = kv_client(first)
    hashes, _ = client.store(rng, NAMESPACE, [0, 1, 2])
    _wait_written(first, 3)
    leased = client.client.lookup(NAMESPACE, hashes)
    assert client.client.wait(client.client.submit_drop(NAMESPACE, hashes)).is_ok
    assert client.release(leased.lease_id).is_ok
    # 2. Neither tier serves them: not now, not after the pool forgot them (a restart).
    assert client.num_hits(NAMESPACE, hashes) == 0
    assert _files(tmp_path / "d") == []
    assert first.stop() == 0
    second = engine_factory(name, **_disk(tmp_path / "d"))
    assert kv_client(second).num_hits(NAMESPACE, hashes) == 0


def test_disk_tier_block_read_back_can_still_be_dropped_by_its_writer(engine_factory, kv_client, rng, tmp_path):
    # 1. A block served from disk after a restart (whose SAVE it was is not known there).
    name = unique_engine_name("diskr")
    hashes, _ = _on_disk_then_stopped(engine_factory, kv_client, rng, tmp_path / "d", name, [0, 1])
    second = engine_factory(name, **_disk(tmp_path / "d"))
    client = kv_client(second)
    found, done, _ = client.look_up_and_load(NAMESPACE, hashes)
    assert found.num_disk_blocks == 2 and done.is_ok
    # 2. A DROP of it is obeyed: the copy read back into the pool goes, and the disk's.
    assert client.client.wait(client.client.submit_drop(NAMESPACE, hashes)).value == 2
    assert client.num_hits(NAMESPACE, hashes) == 0 and _files(tmp_path / "d") == []


def test_disk_tier_path_of_a_running_engine_is_refused_to_another(engine_factory, tmp_path):
    engine_factory(**_disk(tmp_path / "d"))
    second = engine_factory(wait=False, **_disk(tmp_path / "d"))
    assert second.proc.wait(30) != 0
    second.is_clean_exit_expected = False
    assert "is in use by another engine" in second.stderr_text()
