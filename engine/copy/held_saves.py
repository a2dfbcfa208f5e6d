"""SAVEs held in the engine until the client's GPU has written what they copy (``--hold-saves``).

A SAVE's copies wait for the client's events (the forward pass that writes the KV).  Issued at
once, they sit in a device-wide stream behind that wait: every later copy on that stream (every
client's) queues behind one client's forward pass, and once the driver's queue is full each
further launch blocks the engine's one thread, so every client's lookups and loads wait too
(measured with two replicas on one engine: docs/benchmarks.md, "Figures behind --hold-saves
and --load-layer-groups").

With ``--hold-saves`` a SAVE whose client is still writing is held here instead.  The client
records its events again at every step, and a wait binds to the record already issued when it
is made, so the engine snapshots those records at once: on a stream of the client's own (one
per client and device, so no client waits behind another) it issues a wait on every event the
SAVE waits on and records an engine event after them.  ``CudaBackend.poll`` issues the SAVE once
that engine event has fired (``cuEventQuery``, which never waits), without its waits on the
client's events: by then they would bind to a later step's records and hold the copy behind
that step's forward pass.  Nothing is lost: the staged path starts a SAVE's copies after its
last layer's event anyway (its first sub-chunk packs every layer).  Held SAVEs are issued in the order they came;
one still waiting does not hold back a later one whose data is written (two SAVEs never copy
the same layer of a block at once: ``engine/commands/transfers.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from pegaflow.platform.cuda import driver
from pegaflow.platform.errors import CudaError
from pegaflow.platform.protocol import layer_event

from .base import CopyDone, CopyOp, Direction
from .releases import release_logged

logger = logging.getLogger(__name__)


def last_wait_event(op: CopyOp) -> int | None:
    """The client event after which every byte ``op`` reads is written: its last layer's (or
    its one event); None for an op that waits on nothing (a LOAD, or a SAVE without events)."""
    if op.direction != Direction.SAVE or op.wait_event is None:
        return None
    return layer_event(op.wait_event, len(op.layers) - 1) if op.wait_per_layer else op.wait_event


def wait_events(op: CopyOp) -> list[int]:
    """Every client event a SAVE's copies wait on (one per layer, or its one event)."""
    if op.wait_event is None:
        return []
    return [layer_event(op.wait_event, k) for k in range(len(op.layers))] if op.wait_per_layer else [op.wait_event]


@dataclass(slots=True)
class Held:
    op: CopyOp
    regions: list
    dev: object     # the engine's Device the op copies on
    marker: object  # an engine event recorded after a wait on the client's event


def written(held: Held) -> bool:
    """Whether a held SAVE's data is written; a CudaError when its marker failed (the client's
    work it waited on failed: the SAVE must not be issued, its copies no longer wait)."""
    driver.use_device(held.dev.device)
    return driver.event_done(held.marker)


class HeldSaves:
    def __init__(self) -> None:
        self._held: list[Held] = []
        self._gates: dict[tuple[int, int], object] = {}  # (device, slot) -> its stream

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, dev, op: CopyOp, regions: list, client_events: list) -> None:
        """Hold ``op`` until the records issued so far of every client event it waits on
        (``client_events``: the client's pool) have fired; current device: ``dev``.  It comes
        out without those waits (``issue_ready``)."""
        gate = self._gates.get((dev.device, op.slot))
        if gate is None:
            gate = self._gates[dev.device, op.slot] = driver.create_stream(low_priority=True)
        marker = dev.event()
        try:
            for event in wait_events(op):
                driver.wait(gate, client_events[event])
            driver.record(marker, gate)
        except CudaError:
            release_logged([(driver.destroy_event, marker)], f"holding save {op.token}")  # its state
            raise  # unknown: not back to the idle ones
        self._held.append(Held(replace(op, wait_event=None, wait_per_layer=False), regions, dev, marker))

    def issue_ready(self, start: Callable[[Held], None], done: list[CopyDone],
                    fired: Callable[[Held], bool] = written) -> None:
        """``start`` each held SAVE whose data is written, in the order they came (their
        markers back to their device's idle events); the rest stay.  One whose marker failed,
        or that fails to issue, ends its command with the error in ``done``."""
        waiting = []
        for held in self._held:
            try:
                if not fired(held):
                    waiting.append(held)
                    continue
            except CudaError as exc:
                logger.error("held save %d: its client's data was never written: %s", held.op.token, exc)
                release_logged([(driver.destroy_event, held.marker)],  # its state unknown: not back
                               f"held save {held.op.token}'s marker")  # to the idle ones
                done.append(CopyDone(held.op.token, f"CudaError: {exc}"))
                continue
            held.dev.idle_events.append(held.marker)
            try:
                start(held)
            except Exception as exc:  # boundary: its command must end, whatever failed
                logger.exception("issuing held save %d failed", held.op.token)
                done.append(CopyDone(held.op.token, f"{type(exc).__name__}: {exc}"))
        self._held = waiting

    def take_slot(self, slot: int) -> list[Held]:
        """Every held SAVE of ``slot`` (its client is leaving), taken out; its streams and
        markers are let go without waiting (a gone client's work may never end), a release
        the driver refuses logged, never raised: the SAVEs must still end."""
        mine = [held for held in self._held if held.op.slot == slot]
        self._held = [held for held in self._held if held.op.slot != slot]
        why = f"slot {slot}: letting go of its held saves' gate"
        for key in [key for key in self._gates if key[1] == slot]:
            driver.use_device(key[0])
            release_logged([(driver.destroy_stream, self._gates.pop(key))], why)
        for held in mine:
            driver.use_device(held.dev.device)
            release_logged([(driver.destroy_event, held.marker)], why)
        return mine

    def close(self) -> list[Held]:
        """Every held SAVE, taken out, and every stream let go (the engine is closing)."""
        everything = list(self._held)
        for slot in {key[1] for key in self._gates} | {held.op.slot for held in self._held}:
            self.take_slot(slot)
        return everything
