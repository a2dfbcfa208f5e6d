"""LOADs parked until the disk tier has read their blocks back into the pool.

A LOAD of a lease whose blocks are still being read from disk waits here, counted in its
client's copies in flight (so its slot and memory stay until it is answered), and goes
on once no block of its lease is being read, or is answered MISSING_BLOCK (vLLM
recomputes) when it has waited past PARKED_LOAD_DEADLINE_S: the connector gives up on the
engine after ``command_timeout_ms`` (5 s) of an asynchronous load.
"""

from __future__ import annotations

from collections.abc import Callable

PARKED_LOAD_DEADLINE_S = 3.0


class ParkedLoads:
    def __init__(self) -> None:
        self._items: list[tuple[object, object, object, float]] = []  # client, rec, payload, since

    def __len__(self) -> int:
        return len(self._items)

    def park(self, client, rec, payload, now: float) -> None:
        self._items.append((client, rec, payload, now))
        client.num_inflight += 1

    def take(self, now: float, is_promoting: Callable[[int], bool]) -> list[tuple[object, object, object, bool]]:
        """The LOADs whose leases have no block left being read (or are gone), and those
        parked since before ``now - PARKED_LOAD_DEADLINE_S`` (True: late)."""
        ready, waiting, late_before = [], [], now - PARKED_LOAD_DEADLINE_S
        for client, rec, payload, since in self._items:
            if not is_promoting(rec.arg):
                ready.append((client, rec, payload, False))
            elif since < late_before:
                ready.append((client, rec, payload, True))
            else:
                waiting.append((client, rec, payload, since))
        self._items = waiting
        for client, *_ in ready:
            client.num_inflight -= 1
        return ready

    def take_all(self) -> list[tuple[object, object]]:
        """Every parked LOAD's (client, rec), at a stop: each to be answered by the caller."""
        items, self._items = self._items, []
        for client, *_ in items:
            client.num_inflight -= 1
        return [(client, rec) for client, rec, _, _ in items]
