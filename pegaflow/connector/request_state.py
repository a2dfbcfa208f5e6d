"""What the scheduler side knows of one vLLM request (one ``RequestState`` per request,
keyed by vLLM's ``req_id``): its lookup and leases, its block tables, how far it is saved,
and how its load goes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pegaflow.connector.metadata import LoadSpec
from pegaflow.connector.prefix_lookups import PendingLookup


@dataclass(slots=True)
class RequestState:
    request: Any
    lookup_at_tokens: int = -1
    looked_up_at: float = 0.0
    num_hit_tokens: int = 0
    lease_ids: tuple[int, ...] = ()  # one per worker rank (pp x tp)
    is_from_disk: bool = False  # some of the hit is read from the engine's disk tier first
    block_ids: list[list[int]] = field(default_factory=lambda: [[]])  # per KV cache group
    num_saved_blocks: int = 0
    pending_load: LoadSpec | None = None
    has_saves: bool = False
    last_save_step: int = 0  # the step whose metadata planned this request's last save
    is_async_loading: bool = False
    is_async_hit: bool = False  # how its hit loads, as last told to vLLM
    has_failed_load: bool = False  # a hybrid load of it failed: vLLM recomputes it, no hit again
    lookup: PendingLookup | None = None
    claimed: dict[int, bytes] = field(default_factory=dict)  # compute once: block index -> hash it may hold claimed
