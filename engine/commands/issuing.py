"""SAVEs and LOADs issued a slice per loop turn, so a long one does not hold every other client.

A SAVE or LOAD of 190,000 blocks took the engine's one thread over a second to issue (its
keys built, its entries reserved or found and pinned, its copies handed to the backend),
and every other client's commands waited meanwhile.  ``Transfers`` turns each into steps of
a chunk each (a generator); here they run for at most ISSUE_SLICE_S a loop turn (and one
step more), the rest on the next turns (``more``), until the command is sealed: answered
then, or when its last copy ends (``engine/commands/received.py``).

Meanwhile the server reads none of that client's further commands (``is_issuing``), so
each finds its SAVE or LOAD whole, as when it was issued at once; other clients' commands
are answered in between.  A LOOKUP that may wait for a SAVE being issued follows it
(``is_issuing_save``, ``lookup_waits.py``).  A command being issued counts in its
client's ``num_inflight`` (its memory stays registered); one whose client left is not
issued further.  A stored chain's eviction order is given the same way, TOUCH_STEP keys a
step after its SAVE's answer (``touch_chain``).  At a stop, every one is issued to its end
(``finish``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

from pegaflow.platform.errors import CommandError
from pegaflow.platform.wire import Opcode, Status

from .received import untimed

logger = logging.getLogger(__name__)

ISSUE_SLICE_S = 10e-3  # one command's steps a loop turn (then one step more at most)
TOUCH_STEP = 4096  # keys of a stored chain given their eviction order a step
_END = object()


def step_before(start: int):
    """A step ends before each chunk but the first (``yield from`` it): a command of one
    chunk goes in one step, whatever the time."""
    if start:
        yield


class Issuing:
    def __init__(self, seal: Callable, on_fault: Callable, answer: Callable, index) -> None:
        self.slice_s = ISSUE_SLICE_S
        self.seal = seal          # Transfers': every step issued, the command is answered now or later
        self.on_fault = on_fault  # Transfers': a context in which a fault (a bug) ends the command
        self.answer = answer      # the dispatcher's
        self.index = index        # its leases released, its chains touched
        # each command being issued (by its PendingCopy's id) -> (pending, steps, namespace), and
        # how many of each client slot's (a LOAD parked on disk reads may join a SAVE of its client's)
        self.items: dict[int, tuple[object, Iterator, int]] = {}
        self.slots: dict[int, int] = {}
        self.touching: list[tuple[list, int]] = []  # (stored chains, how much of each is left to touch)

    def __bool__(self) -> bool:
        return bool(self.items or self.touching)

    def touch_chain(self, chain: list) -> None:
        """``chain`` was stored: its eviction order (``BlockIndex.touch_chain``: the head kept
        longest), given TOUCH_STEP keys a step from the tail, a long one over several turns."""
        self.touching.append((chain, len(chain)))
        self._touch(time.perf_counter() + self.slice_s)

    def _touch(self, deadline: float) -> None:
        while self.touching:
            chain, end = self.touching[0]
            self.index.touch_chain(chain[max(0, end - TOUCH_STEP):end])
            if end <= TOUCH_STEP:
                self.touching.pop(0)
            else:
                self.touching[0] = (chain, end - TOUCH_STEP)
            if time.perf_counter() >= deadline:
                return

    def start(self, pending, steps: Iterator, namespace: int) -> None:
        """Issue ``pending``'s ``steps`` for ISSUE_SLICE_S now, the rest on the next turns.  A
        refusal or a fault met now reaches the caller (the command's handler)."""
        pending.client.num_inflight += 1
        self.items[id(pending)] = (pending, steps, namespace)
        self.slots[pending.client.slot] = self.slots.get(pending.client.slot, 0) + 1
        self._go_on(id(pending), time.perf_counter() + self.slice_s)

    def more(self) -> None:
        """The next slice of every command being issued (a loop turn's); a refusal (a LOAD's
        block gone meanwhile) or a fault met now is answered here."""
        deadline = time.perf_counter() + self.slice_s
        for key in list(self.items):
            pending = self.items[key][0]
            received = pending.received
            try:
                self._go_on(key, deadline)
            except CommandError as exc:  # nothing of it was copied
                if pending.lease_id:
                    self.index.release(pending.lease_id)
                self.answer(received, Status(exc.status))
            except Exception:  # boundary, as in the server's loop: answered, the engine goes on
                logger.exception("slot %d: internal error issuing a %s", pending.client.slot, pending.opcode.name)
                self.answer(untimed(received), Status.INTERNAL)
        self._touch(deadline)

    def finish(self) -> None:
        """Every command being issued, to its end (the engine stops)."""
        while self:
            self.more()

    def is_issuing(self, client) -> bool:
        return client.slot in self.slots

    def is_issuing_save(self, client, namespace: int) -> bool:
        """Whether a SAVE of ``client`` under ``namespace`` is being issued."""
        return client.slot in self.slots and any(
            p.client is client and p.opcode == Opcode.SAVE and n == namespace for p, _, n in self.items.values())

    def _go_on(self, key: int, deadline: float) -> None:
        """The command ``key`` names issued on until ``deadline``; once every step is (or its
        client left), it is sealed."""
        pending, steps, _ = self.items[key]
        try:
            with self.on_fault(pending):
                while True:
                    if steps.gi_suspended and not pending.client.is_attached:  # gone: no more of it
                        pending.error = pending.error or "the client left while it was issued"
                        steps.close()
                        break
                    if next(steps, _END) is _END:
                        break
                    if time.perf_counter() >= deadline:
                        return  # the rest on the loop's next turn
        finally:
            if not steps.gi_suspended:  # ended, one way or another
                del self.items[key]
                slot = pending.client.slot
                self.slots[slot] -= 1
                if not self.slots[slot]:
                    del self.slots[slot]
                pending.client.num_inflight -= 1
        self.seal(pending)
