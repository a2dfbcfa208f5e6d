"""engine/blocks/eviction.py: the least recently used key first, a touch makes a key the
newest, keys taken in from a kept pool go before every key held, and ``pick`` skips what
may not be evicted."""

from __future__ import annotations

from engine.blocks.eviction import LruPolicy


def _policy(*keys) -> LruPolicy:
    policy = LruPolicy()
    for key in keys:
        policy.insert(key)
    return policy


def test_lru_policy_touch_makes_a_key_the_newest_and_insert_oldest_goes_first():
    # 1. Inserted a, b, c; touching a leaves b the oldest.
    policy = _policy("a", "b", "c")
    policy.touch("a")
    assert list(policy.oldest()) == ["b", "c", "a"]
    # 2. touch_all in turn: the last touched is the newest; an unknown key is not added.
    policy.touch_all(["c", "b", "z"])
    assert list(policy.oldest()) == ["a", "c", "b"]
    # 3. Keys of a kept pool go before all held, in the order given (oldest first).
    policy.insert_oldest(["k1", "k2"])
    assert list(policy.oldest()) == ["k1", "k2", "a", "c", "b"]
    # 4. A removed key is gone; removing it again is no error.
    policy.remove("a")
    policy.remove("a")
    assert list(policy.oldest()) == ["k1", "k2", "c", "b"]
    # 5. A key inserted again (a block saved anew) is the newest.
    policy.insert("k1")
    assert list(policy.oldest()) == ["k2", "c", "b", "k1"]


def test_lru_policy_pick_is_the_oldest_evictable_key_or_none():
    policy = _policy(1, 2, 3)
    assert policy.pick(lambda key: True) == 1
    assert policy.pick(lambda key: key != 1) == 2  # (1 leased or being written)
    assert policy.pick(lambda key: False) is None
    assert list(policy.oldest()) == [1, 2, 3]  # picking changes nothing


def test_lru_policy_every_change_counts_so_a_scan_knows_it_is_stale():
    policy = LruPolicy()
    seen = [policy.num_changes]
    for change in (lambda: policy.insert(1), lambda: policy.insert_oldest([0]), lambda: policy.touch(1),
                   lambda: policy.touch_all([0]), lambda: policy.remove(1)):
        change()
        seen.append(policy.num_changes)
    assert seen == sorted(set(seen))  # each one moved it on
