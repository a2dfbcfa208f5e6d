"""The engine's attached clients, slot by slot: claims accepted (or refused), detached
clients retired once they have read their last answer, dead ones reclaimed (their leases,
blocks and memory released first), each freed slot given back to the control segment.

A client may write anything into its slot and its ring header; what the engine reads there
is checked (``claims.py``): a claim naming no process of the client's, a slot whose state
word was rewritten, a claimant that never ATTACHes within the attach timeout, each closes
that client with the reason logged and counted; the engine serves on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from pegaflow.platform import shm
from pegaflow.platform.ring import RingConsumer, RingProducer
from pegaflow.platform.shm import is_pid_alive
from pegaflow.platform.waits import Doorbell
from pegaflow.platform.wire import SlotState

from .claims import claim_problem, state_name
from .client import ClientState

logger = logging.getLogger(__name__)

# A claim accepted this long ago with no ATTACH since is reclaimed (at the housekeeping pass
# after it: within a second more).  A client ATTACHes milliseconds after its claim is accepted.
ATTACH_TIMEOUT_S = 5.0


class ClientTable:
    def __init__(self, engine_name: str, segments, stats, release_client: Callable[[ClientState], None],
                 drop_held: Callable[[int], None], own_pid_is_client: bool = False,
                 attach_timeout_s: float = ATTACH_TIMEOUT_S) -> None:
        """``release_client``: a closed client's leases and memory given back (the dispatcher's);
        ``drop_held``: a slot's client is gone, its copies held for its GPU end (the backend's);
        ``own_pid_is_client``: the engine runs in its clients' process (tests)."""
        self.engine_name = engine_name
        self.segments, self.stats, self.release_client = segments, stats, release_client
        self.drop_held = drop_held
        self.own_pid_is_client = own_pid_is_client
        self.attach_timeout_s = attach_timeout_s
        self.clients: dict[int, ClientState] = {}
        self.attached: tuple[ClientState, ...] = ()  # the clients' values, for the hot loop

    def accept_claims(self) -> None:
        """Claimed slots become ACTIVE, under the control lock: a client that gives up on
        its attach frees its slot under the same lock, only while it is still CLAIMED."""
        if not self.segments.has_claims():
            return
        lock = self.segments.lock
        if not lock.try_acquire():
            return  # a client holds it for a moment: the next pass accepts
        try:
            self._accept_claimed_slots()
        finally:
            lock.release()

    def _accept_claimed_slots(self) -> None:
        for slot in self.segments.claimed_slots().tolist():
            old = self.clients.get(slot)
            if old is not None and not self.close(old, "its slot was claimed again", free_slot=False):
                continue  # its copies still run: the claim waits for them
            pid = int(self.segments.slots["pid"][slot])
            why = claim_problem(pid, self.own_pid_is_client)
            if why is not None:
                self._refuse_claim(slot, why)
                continue
            self._accept(slot, pid)

    def _accept(self, slot: int, pid: int) -> None:
        view = self.segments.rings[slot]
        self.segments.reset_ring(slot)
        bell = Doorbell(self.segments.completion_bells[slot], view.client_sleeping)
        bell.drain()
        self.clients[slot] = ClientState(slot, view, RingConsumer(view.submissions),
                                         RingProducer(view.completions, bell), pid=pid,
                                         ring_name=shm.ipc_name(self.engine_name, f"ring.{slot}"),
                                         accepted_at=time.monotonic())
        self.segments.slots["state"][slot] = SlotState.ACTIVE
        self._changed()
        logger.info("client slot %d claimed by pid %d", slot, pid)

    def _refuse_claim(self, slot: int, why: str) -> None:
        logger.warning("client slot %d: claim refused: %s", slot, why)
        self.stats.add("clients_refused")
        self.segments.free_slot(slot)

    def retire(self, client: ClientState, force: bool = False) -> None:
        """A DETACHed client: its slot is free once it has read its last completion (or
        closed its ring without waiting for it, e.g. after a DETACH deadline)."""
        is_read = client.completions.is_consumed(client.completions.position - 1)
        is_waiting = client.num_inflight or client.pending_detach is not None
        if is_waiting or (client.submissions.is_ready() and not force) or not (
                force or client.closed_by_client or (is_read and not client.backlog)):
            return
        self._drop(client)
        logger.info("client slot %d (pid %d) detached", client.slot, client.pid)

    def check_alive(self) -> None:
        """Housekeeping: retire the detached, reclaim the dead and those that closed their
        ring, close those whose slot says otherwise or that never ATTACHed, and free slots
        a client wrote a state into after its own was freed."""
        now = time.monotonic()
        for client in list(self.clients.values()):
            why = self._problem(client, now)
            if why is not None:
                self.close(client, why)
                continue
            is_alive = is_pid_alive(client.pid)
            if client.is_detached:
                self.retire(client, force=not is_alive)
            elif not is_alive or client.closed_by_client:
                self._reclaim_dead(client, "is gone" if not is_alive else "closed its ring", is_gone=not is_alive)
        self._free_stray_slots()

    def _problem(self, client: ClientState, now: float) -> str | None:
        """Why ``client`` is closed now (None: it is not)."""
        if client.close_reason:
            return client.close_reason  # still closing: its copies were in flight
        state = int(self.segments.slots["state"][client.slot])
        if state not in (SlotState.ACTIVE, SlotState.CLAIMED):  # a CLAIMED one: accept_claims'
            return f"its slot's state was rewritten to {state_name(state)}"
        if not client.is_attached and not client.is_detached and \
                now - client.accepted_at > self.attach_timeout_s:
            return f"no ATTACH accepted within {self.attach_timeout_s:g}s of its claim"
        return None

    def close(self, client: ClientState, why: str, free_slot: bool = True) -> bool:
        """Close a client for what it wrote (logged and counted once): True once its slot
        is dropped, False while its copies still run (the next housekeeping tries again)."""
        if not client.close_reason:
            logger.warning("client slot %d (pid %d) closed: %s", client.slot, client.pid, why)
            self.stats.add("clients_refused")
            client.close_reason = why
            client.is_attached = False  # its further commands are refused
        return self._release_and_drop(client, free_slot)

    def _free_stray_slots(self) -> None:
        """Slots no client holds whose state is neither FREE nor CLAIMED (written by a client
        whose slot was freed): FREE again, under the control lock."""
        states = self.segments.slots["state"]
        stray = [slot for slot in np.flatnonzero((states != SlotState.FREE) & (states != SlotState.CLAIMED)).tolist()
                 if slot not in self.clients]
        if not stray or not self.segments.lock.try_acquire():
            return  # (lock taken: the next pass)
        try:
            for slot in stray:
                state = int(states[slot])
                if slot not in self.clients and state not in (SlotState.FREE, SlotState.CLAIMED):
                    logger.warning("client slot %d: state %s with no client; freed", slot, state_name(state))
                    self.stats.add("clients_refused")
                    self.segments.free_slot(slot)
        finally:
            self.segments.lock.release()

    def _reclaim_dead(self, client: ClientState, why: str, is_gone: bool) -> None:
        client.is_attached = False  # a LOOKUP of it still parked is let go at once
        if is_gone or client.num_inflight:  # the backend told: those held for its GPU end now
            self.drop_held(client.slot)     # (and a gone client's handles are let go off its thread)
        if client.num_inflight:  # its copies still touch its memory; reclaim once they are done
            return
        logger.warning("client slot %d: pid %d %s; reclaiming its slot, leases and memory",
                       client.slot, client.pid, why)
        self._release_and_drop(client)

    def _release_and_drop(self, client: ClientState, free_slot: bool = True) -> bool:
        """Release a closed client's leases and memory and free its slot: True once done,
        False while its copies still run (the next housekeeping tries again)."""
        if client.num_inflight:
            return False
        self.release_client(client)
        client.backlog.clear()
        self._drop(client, free_slot)
        return True

    def _drop(self, client: ClientState, free_slot: bool = True) -> None:
        """Free the slot of a client whose memory, leases and blocks are already released
        (``free_slot`` False: a new claim of it is being accepted)."""
        self.clients.pop(client.slot, None)
        self.stats.client_gone(client.slot)
        if free_slot and int(self.segments.slots["state"][client.slot]) != SlotState.CLAIMED:
            self.segments.free_slot(client.slot)  # (a CLAIMED one: accept_claims checks it)
        self._changed()

    def _changed(self) -> None:
        self.attached = tuple(self.clients.values())
        self.stats.set("clients_attached", len(self.clients))
