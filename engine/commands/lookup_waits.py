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

The loop wakes for the earlier of the two (``next_deadline``), idle or not, and the
housekeeping looks again once it has reclaimed a dead client (whose half-written blocks
it drops).

Rings are read in turns, so a SAVE another client published before this LOOKUP may not
have been read yet when the LOOKUP is: a LOOKUP that stops at a block the index does not
know first waits until the engine has read, of each other client, its last unread SAVE of
the LOOKUP's namespace (``catch_up``: that ring position, noted at arrival), or issued a
SAVE of it still being issued in slices (``engine/commands/transfers.py``), then looks again.  A
client whose commands the engine does not read (it reads none of its answers:
``ClientState.is_held_back``) is not waited for, nor one whose unread commands hold no
such SAVE.

Bounds (memory): at most MAX_WAITING LOOKUPs (MAX_WAITING_KEYS hashes) are parked at once,
of one client at most MAX_WAITING_PER_CLIENT (MAX_WAITING_KEYS_PER_CLIENT hashes).  A LOOKUP
past them is not parked (``Parked.REFUSED``): it is answered at once with its READY prefix,
as with the wait off, under the status WAIT_REFUSED (its values as OK's), and counted in
``lookup_waits_refused``.

A LOOKUP that reaches blocks another vLLM instance claimed (compute once,
``prefill_claims.py``) is parked here too, for at most the asker's own wait, and waits while
its prefix stops at a block still being written, or at an absent one still claimed (until
that claim's deadline: the loop wakes for it).

A parked LOOKUP counts in its client's ``num_inflight`` (its slot stays until answered).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from pegaflow.platform.wire import Opcode

from ..blocks.entries import ORPHAN, Key

ABANDONED_WRITE_S = 5.0
MAX_WAITING_PER_CLIENT = 256       # LOOKUPs of one client parked at once
MAX_WAITING_KEYS_PER_CLIENT = 1 << 18  # and their hashes (a LOOKUP's whole chain counts)
MAX_WAITING = 1024                 # every client's together
MAX_WAITING_KEYS = 1 << 20         # (a parked hash takes about 60 bytes of the engine's memory)


class Parked(Enum):
    """What ``WaitingLookups.try_park`` did with a LOOKUP."""

    YES = "parked"        # answered later, from here
    NO = "no wait"        # nothing to wait for: answered now, OK
    REFUSED = "refused"   # it would wait, past the bounds: answered now, WAIT_REFUSED


@dataclass(slots=True)
class WaitingLookup:
    client: object
    received: object    # the LOOKUP as received (``engine/commands/received.py``): answered once, from here
    keys: list[Key]
    deadline: float     # monotonic
    parked_at: float    # monotonic
    num_ready: int      # the READY prefix when it was parked
    catch_up: list[tuple[object, int]] = field(default_factory=list)  # (client, ring position to reach)
    num_usable: int = 0  # how far its prefix was usable at the last look (walks resume there)
    wake_at: float = float("inf")  # its next look without other work: the deadline, or sooner
    #                                when the block it stops at counts as abandoned
    is_late: bool = False  # its deadline ended the wait (a timeout)
    prefill: object = None  # compute once: the asker's ``Prefill`` while it waits for a claim

    def __post_init__(self) -> None:
        self.num_usable = max(self.num_usable, self.num_ready)
        self.wake_at = min(self.wake_at, self.deadline)


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


def abandoned_at(index, key: Key) -> float:
    """When ``key``'s entry, being written, counts as abandoned (``writing_stop``) unless a
    copy starts filling it: never while one does (its end is work that wakes the loop)."""
    entry = index.entries.get(key)
    return float("inf") if entry is None or entry.pending_mask else entry.started_at + ABANDONED_WRITE_S


def past_last_save(ring, namespace: int) -> int:
    """The ring position just past the last unread SAVE of ``namespace`` on ``ring`` (a
    ``RingConsumer``), or its position if it has none unread."""
    num_unread = ring.num_published()
    if not num_unread:
        return ring.position
    unread = ring.slots[(ring.position + np.arange(num_unread)) % ring.num_slots]
    saves = np.flatnonzero((unread["opcode"] == Opcode.SAVE) & (unread["namespace"] == namespace))
    return ring.position + int(saves[-1]) + 1 if len(saves) else ring.position


def unread_marks(clients, asker, namespace: int, is_issuing: Callable[[object, int], bool]) \
        -> list[tuple[object, int]]:
    """(client, the ring position to reach) for each other client the engine reads that has
    a SAVE of ``namespace`` unread, or one ``is_issuing`` (still being issued)."""
    marks = []
    for client in clients:
        if client is asker or not client.is_attached or client.is_held_back:
            continue
        end = past_last_save(client.submissions, namespace)
        if end > client.submissions.position or is_issuing(client, namespace):
            marks.append((client, end))
    return marks


def _is_behind(client, end: int, namespace: int, is_issuing: Callable[[object, int], bool]) -> bool:
    """Whether the engine has yet to read ``client``'s ring up to ``end`` (or to finish a SAVE
    of ``namespace`` it is issuing), and will."""
    return client.is_attached and not client.is_held_back and (
        client.submissions.position < end or is_issuing(client, namespace))


class WaitingLookups:
    def __init__(self, index, answer: Callable[[WaitingLookup], None], stats,
                 is_issuing: Callable[[object, int], bool], claims=None) -> None:
        self.index = index
        self.answer = answer  # the dispatcher's: walks the index again and answers
        self.stats = stats
        self.is_issuing = is_issuing  # (client, namespace): a SAVE of it is being issued in slices
        self.claims = claims  # compute once's (``prefill_claims.py``), if any
        self.items: list[WaitingLookup] = []
        self.num_keys = 0  # hashes of the parked LOOKUPs
        self.by_client: dict[int, list[int]] = {}  # client uid -> [LOOKUPs parked, their hashes]

    def try_park(self, received, keys: list[Key], num_ready: int, wait_s: float, clients,
                 claim_wait: tuple[float, object] | None = None) -> Parked:
        """Park this LOOKUP, whose READY prefix is ``num_ready`` blocks (the index's lookup
        walked it), if it stops at a block being saved, or at one the index does not know
        while other ``clients`` have a SAVE of its namespace to read, or if ``claim_wait`` (a
        deadline and the asker's ``Prefill``: it waits for another instance's claim) (YES);
        else it is answered now (NO), and past the bounds too (REFUSED, counted)."""
        client, now, stop = received.client, time.monotonic(), keys[num_ready]
        _, why = writing_stop(self.index, [stop], now)  # the block it stops at
        marks = unread_marks(clients, client, stop[0], self.is_issuing) if why == "absent" else []
        if why != "writing" and not marks and claim_wait is None:
            return Parked.NO
        if not self.has_room(client, len(keys)):
            self.stats.add("lookup_waits_refused")
            return Parked.REFUSED
        deadline, prefill = (now + wait_s, None) if claim_wait is None else (max(claim_wait[0], now + wait_s),
                                                                             claim_wait[1])
        waiting = WaitingLookup(client, received, keys, deadline, now, num_ready, marks, prefill=prefill)
        if why == "writing":
            waiting.wake_at = min(waiting.deadline, abandoned_at(self.index, stop))
        elif claim_wait is not None:
            waiting.wake_at = min(waiting.deadline, self._claim_end(waiting, stop))
        self.park(waiting)
        return Parked.YES

    def has_room(self, client, num_keys: int) -> bool:
        """Whether a LOOKUP of ``num_keys`` hashes of ``client`` may be parked (the bounds)."""
        num, keys = self.by_client.get(client.uid, (0, 0))
        return (len(self.items) < MAX_WAITING and self.num_keys + num_keys <= MAX_WAITING_KEYS
                and num < MAX_WAITING_PER_CLIENT and keys + num_keys <= MAX_WAITING_KEYS_PER_CLIENT)

    def next_deadline(self) -> float:
        """When the loop must look again though nothing else happened."""
        if self.items and self.claims is not None and self.claims.has_ended:  # a claim ended: now
            return 0.0
        return min((w.wake_at for w in self.items), default=float("inf"))

    def park(self, waiting: WaitingLookup) -> None:
        self.items.append(waiting)
        waiting.client.num_inflight += 1
        mine = self.by_client.setdefault(waiting.client.uid, [0, 0])
        mine[0] += 1
        mine[1] += len(waiting.keys)
        self.num_keys += len(waiting.keys)

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
            self._let_go(waiting)
            self.answer(waiting)
        return len(done)

    def take_all(self) -> list[WaitingLookup]:
        """Every waiting LOOKUP, at a stop: each to be answered by the caller."""
        items, self.items = self.items, []
        for waiting in items:
            self._let_go(waiting)
        return items

    def _let_go(self, waiting: WaitingLookup) -> None:
        waiting.client.num_inflight -= 1
        uid = waiting.client.uid
        mine = self.by_client[uid]
        mine[0] -= 1
        mine[1] -= len(waiting.keys)
        self.num_keys -= len(waiting.keys)
        if not mine[0]:
            del self.by_client[uid]

    def _is_over(self, waiting: WaitingLookup, now: float) -> bool:
        if now >= waiting.deadline:
            waiting.is_late = True
            return True
        if not waiting.client.is_attached:
            return True
        if waiting.catch_up:
            namespace = waiting.keys[0][0]
            waiting.catch_up = [(c, end) for c, end in waiting.catch_up
                                if _is_behind(c, end, namespace, self.is_issuing)]
            if waiting.catch_up:
                return False
        # From where the last look stopped (blocks before it were usable then; the answer walks
        # the index afresh), so a LOOKUP waiting on its loop turns costs a block or two a look.
        num_more, why = writing_stop(self.index, waiting.keys[waiting.num_usable:], now)
        waiting.num_usable += num_more
        if why == "writing":
            waiting.wake_at = min(waiting.deadline, abandoned_at(self.index, waiting.keys[waiting.num_usable]))
            return False
        if waiting.prefill is not None and why == "absent":  # a block another instance claimed?
            claim_end = self._claim_end(waiting, waiting.keys[waiting.num_usable])
            waiting.wake_at = min(waiting.deadline, claim_end)
            return claim_end <= now
        return True

    def _claim_end(self, waiting: WaitingLookup, key: Key) -> float:
        """When the claim another instance holds on ``key`` ends the wait (now: none holds it)."""
        held_until = self.claims.held_until(key, waiting.client.instance)
        return -float("inf") if held_until is None else held_until
