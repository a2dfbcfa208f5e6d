"""The engine's counters and gauges, kept directly in the stats segment.

One writer (the engine's main thread); ``pegaflow-stat`` maps the segment read-only.
"""

from __future__ import annotations

import os
import time

import numpy as np

from pegaflow.wire import NUM_OPCODE_COUNTERS, NUM_STATUS_COUNTERS, STATS


class StatsWriter:
    def __init__(self, array: np.ndarray):
        self.array = array
        self.array[:] = np.zeros(1, dtype=STATS)
        self.array["engine_pid"] = os.getpid()
        self.array["start_ns"] = time.time_ns()
        self._by_opcode = array["commands_by_opcode"][0]
        self._by_status = array["errors_by_status"][0]

    def add(self, name: str, amount: int = 1) -> None:
        self.array[name] += amount

    def set(self, name: str, value: int) -> None:
        self.array[name] = value

    def count_command(self, opcode: int, status: int) -> None:
        self.array["commands"] += 1
        self._by_opcode[min(opcode, NUM_OPCODE_COUNTERS - 1)] += 1
        if status:
            self.array["errors"] += 1
            self._by_status[min(status, NUM_STATUS_COUNTERS - 1)] += 1

    def get(self, name: str) -> int:
        return int(self.array[name][0])
