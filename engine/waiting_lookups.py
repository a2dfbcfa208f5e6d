"""LOOKUPs that wait for the blocks their prefix goes on with while those are being saved.

A LOOKUP whose READY prefix stops at a block another client is still saving (its entry is
WRITING: a SAVE in flight, or layers of it still to come) would be answered short: the
block lands a few milliseconds later, and the asker computes it again.  That is the race
of store-based prefill/decode disaggregation (the decode vLLM looks up the prompt the
prefill vLLM answered before its saves landed), and of two replicas sent one prefix moments
apart.  Such a LOOKUP is parked here, off the dispatcher's path, and answered (by the
dispatcher, with a fresh walk of the index) once

    - its prefix stops at a block nobody is writing (the saves landed, or failed; a block
      no copy is filling that began more than ABANDONED_WRITE_S ago counts as nobody's:
      some layers or votes of it never came, and the housekeeping drops it later), or
    - its deadline passes (``--lookup-wait-ms`` from its arrival, or the one it asked for):
      then with the READY part only.

Rings are read in turns, so a SAVE another client published before this LOOKUP may not
have been read yet when the LOOKUP is: a LOOKUP that stops at a block the index does not
know, while other clients have commands unread, first waits until the engine has read
those (``catch_up``: each such ring's published end, noted at arrival), then looks again.

A LOOKUP that reaches blocks another vLLM instance claimed (compute once,
``prefill_claims.py``) is parked here too, with the deadline the claim gives it, and waits
while its prefix stops at a block still being written or still claimed.

A parked LOOKUP counts in its client's ``num_inflight`` (its slot stays until answered).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .entries import ORPHAN, Key

ABANDONED_WRITE_S = 5.0


@dataclass(slots=True)
class WaitingLookup:
    client: object
    received: object    # the LOOKUP as received (``engine/received.py``): answered once, from here
    keys: list[Key]
    deadline: float     # monotonic
    parked_at: float    # monotonic
    num_ready: int      # the READY prefix when it was parked
    catch_up: list[tuple[object, int]] = field(default_factory=list)  # (client, ring position to reach)
    is_waiting_saves: bool = False  # it stopped at a block being written (counted once)
    num_usable: int = 0  # how far its prefix was usable at the last look (walks resume there)
    prefill: object = None  # compute once: the asker's ``Prefill`` while it waits for a claim

    def __post_init__(self) -> None:
        self.num_usable = max(self.num_usable, self.num_ready)


def writing_stop(index, keys: list[Key], now: float) -> tuple[int, str]:
    """Where ``keys``' prefix stops in ``index``: (num usable, why), why one of "end",
    "writing" (a block some client is saving), "absent" (no entry) or "other" (doomed,
    orphaned, abandoned, or another kind of entry that will not become READY by a save)."""
    entries, writing = index.entries, index.writing
    for i, key in enumerate(keys):
        entry = entries.get(key)
        if entry is None:
            return i, "absent"
        if entry.is_ready or entry.is_promoting and not entry.is_doomed:
            continue
        is_saving = key in writing and not entry.is_doomed and entry.owner_slot != ORPHAN \
            and not entry.is_promoting and (entry.pending_mask or now - entry.started_at < ABANDONED_WRITE_S)
        return i, "writing" if is_saving else "other"
    return len(keys), "end"


def unread_marks(clients, asker) -> list[tuple[object, int]]:
    """(client, the end of what it has published) for each other client with commands unread."""
    marks = []
    for client in clients:
        if client is not asker and client.is_attached and client.submissions.is_ready():
            ring = client.submissions
            marks.append((client, ring.position + ring.num_published()))
    return marks


class WaitingLookups:
    def __init__(self, index, answer: Callable[[WaitingLookup], None], claims=None) -> None:
        self.index = index
        self.answer = answer  # the dispatcher's: walks the index again and answers
        self.claims = claims  # compute once's (``prefill_claims.py``), if any
        self.items: list[WaitingLookup] = []

    def try_park(self, received, keys: list[Key], num_ready: int, wait_s: float, clients,
                 claim_wait: tuple[float, object] | None = None) -> bool:
        """Park this LOOKUP, whose READY prefix is ``num_ready`` blocks (the index's lookup
        walked it), if it stops at a block being saved, or at one the index does not know
        while other ``clients`` have commands unread, or ``claim_wait`` (a deadline and the
        asker's ``Prefill``: it waits for another instance's claim) (True); else it is
        answered now."""
        client, now = received.client, time.monotonic()
        _, why = writing_stop(self.index, keys[num_ready:num_ready + 1], now)  # the block it stops at
        marks = unread_marks(clients, client) if why == "absent" else []
        if why != "writing" and not marks and claim_wait is None:
            return False
        deadline, prefill = (now + wait_s, None) if claim_wait is None else claim_wait
        self.park(WaitingLookup(client, received, keys, max(deadline, now + wait_s), now, num_ready,
                                marks, why == "writing", prefill=prefill))
        return True

    def next_deadline(self) -> float:
        if self.items and self.claims is not None and self.claims.has_ended:  # they look again now
            return 0.0
        return min((w.deadline for w in self.items), default=float("inf"))

    def park(self, waiting: WaitingLookup) -> None:
        self.items.append(waiting)
        waiting.client.num_inflight += 1

    def resume(self, now: float) -> int:
        """Answer each LOOKUP whose wait is over; returns how many were answered."""
        if self.claims is not None:
            self.claims.note_seen()
        if not self.items:
            return 0
        done, still = [], []
        for waiting in self.items:
            (done if self._is_over(waiting, now) else still).append(waiting)
        self.items = still
        for waiting in done:
            waiting.client.num_inflight -= 1
            self.answer(waiting)
        return len(done)

    def take_all(self) -> list[WaitingLookup]:
        """Every waiting LOOKUP, at a stop: each to be answered by the caller."""
        items, self.items = self.items, []
        for waiting in items:
            waiting.client.num_inflight -= 1
        return items

    def _is_over(self, waiting: WaitingLookup, now: float) -> bool:
        if now >= waiting.deadline or not waiting.client.is_attached:
            return True
        if waiting.catch_up:
            waiting.catch_up = [(c, end) for c, end in waiting.catch_up
                                if c.is_attached and c.submissions.position < end]
            if waiting.catch_up:
                return False
        # From where the last look stopped (blocks before it were usable then; the answer walks
        # the index afresh), so a LOOKUP waiting on its loop turns costs a block or two a look.
        num_more, why = writing_stop(self.index, waiting.keys[waiting.num_usable:], now)
        waiting.num_usable += num_more
        if why == "writing":
            waiting.is_waiting_saves = True
            return False
        if waiting.prefill is not None and why == "absent":  # a block another instance claimed?
            return not self.claims.holds(waiting.keys[waiting.num_usable], waiting.client.instance)
        return True
