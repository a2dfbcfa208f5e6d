"""Voting: one stored copy of KV that several clients compute alike.

MLA's latent KV is the same on every TP rank, so the ranks of a pipeline stage share one
namespace and one copy.  A copy is servable only once every rank has saved it: a rank
whose load failed holds its saves back (the others' copies of that step derive from its
garbage), and a copy it did not vouch for must never be served.  Each voter's SAVE tags
each block (the scheduler's step and the block's request: the same on every rank for the
same computation); the first SAVE reserves the entry, copies the data and records its tag;
a later SAVE under the same tag only adds its vote; one under another tag leaves an entry
that is not READY alone (a miss later, never a wrong byte).  An entry whose votes never
all come is dropped as a stale write (``BlockIndex.drop_stale_writes``).

``VoterTable``: clients attached under one namespace must agree on how many vote.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from pegaflow.platform.errors import CommandError
from pegaflow.platform.wire import Status

from .entries import Entry

MAX_VOTERS = 64


class Vote(Enum):
    USUAL = "usual"        # no voting on this entry: dedup or copy as without voters
    COPY = "copy"          # the voter's SAVE copies the layers (its vote is in)
    VOTED = "voted"        # the vote is in, the data in or on its way from another voter
    CONFLICT = "conflict"  # another tag's copy waits for its votes: left alone


def cast(entry: Entry, tag: int, voter: int, num_voters: int, mask: int) -> Vote:
    """A voter's SAVE of ``mask``'s layers under ``tag`` meets ``entry``: record its vote and
    say what the SAVE does with the block (``Vote``; a COPY's layers are marked pending)."""
    held = entry.done_mask | entry.pending_mask
    if entry.is_ready or (entry.all_votes_mask == 0 and held):
        return Vote.USUAL  # served already, or written without voting (read back from disk)
    all_votes = (1 << num_voters) - 1
    if not held:  # reserved just now (or emptied by a failed copy): this SAVE's copy
        entry.tag, entry.votes, entry.all_votes_mask = tag, 1 << voter, all_votes
        entry.pending_mask |= mask
        return Vote.COPY
    if entry.tag != tag or entry.all_votes_mask != all_votes:
        return Vote.CONFLICT
    entry.votes |= 1 << voter
    if mask & ~held and not mask & entry.pending_mask:
        entry.pending_mask |= mask
        return Vote.COPY  # layers no voter has copied yet (another KV cache group's)
    return Vote.VOTED


def cast_all(index, stats, client, mask: int, keys: list, entries: list, tags: list[int]) -> list[Vote]:
    """Each block's vote of a voter's SAVE chunk (``cast``; a COPY is marked pending, so a
    block named twice is copied once); blocks the votes complete become READY now."""
    voted = [Vote.USUAL if entry is None or entry.is_doomed
             else cast(entry, tag, client.voter, client.num_voters, mask)
             for entry, tag in zip(entries, tags)]
    only_voted = [key for key, vote in zip(keys, voted) if vote is Vote.VOTED]
    stats.add("save_votes", len(only_voted))
    stats.add("save_vote_conflicts", sum(vote is Vote.CONFLICT for vote in voted))
    if only_voted:
        num_ready = index.mark_voted(only_voted)
        stats.add("blocks_saved", num_ready)
        stats.add_client(client.slot, "blocks_saved", num_ready)
    return voted


@dataclass(slots=True)
class VoterTable:
    """namespace -> (num_voters, slots of the clients attached under it that said so)."""

    namespaces: dict[int, tuple[int, set[int]]] = field(default_factory=dict)

    def join(self, namespace: int, slot: int, num_voters: int, voter: int) -> None:
        if not 1 <= num_voters <= MAX_VOTERS or not 0 <= voter < num_voters:
            raise CommandError(Status.BAD_ARGUMENT, f"voter {voter} of {num_voters} "
                                                    f"(1..{MAX_VOTERS} voters)")
        known = self.namespaces.get(namespace)
        if known is not None and known[0] != num_voters and known[1] - {slot}:
            raise CommandError(Status.BAD_ARGUMENT, f"namespace {namespace:016x} has {known[0]} "
                                                    f"voters, not {num_voters}")
        if known is None or known[0] != num_voters:
            known = self.namespaces[namespace] = (num_voters, set())
        known[1].add(slot)

    def attach(self, client, namespace: int, voters) -> None:
        """``client`` ATTACHes under ``namespace``, a voter if ``voters`` (its ATTACH's
        ``Voters``) says so: joined there, and out of the namespace it voted in before, if
        this is an ATTACH again (a stale voter would refuse the old namespace's later voters)."""
        if voters is not None:
            self.join(namespace, client.slot, voters.num_voters, voters.voter)
        if client.is_attached and (voters is None or namespace != client.namespace):
            self.leave(client.namespace, client.slot)
        client.num_voters, client.voter = (1, 0) if voters is None else (voters.num_voters, voters.voter)

    def leave(self, namespace: int, slot: int) -> None:
        known = self.namespaces.get(namespace)
        if known is None:
            return
        known[1].discard(slot)
        if not known[1]:
            del self.namespaces[namespace]


def check_tags(client, save) -> list[int] | None:
    """A SAVE's tags, once it is known they belong (None: not a voter's SAVE)."""
    if client.num_voters == 1:
        if save.tags is not None:
            raise CommandError(Status.BAD_ARGUMENT, "VOTE_TAGS from a client that is no voter")
        return None
    if save.tags is None:
        raise CommandError(Status.BAD_ARGUMENT, "a voter's SAVE carries VOTE_TAGS")
    if save.namespace != client.namespace:
        raise CommandError(Status.BAD_ARGUMENT, f"a voter saves under its ATTACH namespace "
                                                f"{client.namespace:016x} only")
    return save.tags.tolist()
