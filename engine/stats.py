"""The engine's counters and gauges, kept directly in the stats segment.

One writer (the engine's main thread); ``pegaflow-stat`` maps the segment read-only.
Updates go through a ``memoryview`` of 64-bit words: a few tens of nanoseconds each.
"""

from __future__ import annotations

import os
import time

import numpy as np

from pegaflow.wire import NUM_OPCODE_COUNTERS, NUM_STATUS_COUNTERS, STATS


class StatsWriter:
    def __init__(self, array: np.ndarray):
        array[:] = np.zeros(1, dtype=STATS)
        self._words = memoryview(array.view(np.uint8).reshape(-1)).cast("Q")
        self._at = {name: STATS.fields[name][1] // 8 for name in STATS.names}
        self._opcodes_at = self._at["commands_by_opcode"]
        self._statuses_at = self._at["errors_by_status"]
        self.set("engine_pid", os.getpid())
        self.set("start_ns", time.time_ns())

    def add(self, name: str, amount: int = 1) -> None:
        self._words[self._at[name]] += amount

    def set(self, name: str, value: int) -> None:
        self._words[self._at[name]] = value

    def get(self, name: str) -> int:
        return self._words[self._at[name]]

    def count_command(self, opcode: int, status: int) -> None:
        words = self._words
        words[self._at["commands"]] += 1
        words[self._opcodes_at + min(opcode, NUM_OPCODE_COUNTERS - 1)] += 1
        if status:
            words[self._at["errors"]] += 1
            words[self._statuses_at + min(status, NUM_STATUS_COUNTERS - 1)] += 1
