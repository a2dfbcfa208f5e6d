"""Eviction policy: which stored block to give up first (least recently used).

Policy only: it orders keys and never frees memory; the index asks it for victims and
skips any that a lease or an in-flight copy still holds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable


class LruPolicy:
    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()
        self.num_changes = 0  # any insert, touch or removal: a scan of the order is stale

    def insert(self, key: Hashable) -> None:
        self.num_changes += 1
        self._order[key] = None
        self._order.move_to_end(key)

    def insert_oldest(self, keys: list[Hashable]) -> None:
        """``keys`` (least recently used first), all used less recently than any key held."""
        self.num_changes += 1
        for key in reversed(keys):
            self._order[key] = None
            self._order.move_to_end(key, last=False)

    def touch(self, key: Hashable) -> None:
        self.num_changes += 1
        if key in self._order:
            self._order.move_to_end(key)

    def touch_all(self, keys) -> None:
        """``touch`` each of ``keys`` in turn (the last one ends the most recently used)."""
        self.num_changes += 1
        order = self._order
        for key in keys:
            if key in order:
                order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self.num_changes += 1
        self._order.pop(key, None)

    def oldest(self):
        """Keys from the least recently used on (do not change the policy while iterating)."""
        return iter(self._order)

    def pick(self, is_evictable: Callable[[Hashable], bool]) -> Hashable | None:
        """The least recently used key that ``is_evictable``, or None."""
        for key in self._order:
            if is_evictable(key):
                return key
        return None
