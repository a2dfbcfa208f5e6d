"""LOADs parked until the disk tier has read their blocks back into the pool.

A LOAD of a lease whose blocks are still being read from disk waits here, counted in its
client's copies in flight (so its slot and memory stay until it is answered), and goes
on once no block of its lease is being read, or is answered MISSING_BLOCK (vLLM
recomputes) when it has waited past PARKED_LOAD_DEADLINE_S: the connector gives up on the
engine after ``command_timeout_ms`` (5 s) of an asynchronous load.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from pegaflow.platform.protocol import Load

from .received import Received

PARKED_LOAD_DEADLINE_S = 3.0


class ParkedLoad(NamedTuple):
    received: Received
    load: Load
    since: float  # monotonic


class ParkedLoads:
    def __init__(self) -> None:
        self._items: list[ParkedLoad] = []

    def __len__(self) -> int:
        return len(self._items)

    def park(self, received: Received, load: Load, now: float) -> None:
        self._items.append(ParkedLoad(received, load, now))
        received.client.num_inflight += 1

    def take(self, now: float, is_promoting: Callable[[int], bool]) -> list[tuple[Received, Load, bool]]:
        """The LOADs whose leases have no block left being read (or are gone), and those
        parked since before ``now - PARKED_LOAD_DEADLINE_S`` (True: late)."""
        ready, waiting, late_before = [], [], now - PARKED_LOAD_DEADLINE_S
        for item in self._items:
            if not is_promoting(item.load.lease_id):
                ready.append((item.received, item.load, False))
            elif item.since < late_before:
                ready.append((item.received, item.load, True))
            else:
                waiting.append(item)
        self._items = waiting
        for received, *_ in ready:
            received.client.num_inflight -= 1
        return ready

    def take_all(self) -> list[Received]:
        """Every parked LOAD, at a stop: each to be answered by the caller."""
        items, self._items = self._items, []
        for item in items:
            item.received.client.num_inflight -= 1
        return [item.received for item in items]
