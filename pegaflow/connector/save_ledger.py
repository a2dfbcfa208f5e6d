"""Which SAVEs of a worker are out, for which requests, and so which requests' blocks vLLM
may free: a request vLLM holds for us (``held``) is reported finished once none of its
SAVEs is outstanding; a dropped connection forgets them all (the link revoked them).
``done_through`` is the last step up to which every step's SAVE is over (or never went
out), which lets the scheduler free a finished request's blocks at once."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import NamedTuple

from pegaflow.connector.stats import PegaKVConnectorStats

logger = logging.getLogger(__name__)


class SaveOut(NamedTuple):
    """One SAVE the engine has not answered yet."""

    req_ids: tuple[str, ...]  # the vLLM requests whose blocks it stores
    sent_at: float  # time.monotonic() when it went out
    step: int  # the step that sent it


class SaveLedger:
    def __init__(self, stats: PegaKVConnectorStats):
        self.stats = stats
        self.commands: dict[int, SaveOut] = {}  # engine command id -> the SAVE
        self.pending: defaultdict[str, int] = defaultdict(int)  # vLLM req_id -> its SAVEs out
        self.held: set[str] = set()  # requests whose blocks vLLM keeps until we report them
        self.num_short = 0  # SAVEs answered with an error or with blocks dropped
        self.step = 0  # the step bound last (its metadata's number)

    def new_step(self, step: int) -> None:
        self.step = step

    def done_through(self) -> int:
        """The last step up to which no SAVE is out (the current step's decided already:
        vLLM asks after get_finished)."""
        return min((save.step for save in self.commands.values()), default=self.step + 1) - 1

    def sent(self, command_id: int, req_ids: tuple[str, ...]) -> None:
        self.commands[command_id] = SaveOut(req_ids, time.monotonic(), self.step)
        for req_id in req_ids:
            self.pending[req_id] += 1

    def answered(self, command_id: int, done) -> None:
        result = done.result  # num_stored, num_deduped, num_dropped
        is_short = not done.is_ok or result.num_dropped  # refused or failed, or no room for some
        if is_short:
            self.num_short += 1
        log = logger.warning if is_short and self.num_short % 100 == 1 else logger.debug
        log("pegaflow: SAVE %d answered %s (%d stored, %d already there, %d dropped; %d SAVEs "
            "short so far)", command_id, getattr(done.status, "name", done.status), result.num_stored,
            result.num_deduped, result.num_dropped, self.num_short)
        req_ids, sent_at, _ = self.commands.pop(command_id)
        self.stats.observe("save_s", time.monotonic() - sent_at)
        self.stats.add("saved_blocks", result.num_stored if done.is_ok else 0)
        self.stats.add("save_dropped_blocks", result.num_dropped)
        for req_id in req_ids:
            self.pending[req_id] -= 1
            if self.pending[req_id] <= 0:
                del self.pending[req_id]

    def forget(self) -> None:
        """The connection is gone (and revoked our saves): nothing stores our blocks any more."""
        self.commands.clear()
        self.pending.clear()

    def is_saving(self, req_ids) -> bool:
        return any(r in self.pending for r in req_ids)

    def wait_while(self, is_waiting, collect, timeout_s: float) -> bool:
        """Call ``collect()`` (which takes answers) while ``is_waiting()``; False if still
        waiting after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        collect()
        while is_waiting():
            if time.monotonic() >= deadline:
                return False
            time.sleep(50e-6)
            collect()
        return True

    def take_finished(self) -> set[str]:
        """The held requests none of whose SAVEs is out: vLLM may free their blocks now."""
        done = {r for r in self.held if r not in self.pending}
        self.held -= done
        return done
