"""The engine's attached clients, slot by slot: claims accepted, detached clients retired
once they have read their last answer, dead ones reclaimed (their leases, blocks and
memory released first), each freed slot given back to the control segment."""

from __future__ import annotations

import logging

from engine.clients import ClientState
from pegaflow import shm
from pegaflow.ring import RingConsumer, RingProducer
from pegaflow.shm import is_pid_alive
from pegaflow.waits import Doorbell
from pegaflow.wire import SlotState

logger = logging.getLogger(__name__)


class ClientTable:
    def __init__(self, engine_name: str, segments, stats, dispatcher) -> None:
        self.engine_name = engine_name
        self.segments, self.stats, self.dispatcher = segments, stats, dispatcher
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
            view = self.segments.rings[slot]
            self.segments.reset_ring(view)
            bell = Doorbell(self.segments.completion_bells[slot], view.client_sleeping)
            bell.drain()
            self.clients[slot] = ClientState(slot, view, RingConsumer(view.submissions),
                                             RingProducer(view.completions, bell),
                                             pid=int(self.segments.slots["pid"][slot]),
                                             ring_name=shm.ipc_name(self.engine_name, f"ring.{slot}"))
            self.segments.slots["state"][slot] = SlotState.ACTIVE
            self._changed()
            logger.info("client slot %d claimed by pid %d", slot, self.clients[slot].pid)

    def retire(self, client: ClientState, force: bool = False) -> None:
        """A DETACHed client: its slot is free once it has read its last completion (or
        closed its ring without waiting for it, e.g. after a DETACH deadline)."""
        is_read = client.completions.is_consumed(client.completions.position - 1)
        if client.num_inflight or client.pending_detach or (client.submissions.is_ready() and not force) or not (
                force or client.closed_by_client or (is_read and not client.backlog)):
            return
        self._drop(client)
        logger.info("client slot %d (pid %d) detached", client.slot, client.pid)

    def check_alive(self) -> None:
        """Housekeeping: retire the detached, reclaim the dead and those that closed their ring."""
        for client in list(self.clients.values()):
            is_alive = is_pid_alive(client.pid)
            if client.is_detached:
                self.retire(client, force=not is_alive)
            elif not is_alive or client.closed_by_client:
                self._reclaim_dead(client, "is gone" if not is_alive else "closed its ring")

    def _reclaim_dead(self, client: ClientState, why: str) -> None:
        if client.num_inflight:
            return  # its copies still touch its memory; reclaim once they are done
        logger.warning("client slot %d: pid %d %s; reclaiming its slot, leases and memory",
                       client.slot, client.pid, why)
        self.dispatcher.release_client(client)
        client.backlog.clear()
        self._drop(client)

    def _drop(self, client: ClientState) -> None:
        """Free the slot of a client whose memory, leases and blocks are already released."""
        self.clients.pop(client.slot, None)
        self.stats.client_gone(client.slot)
        self.segments.free_slot(client.slot)
        self._changed()

    def _changed(self) -> None:
        self.attached = tuple(self.clients.values())
        self.stats.set("clients_attached", len(self.clients))
