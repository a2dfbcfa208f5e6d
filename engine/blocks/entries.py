"""The index's records: an entry (a block's place in the pool, its layers' progress, its
voters' votes, its pins) and a lease (the entries a LOOKUP pinned for the load that follows)."""

from __future__ import annotations

from dataclasses import dataclass

from pegaflow.platform.protocol import Key  # (namespace, hash key): defined with the commands that carry it

ORPHAN = -1


@dataclass(slots=True)
class Entry:
    offset: int
    entry_bytes: int
    all_layers_mask: int
    owner_slot: int  # ORPHAN once its client is gone: dropped if it can never complete
    started_at: float = 0.0
    done_mask: int = 0
    pending_mask: int = 0
    refs: int = 0
    is_doomed: bool = False  # a DROP came while it was in use: never served, dropped when free
    writer: tuple[int, int] = (0, 0)  # (client uid, SAVE command id) that reserved it
    is_promoting: bool = False  # being read from the disk tier: a LOAD of it waits
    num_hits: int = 0  # lookups that found it (the disk tier's ``reused`` admission)
    is_published: bool = False  # put to the remote tier's store (or on its way, or fetched from it)
    # Voting (``engine/blocks/votes.py``): the tag of the SAVE that reserved it, the voters that
    # saved it under that tag, and all of theirs (0: no voting, READY once its layers are in).
    tag: int = 0
    votes: int = 0
    all_votes_mask: int = 0

    @property
    def is_complete(self) -> bool:
        """Every layer in and every voter's vote: READY unless doomed."""
        return self.done_mask == self.all_layers_mask and self.votes == self.all_votes_mask

    @property
    def is_ready(self) -> bool:
        return self.done_mask == self.all_layers_mask and self.votes == self.all_votes_mask \
            and not self.is_doomed


@dataclass(slots=True)
class Lease:
    lease_id: int
    slot: int
    keys: list[Key]
    expires_at: float
    entries: list[Entry]  # of ``keys``, pinned while it lives
    owner: int = 0        # the vLLM instance whose clients may use it (0: any)
    num_disk: int = 0     # of them being read from the disk tier when it was made


@dataclass(slots=True)
class IndexCounters:
    evictions: int = 0
    lease_expiries: int = 0


def is_unused(entry: Entry) -> bool:
    """Neither pinned (lease, load) nor being written: it may leave the index."""
    return entry.refs == 0 and entry.pending_mask == 0
