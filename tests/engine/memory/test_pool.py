"""engine.memory.pool.PagePool on its own: slabs per entry size, freeing, a full pool, size checks."""

from __future__ import annotations

import pytest

from engine.memory.pool import PagePool
from pegaflow.platform.errors import ConfigError

SLAB = 1024
NUM_SLABS = 4


def make_pool(num_slabs: int = NUM_SLABS) -> PagePool:
    return PagePool(num_slabs * SLAB, SLAB)


def alloc_all(pool: PagePool, entry_bytes: int) -> list[int]:
    """Allocate entries of ``entry_bytes`` until the pool says it is full."""
    offsets = []
    while (offset := pool.try_alloc(entry_bytes)) is not None:
        offsets.append(offset)
    return offsets


def test_pool_first_entries_share_one_slab_and_do_not_overlap():
    pool = make_pool()
    # 1. Four 256-byte entries fill exactly one 1 KiB slab.
    offsets = [pool.try_alloc(256) for _ in range(4)]
    # 2. All in one slab, each on its own 256-byte boundary.
    assert len({offset // SLAB for offset in offsets}) == 1
    assert sorted(offset % SLAB for offset in offsets) == [0, 256, 512, 768]
    assert (pool.num_entries, pool.bytes_used) == (4, 1024)


def test_pool_full_slab_takes_next_slab():
    pool = make_pool()
    # 1. Fill one slab with 512-byte entries, then ask for one more.
    first = [pool.try_alloc(512) for _ in range(2)]
    extra = pool.try_alloc(512)
    # 2. The extra entry lies in another slab.
    assert extra // SLAB != first[0] // SLAB


def test_pool_every_slab_used_try_alloc_returns_none():
    pool = make_pool()
    # 1. Allocate until the pool reports full.
    offsets = alloc_all(pool, 256)
    # 2. Exactly slabs x entries-per-slab entries, all distinct, inside the pool.
    assert len(offsets) == NUM_SLABS * (SLAB // 256)
    assert len(set(offsets)) == len(offsets)
    assert all(0 <= offset and offset + 256 <= pool.bytes_total for offset in offsets)
    # 3. Full is sticky until something is freed.
    assert pool.try_alloc(256) is None
    assert pool.bytes_used == pool.bytes_total


def test_pool_entry_size_not_dividing_slab_never_crosses_slab_end():
    pool = make_pool()
    # 1. 300-byte entries: three fit a 1 KiB slab, 124 bytes stay unused.
    offsets = alloc_all(pool, 300)
    assert len(offsets) == NUM_SLABS * 3
    # 2. No entry runs into the next slab.
    assert all(offset // SLAB == (offset + 300 - 1) // SLAB for offset in offsets)


def test_pool_two_entry_sizes_use_separate_slabs_without_overlap():
    pool = make_pool()
    # 1. Two models: 256-byte and 512-byte entries, interleaved.
    small = [pool.try_alloc(256) for _ in range(3)]
    large = [pool.try_alloc(512) for _ in range(3)]
    small.append(pool.try_alloc(256))
    # 2. No slab holds both sizes.
    assert not {o // SLAB for o in small} & {o // SLAB for o in large}
    # 3. No two entries overlap.
    spans = sorted([(o, o + 256) for o in small] + [(o, o + 512) for o in large])
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
    assert pool.bytes_used == 4 * 256 + 3 * 512


def test_pool_freed_entry_reused_before_a_new_slab():
    pool = make_pool()
    # 1. Fill one slab, free one entry of it.
    offsets = [pool.try_alloc(256) for _ in range(4)]
    pool.free(offsets[2])
    # 2. The next entry of that size takes the freed place, not a fresh slab.
    assert pool.try_alloc(256) == offsets[2]
    assert pool.num_entries == 4


def test_pool_emptied_slab_returns_to_free_list_for_another_size():
    pool = make_pool(num_slabs=1)
    # 1. The only slab serves 256-byte entries; a 512-byte entry finds no slab.
    offsets = [pool.try_alloc(256) for _ in range(4)]
    assert pool.try_alloc(512) is None
    # 2. Free all but one: the slab still belongs to the 256-byte size.
    for offset in offsets[1:]:
        pool.free(offset)
    assert pool.try_alloc(512) is None
    # 3. Free the last one: the slab is free again and serves the other size.
    pool.free(offsets[0])
    assert (pool.num_entries, pool.bytes_used) == (0, 0)
    assert pool.try_alloc(512) == 0


def test_pool_free_everything_restores_full_capacity():
    pool = make_pool()
    # 1. Fill the pool, free it all.
    offsets = alloc_all(pool, 256)
    for offset in offsets:
        pool.free(offset)
    assert (pool.num_entries, pool.bytes_used) == (0, 0)
    # 2. The whole pool can be filled again, this time with another size.
    assert len(alloc_all(pool, 1024)) == NUM_SLABS


def test_pool_tail_smaller_than_slab_unused():
    # 1. 4.5 slabs of pool: the half slab at the end is never handed out.
    pool = PagePool(4 * SLAB + SLAB // 2, SLAB)
    assert (pool.num_slabs, pool.bytes_total) == (4, 4 * SLAB)
    assert all(o + 512 <= 4 * SLAB for o in alloc_all(pool, 512))


@pytest.mark.parametrize("entry_bytes", [0, -256, SLAB + 1])
def test_pool_check_entry_bytes_outside_slab_raises_config_error(entry_bytes):
    pool = make_pool()
    # 1. Empty, negative and larger-than-slab entries are refused, by the check and by try_alloc.
    with pytest.raises(ConfigError, match="--slab-size"):
        pool.check_entry_bytes(entry_bytes)
    with pytest.raises(ConfigError):
        pool.try_alloc(entry_bytes)
    # 2. Nothing was allocated on the way.
    assert (pool.num_entries, pool.bytes_used) == (0, 0)


def test_pool_check_entry_bytes_in_a_one_slab_pool_says_to_raise_the_pool():
    # 1. `--pool-size 1KiB`: the slab is clamped to the pool, so raising --slab-size alone
    #    cannot help; the refusal names the pool, and the slab only if it was set.
    with pytest.raises(ConfigError, match=r"1024-byte slab: raise --pool-size .*--slab-size if it is set"):
        PagePool(1024, 1024).check_entry_bytes(4096)
    # 2. A pool of several slabs: the slab is the one to raise.
    with pytest.raises(ConfigError, match=r"slab: raise --slab-size$"):
        PagePool(4096, 1024).check_entry_bytes(4096)


@pytest.mark.parametrize("entry_bytes", [1, SLAB])
def test_pool_check_entry_bytes_within_slab_accepted(entry_bytes):
    pool = make_pool()
    # 1. One byte and exactly one slab are both fine.
    pool.check_entry_bytes(entry_bytes)
    assert pool.try_alloc(entry_bytes) is not None


# -- the ready part (the pool pinned a chunk at a time) -------------------------------------


def test_pool_alloc_never_beyond_the_ready_part_until_it_grows():
    # 1. Only the first slab is ready: four 256-byte entries, all in it, then full.
    pool = PagePool(NUM_SLABS * SLAB, SLAB, ready_bytes=SLAB)
    assert (pool.bytes_ready, pool.bytes_total) == (SLAB, NUM_SLABS * SLAB)
    first = alloc_all(pool, 256)
    assert len(first) == 4 and all(offset < SLAB for offset in first)
    # 2. Grown to three slabs: the next entries come from slabs 1 and 2 only, lowest first.
    pool.grow(3 * SLAB)
    second = alloc_all(pool, 256)
    assert len(second) == 8 and all(SLAB <= offset < 3 * SLAB for offset in second)
    assert second == sorted(second)
    # 3. A grow that goes backwards or stays inside a slab changes nothing.
    pool.grow(2 * SLAB)
    pool.grow(3 * SLAB + SLAB // 2)
    assert pool.bytes_ready == 3 * SLAB and pool.try_alloc(256) is None
    # 4. Grown to the whole pool: the last slab serves, and the pool is full at its total.
    pool.grow(NUM_SLABS * SLAB)
    assert len(alloc_all(pool, 256)) == 4 and pool.bytes_used == pool.bytes_total


def test_pool_freed_slab_of_the_ready_part_is_taken_before_a_grown_one():
    pool = PagePool(NUM_SLABS * SLAB, SLAB, ready_bytes=2 * SLAB)
    offsets = alloc_all(pool, 1024)
    pool.free(offsets[0])
    pool.grow(NUM_SLABS * SLAB)
    # 1. The slab freed first, then the grown ones in address order.
    assert [pool.try_alloc(1024) // SLAB for _ in range(3)] == [0, 2, 3]


def test_pool_kept_slab_beyond_the_ready_part_lends_no_free_slot_until_grown():
    # 1. A kept entry in slab 1 while only slab 0 is ready: slab 1's free slots wait.
    pool = PagePool(2 * SLAB, SLAB, ready_bytes=SLAB)
    assert pool.adopt([(SLAB + 256, 256)]) == [True]
    assert all(offset < SLAB for offset in alloc_all(pool, 256))
    # 2. Grown: its three other slots serve, never the kept one's.
    pool.grow(2 * SLAB)
    assert sorted(alloc_all(pool, 256)) == [SLAB, SLAB + 512, SLAB + 768]
