"""A worker's asynchronous loads still out: the LOADs vLLM waits for between steps.

Each is keyed by the engine's command id of its LOAD (not vLLM's ``req_id``).  A hybrid
model's load is one LOAD per KV cache group: the load is done once every one of them is
answered, and failed if any one failed.  ``collect`` only reads answers and says what
they mean (``Answered``); counting them, telling vLLM and tainting saves is the caller's.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from pegaflow.connector.metadata import LoadSpec

logger = logging.getLogger(__name__)


class AsyncLoad(NamedTuple):
    """One LOAD out for an asynchronous load."""

    spec: LoadSpec
    sent_at: float  # time.monotonic() when it went out


class Answered(NamedTuple):
    """A whole load (every LOAD of it) answered."""

    spec: LoadSpec
    sent_at: float
    is_ok: bool


class Collected(NamedTuple):
    answered: list[Answered]
    expired: LoadSpec | None  # a load whose LOAD missed its deadline (the rest not looked at)


class AsyncLoads:
    def __init__(self) -> None:
        self.by_command: dict[int, AsyncLoad] = {}  # engine command id -> its load
        self._parts_left: dict[str, int] = {}  # a hybrid load's vLLM req_id -> LOADs unanswered
        self._parts_failed: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self.by_command)

    def sent(self, command_ids: list[int], spec: LoadSpec, now: float) -> None:
        if spec.groups:
            self._parts_left[spec.req_id] = len(command_ids)
        for command_id in command_ids:
            self.by_command[command_id] = AsyncLoad(spec, now)

    def collect(self, client, now: float, timeout_s: float) -> Collected:
        """Take the answers that have arrived (never blocks)."""
        answered: list[Answered] = []
        for command_id, (spec, sent_at) in list(self.by_command.items()):
            done = client.try_take(command_id)
            if done is None and sent_at > now - timeout_s:
                continue
            if done is None:
                logger.warning("pegaflow: async load for %s missed its deadline; vLLM "
                               "recomputes it", spec.req_id)
                return Collected(answered, spec)
            del self.by_command[command_id]
            if not spec.groups:
                answered.append(Answered(spec, sent_at, done.is_ok))
            elif (is_ok := self._part_answered(spec.req_id, done.is_ok)) is not None:
                answered.append(Answered(spec, sent_at, is_ok))
        return Collected(answered, None)

    def _part_answered(self, req_id: str, is_ok: bool) -> bool | None:
        """One of a hybrid load's LOADs answered: whether the load succeeded, once its last
        LOAD is in (None before)."""
        if not is_ok:
            self._parts_failed.add(req_id)
        self._parts_left[req_id] -= 1
        if self._parts_left[req_id] > 0:
            return None
        del self._parts_left[req_id]
        if req_id in self._parts_failed:
            self._parts_failed.discard(req_id)
            return False
        return True

    def take_all(self) -> list[LoadSpec]:
        """The connection they went out on is gone: every load out, once per vLLM request."""
        specs = list({spec.req_id: spec for spec, _ in self.by_command.values()}.values())
        self.by_command.clear()
        self._parts_left.clear()
        self._parts_failed.clear()
        return specs
