"""Writing what a client may write where the engine reads it: its slot in the control
segment, its ring header, its seq words; and claiming a slot by hand, under any pid."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pegaflow.client.connection import EngineClient
from pegaflow.client.slots import open_control
from pegaflow.platform import shm
from pegaflow.platform.locks import ControlLock
from pegaflow.platform.wire import CONTROL_HEADER, SLOT, SlotState

SLOT_FIELDS = ("state", "pid", "generation", "claim_ns")
RING_FIELDS = ("magic", "version", "ring_slots", "arena_bytes", "generation", "client_sleeping",
               "revoked", "client_closed")
WAIT_S = 30.0


class SlotTable:
    """Engine ``name``'s slot table, mapped read-write as any client maps it."""

    def __init__(self, name: str):
        self.name = name
        self.control, header = open_control(name, None)
        self.slots = self.control.array(SLOT, int(header["num_slots"]), CONTROL_HEADER.itemsize)

    def claim(self, pid: int, slot: int | None = None) -> int:
        """Claim ``slot`` (default: the first free one) under ``pid``, as a client would,
        and ring the engine's doorbell; returns the slot."""
        lock = ControlLock.open(self.name)
        lock.acquire(5.0)
        try:
            if slot is None:
                slot = int(np.flatnonzero(self.slots["state"] == SlotState.FREE)[0])
            assert int(self.slots["state"][slot]) == SlotState.FREE
            self.slots["pid"][slot] = pid
            self.slots["claim_ns"][slot] = time.monotonic_ns()
            self.slots["state"][slot] = SlotState.CLAIMED
        finally:
            lock.release()
            lock.close()
        ring_doorbell(self.name)
        return slot

    def wait_all_free_but(self, num_kept: int, timeout_s: float = WAIT_S) -> None:
        """Until every slot but ``num_kept`` is FREE: the clients that went before are
        reclaimed (on a loaded machine the engine's reclaim takes its time)."""
        deadline = time.monotonic() + timeout_s
        while (busy := int(np.count_nonzero(self.slots["state"] != SlotState.FREE))) > num_kept:
            if time.monotonic() >= deadline:
                pytest.fail(f"{busy} slots still taken after {timeout_s} s, not {num_kept}: "
                            f"states {self.slots['state'].tolist()}")
            time.sleep(0.01)

    def wait_state(self, slot: int, state: SlotState, timeout_s: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while int(self.slots["state"][slot]) != state:
            if time.monotonic() >= deadline:
                pytest.fail(f"slot {slot} is {int(self.slots['state'][slot])}, not {state!r}, "
                            f"after {timeout_s}s")
            time.sleep(0.01)

    def close(self) -> None:
        self.slots = None
        self.control.close()


def ring_doorbell(name: str) -> None:
    bell = shm.attach_semaphore(shm.ipc_name(name, "doorbell"))
    try:
        bell.release()
    finally:
        bell.close()


def slot_record(client: EngineClient) -> np.ndarray:
    """``client``'s own record in the slot table (a writable view)."""
    slots = client._control.array(SLOT, client._num_slots, CONTROL_HEADER.itemsize)
    return slots[client.slot:client.slot + 1]


def ring_header(client: EngineClient) -> np.ndarray:
    """``client``'s own ring header (a writable view)."""
    return client._view.header


def write_bytes(record: np.ndarray, offset: int, data: bytes) -> None:
    """Write ``data`` at ``offset`` into one record, whatever fields it spans."""
    raw = record.view(np.uint8).reshape(-1)
    raw[offset:offset + len(data)] = np.frombuffer(data, dtype=np.uint8)


def connect_on_slot(name: str, slot: int, limit: int) -> tuple[EngineClient, list[EngineClient]]:
    """A client attached on ``slot`` (the lowest free one is taken first): (it, the clients
    attached on the way, to be closed by the caller)."""
    others = []
    for _ in range(limit):
        client = EngineClient.connect(name, timeout_s=10.0)
        if client.slot == slot:
            return client, others
        others.append(client)
    pytest.fail(f"no client landed on slot {slot} in {limit} attaches")
