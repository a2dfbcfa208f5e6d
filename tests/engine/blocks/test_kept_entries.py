"""engine/blocks/kept_entries.py: a kept pool's READY records taken into a new index, those
past the pool's pinned part once it grows to them, each below every entry already in the
eviction order; a key saved again meanwhile, or RESET, keeps its page out.  The pool and its
table are stand-ins here (their own tests: tests/engine/memory/; a whole engine:
tests/engine/test_keep_pool.py)."""

from __future__ import annotations

from engine.blocks.entries import ORPHAN
from engine.blocks.eviction import LruPolicy
from engine.blocks.kept_entries import KeptEntries

PAGE = 4096


class FakeTable:
    is_kept = True

    def __init__(self, places: dict):
        self.places, self.kept, self.freed = places, None, []

    def ready_places(self) -> dict:
        return dict(self.places)

    def clear_except(self, kept) -> None:
        self.kept = sorted(kept)

    def free(self, offset: int, size: int) -> None:
        self.freed.append(offset)


class FakePool:
    """Pinned up to ``bytes_ready``; places an entry at any offset under ``size``."""

    def __init__(self, size: int, bytes_ready: int):
        self.size, self.bytes_ready, self.freed = size, bytes_ready, []

    def adopt(self, places) -> list[bool]:
        return [offset + size <= self.size for offset, size in places]

    def grow(self, ready_bytes: int) -> None:
        self.bytes_ready = ready_bytes

    def free(self, offset: int) -> None:
        self.freed.append(offset)


def _key(i: int, namespace: int = 1):
    return namespace, bytes([i]) * 33


def _kept(places: dict, pool_bytes: int, ready_bytes: int):
    entries, policy = {}, LruPolicy()
    table, pool = FakeTable(places), FakePool(pool_bytes, ready_bytes)
    return KeptEntries(entries, table, pool, policy), entries, policy, table, pool


def test_kept_entries_adopt_takes_ready_records_that_fit_and_waits_for_the_rest():
    # Records in LRU order: 0 and 1 in the pinned part, 2 past it, 3 past the pool's end,
    # 4 a record of no layers (no engine writes one).
    places = {_key(0): (0, PAGE, 2), _key(1): (PAGE, PAGE, 2), _key(2): (4 * PAGE, PAGE, 2),
              _key(3): (64 * PAGE, PAGE, 2), _key(4): (2 * PAGE, PAGE, 0)}
    kept, entries, policy, table, _ = _kept(places, pool_bytes=8 * PAGE, ready_bytes=2 * PAGE)
    assert kept.adopt_table() == 3
    # 1. In the pinned part: READY now (every layer done, no client owns them).
    assert list(entries) == [_key(0), _key(1)] and list(policy.oldest()) == [_key(0), _key(1)]
    entry = entries[_key(0)]
    assert entry.is_ready and entry.owner_slot == ORPHAN and entry.done_mask == 0b11
    # 2. The table keeps the three taken in, and clears the rest.
    assert table.kept == [(0, PAGE), (PAGE, PAGE), (4 * PAGE, PAGE)]
    assert [key for _, _, key, _ in kept.beyond_ready] == [_key(2)]


def test_kept_entries_grow_takes_in_below_every_entry_and_skips_keys_saved_again():
    places = {_key(0): (4 * PAGE, PAGE, 1), _key(1): (5 * PAGE, PAGE, 1), _key(2): (6 * PAGE, PAGE, 1),
              _key(3): (0, PAGE, 1)}
    kept, entries, policy, table, pool = _kept(places, pool_bytes=8 * PAGE, ready_bytes=PAGE)
    assert kept.adopt_table() == 4 and list(entries) == [_key(3)]
    # 1. Meanwhile key 1 is saved again (a new entry), and a new key is stored.
    entries[_key(1)] = entries[_key(3)]
    policy.insert(_key(9))
    # 2. Pinned up to 6 pages: keys 0 (and 1, kept out) reached; key 2 still waits.
    assert kept.grow(6 * PAGE) == 1
    assert list(policy.oldest()) == [_key(0), _key(3), _key(9)]
    assert table.freed == [5 * PAGE] and pool.freed == [5 * PAGE]
    # 3. The rest, once pinned.
    assert kept.grow(8 * PAGE) == 1 and list(policy.oldest())[0] == _key(2)


def test_kept_entries_reset_drops_those_not_taken_in_and_frees_them_when_reached():
    places = {_key(0, 1): (4 * PAGE, PAGE, 1), _key(1, 2): (5 * PAGE, PAGE, 1)}
    kept, entries, _, table, pool = _kept(places, pool_bytes=8 * PAGE, ready_bytes=PAGE)
    kept.adopt_table()
    assert kept.drop_namespace(1) == 1 and kept.drop_namespace(1) == 0
    assert table.freed == [4 * PAGE]
    assert kept.grow(8 * PAGE) == 1 and list(entries) == [_key(1, 2)]
    assert pool.freed == [4 * PAGE]
