"""The client's side of the control segment: read its header (and which engine serves
under a name), claim a free client slot under the control lock, wait for the engine to
accept it, or give it back.

The engine accepts a claim (CLAIMED -> ACTIVE) under the same lock, so a client that gives
up frees its slot only while it is still CLAIMED; one accepted meanwhile is freed by the
engine once the ring says ``client_closed``.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np

from pegaflow.platform import shm
from pegaflow.platform.errors import (
    EngineStartingError,
    EngineTimeoutError,
    NoFreeSlotError,
    PegaflowError,
    WireVersionError,
)
from pegaflow.platform.locks import ControlLock
from pegaflow.platform.shm import is_pid_alive
from pegaflow.platform.waits import poll_until
from pegaflow.platform.wire import CONTROL_HEADER, FINGERPRINT, MAGIC, RING_HEADER, SLOT, WIRE_VERSION, SlotState

logger = logging.getLogger(__name__)

CLAIM_LOCK_TIMEOUT_S = 2.0
START_POLL_S = 0.01  # how often a client looks again at an engine whose segments are not written yet


def open_control(engine_name: str, deadline: float | None) -> tuple[shm.Segment, np.void]:
    """Engine ``engine_name``'s control segment, mapped, and its header.  A segment its engine
    has made but not written yet (it started a moment ago) is waited for until ``deadline``
    (None: refused at once), mapped anew each time: an engine that lost a race for the name
    unlinks its own."""
    name = shm.ipc_name(engine_name, "control")
    while True:
        try:
            return _attach_control(name)
        except EngineStartingError:
            if deadline is None or time.monotonic() >= deadline:
                raise
        time.sleep(START_POLL_S)


def _attach_control(name: str) -> tuple[shm.Segment, np.void]:
    segment = shm.attach_segment(name)
    try:
        return segment, read_control_header(segment)
    except BaseException:
        segment.close()
        raise


def read_control_header(segment: shm.Segment) -> np.void:
    header = segment.array(CONTROL_HEADER, 1)[0].copy()
    if int(header["magic"]) == 0:
        raise EngineStartingError(f"{segment.name}: the engine is still starting")
    if int(header["magic"]) != MAGIC:
        raise WireVersionError(f"{segment.name} is not a pegaflow control segment")
    if int(header["version"]) != WIRE_VERSION or int(header["fingerprint"]) != FINGERPRINT:
        raise WireVersionError(
            f"engine speaks wire version {int(header['version'])} "
            f"(fingerprint {int(header['fingerprint']):#x}); this client speaks "
            f"{WIRE_VERSION} ({FINGERPRINT:#x}): run a matching pegaflow on both sides")
    return header


def serving_engine_epoch(engine_name: str) -> int:
    """The epoch of the engine serving under ``engine_name`` (0: none is, or it is still
    starting, stopping, dead, or of another wire version).  Attaches nothing but the
    control segment, and only for the call."""
    try:
        control = shm.attach_segment(shm.ipc_name(engine_name, "control"))
    except PegaflowError:
        return 0
    try:
        header = read_control_header(control)
    except PegaflowError:
        return 0
    finally:
        control.close()
    if not int(header["is_serving"]) or int(header["is_stopping"]) or \
            not is_pid_alive(int(header["engine_pid"])):
        return 0
    return int(header["epoch"])


def _slot_table(control: shm.Segment, num_slots: int) -> np.ndarray:
    return control.array(SLOT, num_slots, CONTROL_HEADER.itemsize)


def claim_slot(control: shm.Segment, engine_name: str, num_slots: int) -> int:
    """A free slot, now CLAIMED by this process (NoFreeSlotError if none is free)."""
    lock = ControlLock.open(engine_name)
    try:
        lock.acquire(CLAIM_LOCK_TIMEOUT_S)
    except BaseException:
        lock.close()
        raise
    try:
        slots = _slot_table(control, num_slots)
        free = np.flatnonzero(slots["state"] == SlotState.FREE)
        if len(free) == 0:
            raise NoFreeSlotError(f"all {num_slots} client slots of engine "
                                  f"{engine_name!r} are taken")
        slot = int(free[0])
        slots["pid"][slot] = os.getpid()
        slots["claim_ns"][slot] = time.monotonic_ns()
        slots["state"][slot] = SlotState.CLAIMED
        return slot
    finally:
        lock.release()
        lock.close()


def wait_slot_active(control: shm.Segment, engine_name: str, slot: int, num_slots: int,
                     timeout_s: float) -> None:
    """The engine resets the slot's ring and marks it ACTIVE; wait for that."""
    slots = _slot_table(control, num_slots)

    def is_active():
        return True if int(slots["state"][slot]) == SlotState.ACTIVE else None

    if poll_until(is_active, timeout_s, first_pause_s=1e-5, max_pause_s=5e-3) is None:
        raise EngineTimeoutError(f"engine {engine_name!r} did not accept slot "
                                 f"{slot} within {timeout_s:.3f}s")


def give_back_slot(control: shm.Segment, engine_name: str, slot: int, num_slots: int) -> None:
    """An attach that failed after its claim: free the slot if the engine has not accepted
    it yet, else tell the engine (``client_closed``) that its client is gone."""
    slots = _slot_table(control, num_slots)
    lock = ControlLock.open(engine_name)
    try:
        try:
            lock.acquire(CLAIM_LOCK_TIMEOUT_S)
        except EngineTimeoutError:
            logger.warning("slot %d of engine %r: control lock busy; the slot stays claimed",
                           slot, engine_name)
            return
        try:
            if int(slots["state"][slot]) == SlotState.CLAIMED and int(slots["pid"][slot]) == os.getpid():
                slots["state"][slot] = SlotState.FREE  # never accepted
                return
        finally:
            lock.release()
    finally:
        lock.close()
    if int(slots["state"][slot]) == SlotState.ACTIVE and int(slots["pid"][slot]) == os.getpid():
        ring = shm.attach_segment(shm.ipc_name(engine_name, f"ring.{slot}"))
        try:  # accepted after we gave up: the engine frees it once told we are gone
            ring.array(RING_HEADER, 1)["client_closed"] = 1
        finally:
            ring.close()
