"""Compute once: the blocks a vLLM instance is about to prefill, claimed, so that another
instance sent the same new prefix at the same moment waits for them instead of computing
them again (docs/replicas.md, "Compute once").

    claim       a LOOKUP that takes part (its ``Prefill``) and misses: each block past its
                hits that no entry holds and no live claim names is claimed for its
                instance, with a deadline from the prefill it expects (its blocks, its rate)
    wait_until  another instance's LOOKUP whose prefix, past its READY blocks and blocks
                being written that no claim covers, reaches a block claimed in its
                namespace (absent, or being written by the claimer's SAVE): parked
                (``lookup_waits.py``), at most the asker's ``wait_ms``, if the claimer's
                blocks still to come up to the last one the asker wants, at the claimer's
                rate, take no longer than the asker's own blocks from its READY prefix on
                at its rate; else answered now (a decline, counted)
    held_until  how long a parked LOOKUP's stop is still claimed: it waits on while it is
                (or while the block is being written)
    ends        a claim ends when
                  - each of its blocks is READY in its namespace (``sweep``, at housekeeping),
                  - its instance sends RELEASE_CLAIM for the blocks its request will not
                    compute (aborted, preempted, finished short: ``release``; the rest stand),
                  - its client goes (``release_slot``: a dead one reclaimed),
                  - a SAVE of its blocks fails or finds no room (``save_failed``),
                  - its deadline passes with some of its blocks not on their way yet (those
                    being saved are waited for past it: they land, or their SAVE fails);
                the parked LOOKUPs then look again (``has_ended``): what is READY is
                theirs, the rest their vLLM computes.

A claim covers its blocks until they are READY, not only until their SAVE arrives: vLLM
issues a prefill's SAVEs as its forward starts, and on a GPU that several replicas share the
forward and its copies take far longer than the engine's wait for saves in flight
(``--lookup-wait-ms``); a LOOKUP that reached them then would have been answered short and its
vLLM would compute them again.

Rates.  The wait-or-compute choice compares the rates the two LOOKUPs state (the
connector's ``prefill_tokens_per_s``), like for like.  A claim's deadline is its blocks at
the claimer's stated rate, or at the rate the engine measured for its instance where that is
slower: each claim whose blocks all came, from the claim to its last block's SAVE, queueing
in vLLM included (smoothed over claims).  That measurement is no prefill rate (a claim whose
request ran at once measures almost nothing, one queued behind others its queue), so it only
ever lengthens a deadline, never a wait's odds.

A claim never makes a block READY, it only delays an answer: a waiter loads what any LOOKUP
would find, so a claim costs time (at most the asker's ``wait_ms``), never a wrong token.
With chunked prefill the claimer saves its prefix a chunk at a time; a waiter waits for the
whole run it wants, and is answered with the chunks saved so far only when the claim ends
without the rest.

Claims are keyed by block hash, not by namespace: the LOOKUPs of one request's TP ranks (a
namespace each) arrive one after another, and two instances racing for one prefix must not
each win a rank of it.  An instance never waits for its own claims.  A claim records the
namespaces its own instance's LOOKUPs named for its blocks (the first rank's claims them,
the later ranks' add theirs), and another instance's LOOKUP waits for it only in one of
those: vLLM's block hashes are token-based, so a second model on the engine sent a prompt the
first is prefilling has the same hashes in a namespace of its own, and would wait for blocks
it can never load.  Such a LOOKUP neither waits for nor claims those blocks (its vLLM
computes them, as without compute once).  Where an asker's later rank looks up before the
claimer's same rank has (the two instances' LOOKUPs interleaved), that rank does not wait
either: a wait lost, not a hang or a wrong token (the rank's vLLM computes what it misses).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pegaflow.platform.protocol import Done, Key, Prefill, ReleaseClaim

SLACK = 2.0  # a claim's deadline: the prefill it expects this many times over,
MARGIN_S = 0.5  # plus this (vLLM may queue the request a while before its prefill starts),
MAX_CLAIM_S = 10.0  # and never further off than this
RATE_WEIGHT = 0.3  # a new measurement's weight in an instance's smoothed prefill time per block
_DONE = Done()


@dataclass(slots=True)
class Claim:
    instance: int        # whose (its vLLM instance); never waited for by that instance
    slot: int            # the client that made it (the instance's scheduler)
    namespace: int       # where its blocks are saved (its LOOKUP's)
    namespaces: set[int]  # where its instance's LOOKUPs named them (its TP ranks'): only there is it waited for
    hashes: list[bytes]  # its blocks, in prefix order
    ordinals: list[int]  # each one's place among the blocks its vLLM computes (1: the first)
    made_at: float       # monotonic
    s_per_block: float   # the claimer's prefill time of one block, as its LOOKUP states it
    deadline: float      # monotonic
    is_over: bool = False

    def num_left(self, entries, last: int) -> int:
        """Its blocks up to ordinal ``last`` not READY yet (not saved, or their SAVE still on its way)."""
        return sum(o <= last and not _is_ready(entries.get((self.namespace, h)))
                   for h, o in zip(self.hashes, self.ordinals))


class PrefillClaims:
    def __init__(self, index, stats, is_on: bool = True) -> None:
        self.index, self.stats = index, stats
        self.is_on = is_on  # --compute-once
        self.by_hash: dict[bytes, tuple[Claim, int]] = {}  # block hash -> (claim, its ordinal)
        self.claims: list[Claim] = []
        self.has_ended = False  # a claim ended since the parked LOOKUPs last looked
        self.measured: dict[int, float] = {}  # instance -> its prefill seconds a block, as its claims went

    def claim(self, client, keys: list[Key], num_hits: int, prefill: Prefill | None) -> None:
        """Claim for ``client``'s instance the blocks of ``keys`` past ``num_hits`` that no
        entry holds and no live claim names; its own live claims on them add ``keys``'
        namespace (a later TP rank's LOOKUP)."""
        if not self.is_on or prefill is None or not prefill.tokens_per_s:
            return
        now, entries = time.monotonic(), self.index.entries
        s_per_block = stated_s_per_block(prefill)
        free = []
        for i, key in enumerate(keys[num_hits:], num_hits):
            found = self._live(key[1], now)
            if found is not None and found[0].instance == client.instance:  # its own: a later TP rank's
                found[0].namespaces.add(key[0])                               # LOOKUP names its namespace
            elif found is None and key not in entries:
                free.append((i - num_hits + 1, key[1]))
        if not free:
            return
        expected_s = (len(keys) - num_hits) * max(s_per_block, self.measured.get(client.instance, 0.0))
        claim = Claim(client.instance, client.slot, keys[0][0], {keys[0][0]}, [h for _, h in free],
                      [o for o, _ in free], now, s_per_block, now + min(SLACK * expected_s + MARGIN_S, MAX_CLAIM_S))
        self.claims.append(claim)
        for ordinal, hash_key in free:
            self.by_hash[hash_key] = (claim, ordinal)
        self.stats.add("claims")
        self.stats.add("claim_blocks", len(free))

    def wait_until(self, client, keys: list[Key], start: int, prefill: Prefill | None) -> float | None:
        """How long (a monotonic deadline: the asker's ``wait_ms``) a LOOKUP of ``client``
        whose READY prefix is ``start`` blocks waits for another instance's claim; None: it
        does not.  (While the blocks it stops at are not being written, the claim's own
        deadline ends the wait sooner: ``held_until``.)"""
        if not self.is_on or prefill is None or not prefill.wait_ms:
            return None
        now = time.monotonic()
        position = self._claimed_stop(keys, start, client.instance, now)
        if position is None:
            return None
        claim, last = self.by_hash[keys[position][1]]
        num_claimed = 1
        for key in keys[position + 1:]:  # the run of this claim's blocks the asker wants
            found = self.by_hash.get(key[1])
            if found is None or found[0] is not claim:
                break
            num_claimed, last = num_claimed + 1, found[1]
        num_own = position - start + num_claimed  # what the asker computes if it does not wait
        own_s = num_own * stated_s_per_block(prefill)
        if claim.num_left(self.index.entries, last) * claim.s_per_block > own_s * (1 + 1e-9):  # (a tie waits)
            self.stats.add("claim_declines")
            return None
        return now + prefill.wait_ms / 1e3

    def held_until(self, key: Key, instance: int) -> float | None:
        """The deadline of the live claim another instance than ``instance`` holds on
        ``key``'s block in ``key``'s namespace (None: none holds it)."""
        found = self._waited_for(key, instance, time.monotonic())
        return None if found is None else found[0].deadline

    def note_seen(self) -> None:
        """The parked LOOKUPs are looking again: the ends so far are seen."""
        self.has_ended = False

    def count_wait(self, num_gained: int, prefill: Prefill, waited_s: float) -> None:
        """A LOOKUP that waited for a claim was answered, ``num_gained`` blocks longer."""
        self.stats.add("claim_waits")
        self.stats.add("claim_wait_blocks", num_gained)
        self.stats.add("claim_tokens_saved", num_gained * prefill.block_tokens)
        self.stats.add("claim_wait_ns", int(waited_s * 1e9))

    def release(self, received, release: ReleaseClaim) -> Done:
        """RELEASE_CLAIM (the dispatcher's handler): blocks the asker's instance will not
        compute after all (its request aborted, preempted, or finished short of them) are
        claimed no more; the rest of their claims stand (their saves may be on their way)."""
        instance, entries, touched = received.client.instance, self.index.entries, {}
        for hash_key in release.hash_keys():
            found = self.by_hash.get(hash_key)
            if found is not None and found[0].instance == instance:
                del self.by_hash[hash_key]
                claim = touched.setdefault(id(found[0]), (found[0], []))[0]
                touched[id(claim)][1].append((claim.namespace, hash_key) not in entries)
        for claim, unsaved in touched.values():
            self.has_ended = True
            self.stats.add("claims_dropped", int(any(unsaved)))
            kept = [(h, o) for h, o in zip(claim.hashes, claim.ordinals) if self.by_hash.get(h, (None,))[0] is claim]
            claim.hashes, claim.ordinals = [h for h, _ in kept], [o for _, o in kept]
            claim.is_over = not kept
        return _DONE

    def release_slot(self, slot: int) -> None:
        """Client ``slot`` went away: its claims end."""
        for claim in [c for c in self.claims if c.slot == slot and not c.is_over]:
            self._end(claim)

    def save_failed(self, keys: list[Key]) -> None:
        """A SAVE of ``keys`` failed or found no room: the claims naming them end."""
        for key in keys:
            found = self.by_hash.get(key[1])
            if found is not None:
                self._end(found[0])

    def sweep(self, now: float) -> None:
        """Housekeeping: claims whose blocks are all READY, or past their deadline, end."""
        for claim in self.claims:
            if claim.is_over:
                continue
            if self._num_unsaved(claim) == 0:
                self._measure(claim)
                self._end(claim)
            elif now >= claim.deadline and self._num_absent(claim):
                self.stats.add("claim_timeouts")
                self._end(claim, is_counted=False)
        self.claims = [c for c in self.claims if not c.is_over]

    def _measure(self, claim: Claim) -> None:
        """A claim whose blocks all came: its instance's time a block from the claim to its
        last block's SAVE (queueing in vLLM included), a floor under its next deadlines."""
        entries = self.index.entries
        spent_s = max(entries[(claim.namespace, h)].started_at for h in claim.hashes) - claim.made_at
        if spent_s <= 0 or not claim.ordinals:
            return
        sample, old = spent_s / max(claim.ordinals), self.measured.get(claim.instance)
        self.measured[claim.instance] = sample if old is None else old + RATE_WEIGHT * (sample - old)

    def _end(self, claim: Claim, is_counted: bool = True) -> None:
        claim.is_over, self.has_ended = True, True
        if is_counted and self._num_unsaved(claim):
            self.stats.add("claims_dropped")
        for hash_key in claim.hashes:
            found = self.by_hash.get(hash_key)
            if found is not None and found[0] is claim:
                del self.by_hash[hash_key]

    def _num_unsaved(self, claim: Claim) -> int:
        """Its blocks not READY in its namespace (absent, or their SAVE still on its way)."""
        entries = self.index.entries
        return sum(not _is_ready(entries.get((claim.namespace, h))) for h in claim.hashes)

    def _num_absent(self, claim: Claim) -> int:
        """Its blocks no SAVE has reached yet (no entry in its namespace, or a doomed one)."""
        entries = self.index.entries
        return sum(not _is_on_its_way(entries.get((claim.namespace, h))) for h in claim.hashes)

    def _live(self, hash_key: bytes, now: float) -> tuple[Claim, int] | None:
        """The claim on a block while it holds: before its deadline, and past it while the
        block's SAVE is on its way (the claimer is computing it: it lands, or its SAVE fails)."""
        found = self.by_hash.get(hash_key)
        if found is None or found[0].is_over:
            return None
        claim = found[0]
        if now < claim.deadline or _is_on_its_way(self.index.entries.get((claim.namespace, hash_key))):
            return found
        return None

    def _waited_for(self, key: Key, instance: int, now: float) -> tuple[Claim, int] | None:
        """The live claim on ``key``'s block that a LOOKUP of ``instance`` waits for: another
        instance's, in ``key``'s namespace (None: none)."""
        found = self._live(key[1], now)
        if found is None or found[0].instance == instance or key[0] not in found[0].namespaces:
            return None
        return found

    def _claimed_stop(self, keys: list[Key], start: int, instance: int, now: float) -> int | None:
        """Where ``keys`` past ``start`` reach a block another instance claimed in their
        namespace that is not READY (absent, or its SAVE on its way), past READY blocks and
        blocks being written that no such claim covers (None: they reach none first)."""
        entries = self.index.entries
        for i in range(start, len(keys)):
            entry = entries.get(keys[i])
            if _is_ready(entry):
                continue
            if self._waited_for(keys[i], instance, now) is not None:
                return i
            if entry is None or entry.is_doomed:
                return None
            # being written, claimed by no other instance: the wait for saves in flight covers it
        return None


def stated_s_per_block(prefill: Prefill) -> float:
    """A LOOKUP's prefill seconds a block, as it states them."""
    return prefill.block_tokens / prefill.tokens_per_s if prefill.tokens_per_s else float("inf")


def _is_on_its_way(entry) -> bool:
    """Whether a block's entry (None: none) is READY or being saved (not doomed)."""
    return entry is not None and not entry.is_doomed


def _is_ready(entry) -> bool:
    """Whether a block's entry (None: none) can be loaded now (READY, or read from disk for a load)."""
    return entry is not None and not entry.is_doomed and (entry.is_ready or entry.is_promoting)
