"""engine.client_table: claims accepted under the control lock (a real engine's segments)."""

from __future__ import annotations

import itertools
import os

from engine.config import EngineConfig
from engine.server import EngineServer
from pegaflow.wire import SlotState
from tests.conftest import shm_leftovers

_names = itertools.count()


def test_client_table_accepts_a_claim_only_under_the_control_lock():
    # A client that gives up on its attach frees its still-CLAIMED slot under the control
    # lock; the engine accepts under the same lock, so it never activates a slot given up.
    name = f"t{os.getpid()}_claim{next(_names)}"
    server = EngineServer(EngineConfig(name=name, backend="host", pool_bytes=4 << 20,
                                       slab_bytes=1 << 20, num_slots=2))
    try:
        slots = server.segments.slots
        # 1. Slot 1 is claimed by us; someone holds the control lock: it stays CLAIMED.
        slots["pid"][1], slots["state"][1] = os.getpid(), SlotState.CLAIMED
        from pegaflow.locks import ControlLock
        other = ControlLock.open(name)
        other.acquire(1.0)
        server.table.accept_claims()
        assert int(slots["state"][1]) == SlotState.CLAIMED and 1 not in server.table.clients
        # 2. The lock free again: the claim is accepted.
        other.release()
        other.close()
        server.table.accept_claims()
        assert int(slots["state"][1]) == SlotState.ACTIVE and server.table.clients[1].pid == os.getpid()
    finally:
        server.shutdown()
    assert shm_leftovers(name) == []
