"""engine/commands/load_waits.py: a LOAD parked on disk reads goes on once no block of its
lease is being read, or late past PARKED_LOAD_DEADLINE_S; while parked it counts among its
client's copies in flight."""

from __future__ import annotations

from types import SimpleNamespace

from engine.commands.load_waits import PARKED_LOAD_DEADLINE_S, ParkedLoads
from engine.commands.received import Received
from pegaflow.platform.protocol import Load
from pegaflow.platform.wire import Opcode, encode_hashes


def _parked(client, command_id: int, lease_id: int) -> tuple[Received, Load]:
    received = Received(client, command_id, int(Opcode.LOAD), 1, 0.0)
    return received, Load(1, [0], encode_hashes([bytes(32)]), lease_id=lease_id)


def test_parked_loads_take_those_read_back_or_late_and_keep_the_rest():
    # 1. Three LOADs parked at t=0, on leases 1, 2 and 3: each counts as a copy in flight.
    client = SimpleNamespace(num_inflight=0)
    loads = ParkedLoads()
    for lease in (1, 2, 3):
        loads.park(*_parked(client, lease, lease), now=0.0)
    assert len(loads) == 3 and client.num_inflight == 3
    # 2. Lease 1's blocks are read back: its LOAD goes on, on time; the others wait.
    taken = loads.take(1.0, is_promoting=lambda lease: lease != 1)
    assert [(r.command_id, late) for r, _, late in taken] == [(1, False)]
    assert len(loads) == 2 and client.num_inflight == 2
    # 3. Past the deadline, still being read: answered late (vLLM recomputes).
    taken = loads.take(PARKED_LOAD_DEADLINE_S + 0.5, is_promoting=lambda lease: True)
    assert [(r.command_id, late) for r, _, late in taken] == [(2, True), (3, True)]
    assert len(loads) == 0 and client.num_inflight == 0


def test_parked_loads_at_the_deadline_exactly_still_wait():
    client = SimpleNamespace(num_inflight=0)
    loads = ParkedLoads()
    loads.park(*_parked(client, 7, 1), now=10.0)
    assert loads.take(10.0 + PARKED_LOAD_DEADLINE_S, is_promoting=lambda lease: True) == []
    assert len(loads) == 1 and client.num_inflight == 1


def test_parked_loads_take_all_at_a_stop_lets_every_one_go():
    clients = [SimpleNamespace(num_inflight=0), SimpleNamespace(num_inflight=0)]
    loads = ParkedLoads()
    for i, client in enumerate(clients):
        loads.park(*_parked(client, i, i), now=0.0)
    assert [r.command_id for r in loads.take_all()] == [0, 1]
    assert len(loads) == 0 and [c.num_inflight for c in clients] == [0, 0]
