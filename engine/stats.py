"""The engine's counters and gauges, kept directly in the stats segment.

One writer (the engine's main thread); ``pegaflow-stat`` maps the segment read-only.
Updates go through a ``memoryview`` of 64-bit words: a few tens of nanoseconds each.
The words written on every answer (``set_gauges``, ``count_command``) have their indices
bound at import, so those updates look nothing up.
"""

from __future__ import annotations

import bisect
import os
import time

import numpy as np

from pegaflow.platform.wire import (
    CLIENT_STATS,
    LATENCY_BUCKETS_S,
    LATENCY_OPCODES,
    NUM_LATENCY_BUCKETS,
    NUM_OPCODE_COUNTERS,
    NUM_STATUS_COUNTERS,
    STATS,
    Opcode,
)

_WORD_AT = {name: STATS.fields[name][1] // 8 for name in STATS.names}
_COMMANDS, _ERRORS = _WORD_AT["commands"], _WORD_AT["errors"]
_BY_OPCODE, _BY_STATUS = _WORD_AT["commands_by_opcode"], _WORD_AT["errors_by_status"]
_POOL_BYTES_USED, _POOL_BLOCKS_USED = _WORD_AT["pool_bytes_used"], _WORD_AT["pool_blocks_used"]
_LEASES_ACTIVE, _EVICTIONS = _WORD_AT["leases_active"], _WORD_AT["evictions"]
_LEASE_EXPIRIES = _WORD_AT["lease_expiries"]
_LAST_OPCODE, _LAST_STATUS = NUM_OPCODE_COUNTERS - 1, NUM_STATUS_COUNTERS - 1
_LATENCY, _LATENCY_SUM = _WORD_AT["latency_buckets"], _WORD_AT["latency_sum_ns"]
_TIMED = {int(Opcode[name.upper()]): i for i, name in enumerate(LATENCY_OPCODES)}


class StatsWriter:
    def __init__(self, array: np.ndarray, clients: np.ndarray | None = None):
        array[:] = np.zeros(1, dtype=STATS)
        self.clients = np.zeros(0, CLIENT_STATS) if clients is None else clients
        self.clients[:] = 0
        self._words = memoryview(array.view(np.uint8).reshape(-1)).cast("Q")
        self._at = _WORD_AT
        self.set("engine_pid", os.getpid())
        self.set("start_ns", time.time_ns())

    def add(self, name: str, amount: int = 1) -> None:
        self._words[self._at[name]] += amount

    def set(self, name: str, value: int) -> None:
        self._words[self._at[name]] = value

    def set_gauges(self, pool_bytes_used: int, pool_blocks_used: int, leases_active: int,
                   evictions: int, lease_expiries: int) -> None:
        """The block index's gauges (refreshed before every answer)."""
        words = self._words
        words[_POOL_BYTES_USED] = pool_bytes_used
        words[_POOL_BLOCKS_USED] = pool_blocks_used
        words[_LEASES_ACTIVE] = leases_active
        words[_EVICTIONS] = evictions
        words[_LEASE_EXPIRIES] = lease_expiries

    def count_command(self, opcode: int, status: int, received_at: float = 0.0) -> None:
        """One answer; ``received_at`` (``time.perf_counter()`` at receipt) times a LOOKUP,
        LOAD or SAVE into its latency histogram."""
        words = self._words
        timed = _TIMED.get(opcode)
        if timed is not None and received_at:
            seconds = time.perf_counter() - received_at
            words[_LATENCY + timed * NUM_LATENCY_BUCKETS + bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
            words[_LATENCY_SUM + timed] += max(0, int(seconds * 1e9))
        words[_COMMANDS] += 1
        words[_BY_OPCODE + (opcode if opcode < _LAST_OPCODE else _LAST_OPCODE)] += 1
        if status:
            words[_ERRORS] += 1
            words[_BY_STATUS + (status if status < _LAST_STATUS else _LAST_STATUS)] += 1

    # -- per client (one CLIENT_STATS record per slot) --------------------------------------

    def client_attached(self, slot: int, pid: int, role: int, rank: int, namespace: int) -> None:
        if slot < len(self.clients):
            self.clients[slot] = (pid, role, rank, namespace, 0, 0, 0, 0, 0, 1)

    def client_gone(self, slot: int) -> None:
        if slot < len(self.clients):
            self.clients[slot] = 0

    def add_client(self, slot: int, name: str, amount: int) -> None:
        if slot < len(self.clients):
            self.clients[name][slot] += amount

    def set_client(self, slot: int, name: str, value: int) -> None:
        if slot < len(self.clients):
            self.clients[name][slot] = value
