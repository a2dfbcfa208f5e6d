"""One attached client as the engine sees it: its rings, its memory, its answers."""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from pegaflow.platform.ring import RingConsumer, RingProducer, RingSegmentView

from .copy.base import LayerPlacement

_client_ids = itertools.count(1)

MAX_UNREAD_ANSWERS = 1024  # answers queued behind a client's full completion ring; past
#                            this its commands wait unread (its submit then times out)


@dataclass(slots=True)
class ClientState:
    slot: int
    view: RingSegmentView
    submissions: RingConsumer
    completions: RingProducer
    pid: int = 0
    instance: int = 0  # the vLLM instance it said it serves at ATTACH (0: none)
    namespace: int = 0  # the namespace it named at ATTACH
    num_voters: int = 1  # clients that save its namespace's blocks alike (``votes.py``); 1: no voting
    voter: int = 0       # its index among them
    is_attached: bool = False
    is_detached: bool = False
    pending_detach: object = None  # a DETACH waiting for copies to end (its ``Received``)
    layers: dict[int, LayerPlacement] = field(default_factory=dict)
    groups: dict[int, list[int]] = field(default_factory=dict)  # KV cache group -> its layers, in order
    region_blocks: dict[int, int] = field(default_factory=dict)  # region id -> num blocks
    page_bytes: int = 0
    num_events: int = 0
    num_inflight: int = 0
    backlog: deque = field(default_factory=deque)  # COMPLETION fields after seq
    uid: int = field(default_factory=lambda: next(_client_ids))  # unique in this engine's life
    ring_name: str = ""  # its ring segment: ATTACH's pid must map it ("" in unit tests: unchecked)
    accepted_at: float = 0.0  # when its claim was accepted (monotonic): ATTACH is due within the attach timeout
    close_reason: str = ""  # why the engine closes it (set once; its copies may still run)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def entry_bytes(self) -> int:
        return self.num_layers * self.page_bytes

    @property
    def is_held_back(self) -> bool:
        """It reads none of its answers: the engine reads none of its commands meanwhile
        (else the answers queued for it would grow without bound)."""
        return len(self.backlog) >= MAX_UNREAD_ANSWERS

    @property
    def revoked(self) -> bool:
        """The client stopped waiting for its copies: their blocks may belong to others now."""
        return bool(self.view.revoked[0])

    @property
    def closed_by_client(self) -> bool:
        """The client unmapped its ring: it reads no more answers."""
        return bool(self.view.client_closed[0])

    def is_complete(self) -> bool:
        """All layers 0..n-1 registered, so blocks can be stored."""
        return bool(self.layers) and max(self.layers) + 1 == len(self.layers)

    def answer(self, command_id: int, opcode: int, status: int, num_items: int = 0,
               value: int = 0, value2: int = 0, value3: int = 0) -> None:
        """Publish exactly one completion now, or queue it (behind any already queued) for a
        later flush while the completion ring is full."""
        fields = (command_id, opcode, status, num_items, value, value2, value3)
        if self.backlog or not self.completions.try_put_fields(fields):
            self.backlog.append(fields)

    def flush(self) -> bool:
        """Publish queued completions while the completion ring has room."""
        backlog = self.backlog
        while backlog:
            if not self.completions.try_put_fields(backlog[0]):
                return False
            backlog.popleft()
        return True
