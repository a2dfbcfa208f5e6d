"""What the scheduler side tells the workers each step (pickled into SchedulerOutput), and
what the workers tell it back (``SavesDone``, in vLLM's KVConnectorOutput)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

NULL_BLOCK = 0  # vLLM's placeholder block id (never a request's own block)


@dataclass(frozen=True, slots=True)
class GroupBlocks:
    """One KV cache group's part of a load or save (a hybrid model): the group's own block
    ids, and the hashes of the positions they hold (a sliding window's are a suffix).
    ``is_state``: a Mamba group's state, loaded under its state key without the lookup's
    lease (mamba_state.py)."""

    group: int
    block_ids: tuple[int, ...]
    hashes: tuple[bytes, ...]
    is_state: bool = False


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Load ``hashes`` into ``block_ids``; ``lease_ids[rank]`` pins them for that rank.
    ``groups``: per KV cache group, one LOAD each (then ``block_ids`` is every group's
    ids, the blocks a failure leaves unusable); empty: one LOAD of every layer."""

    req_id: str
    block_ids: tuple[int, ...]
    hashes: tuple[bytes, ...]
    lease_ids: tuple[int, ...]
    is_async: bool
    groups: tuple[GroupBlocks, ...] = ()


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Store the full blocks ``block_ids`` under ``hashes`` once this step has written them.
    ``groups``: per KV cache group (then ``block_ids`` is every group's ids)."""

    req_id: str
    block_ids: tuple[int, ...]
    hashes: tuple[bytes, ...]
    groups: tuple[GroupBlocks, ...] = ()


@dataclass
class PegaConnectorMetadata(KVConnectorMetadata):
    step: int = 0  # the scheduler's count of the metadata it built (SavesDone refers to it)
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # Finished requests whose blocks vLLM keeps until the workers report their saves done.
    held_req_ids: set[str] = field(default_factory=set)
    # Requests preempted this step: their blocks may be reused now.
    preempted_req_ids: set[str] = field(default_factory=set)
    # Blocks whose failed load the scheduler has seen (it replans their saves): the
    # workers stop holding back saves on their account.
    rewound_block_ids: set[int] = field(default_factory=set)
    # Before this step's forward, every SAVE of the steps up to this one must be over: a
    # block they read (one a sliding window let go) is written again in this step.
    wait_saves_through: int = 0
    # vLLM writes some of this step's load blocks while it prepares the step, after
    # handle_preemptions (zeroing a new block, copying a partial hit's): the workers send
    # the loads at start_load_kv, after those writes, rather than at handle_preemptions.
    loads_after_input_prep: bool = False
    # The scheduler's namespace for each rank (rank index = pp_rank * tp_size + tp_rank): a
    # worker whose own differs would save blocks the scheduler never looks up (worker.py).
    namespaces: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class SavesDone(KVConnectorWorkerMetadata):
    """Every SAVE of the steps up to ``through_step`` is over on ``num_ranks`` workers (vLLM
    aggregates one per worker): no copy reads the GPU blocks those steps saved any more."""

    through_step: int
    num_ranks: int = 1

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, SavesDone):
            return self
        return SavesDone(min(self.through_step, other.through_step), self.num_ranks + other.num_ranks)


def save_tag(step: int, req_id: str) -> int:
    """The tag a voter's SAVE gives a block saved for ``req_id`` in scheduler step ``step``:
    from the metadata every rank gets alike, so the same on every rank for the same
    computation, and another for a block recomputed later (wire.py: voting)."""
    digest = hashlib.blake2b(f"{step}:{req_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")
