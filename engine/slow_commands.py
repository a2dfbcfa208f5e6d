"""Commands worth a line in the engine's log, logged at a bounded rate: those whose handling
held the engine's one thread long enough to delay the others, and refused setup commands.

Every client's commands are handled by one loop (``server.py``), so a command that takes
tens of milliseconds to handle (issuing a large LOAD, a LOOKUP walking a long prefix) holds
up every other client's lookups and loads meanwhile: a lookup answered late makes vLLM
recompute (past the connector's ``lookup_timeout_ms``), a load accepted late stalls a
step.  Each handling longer than ``SLOW_COMMAND_S`` is noted here, and at most every
``REPORT_EVERY_S`` one WARNING says how many there were, of which commands, and the
slowest, so a stall under load shows in the engine's log instead of only in vLLM's
latencies.  The line also says how much of the slowest handling went to issuing its copies
(the copy backend's ``submit``: for CUDA, the driver calls that enqueue them), against the
engine's own bookkeeping: the two call for different remedies.

A refused ATTACH, REGISTER or REGISTER_EVENTS stops a client caching, so it says why at
WARNING: once per client and opcode every ``REFUSAL_EVERY_S``, the next line saying how many
were left out meanwhile (a client refused in a loop, or a fuzzer, cannot fill the log).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pegaflow.platform.wire import Opcode

logger = logging.getLogger(__name__)

SLOW_COMMAND_S = 20e-3  # a LOOKUP queued behind this much is already a step late
REPORT_EVERY_S = 10.0
REFUSAL_EVERY_S = 10.0  # one refused setup command's WARNING per client and opcode
_NAMES = {int(op): op.name for op in Opcode}  # (a refused command's opcode may be none of them)


@dataclass(slots=True)
class SlowCommands:
    """Slow handlings since the last report: how many per opcode, and the slowest."""
    by_opcode: dict[str, int] = field(default_factory=dict)
    slowest_s: float = 0.0
    slowest: str = ""
    slowest_issue_s: float = 0.0  # of slowest_s, in the copy backend's submit
    next_report_at: float = 0.0
    num_reported: int = 0

    def note(self, opcode: int, seconds: float, slot: int, num_items: int, issue_s: float = 0.0) -> None:
        """One command's handling took ``seconds``, ``issue_s`` of them issuing copies (called
        only past ``SLOW_COMMAND_S``)."""
        name = _NAMES.get(opcode, str(opcode))
        self.by_opcode[name] = self.by_opcode.get(name, 0) + 1
        if seconds > self.slowest_s:
            self.slowest_s, self.slowest = seconds, f"{name} of {num_items} items from slot {slot}"
            self.slowest_issue_s = issue_s

    def report(self, now: float) -> bool:
        """Log what was noted, if anything and if ``REPORT_EVERY_S`` passed since the last
        report; True when a line was written."""
        if not self.by_opcode or now < self.next_report_at:
            return False
        counts = ", ".join(f"{count} {name}" for name, count in sorted(self.by_opcode.items()))
        logger.warning("engine loop held up: %d command(s) took over %.0f ms to handle (%s); the slowest, "
                       "%s, %.1f ms (%.1f ms of it issuing copies); every other client's commands "
                       "waited meanwhile", sum(self.by_opcode.values()), SLOW_COMMAND_S * 1e3, counts,
                       self.slowest, self.slowest_s * 1e3, self.slowest_issue_s * 1e3)
        self.num_reported += sum(self.by_opcode.values())
        self.by_opcode.clear()
        self.slowest_s, self.slowest, self.slowest_issue_s = 0.0, "", 0.0
        self.next_report_at = now + REPORT_EVERY_S
        return True


@dataclass(slots=True)
class RefusedCommands:
    """When each (client, opcode)'s refusal was last logged, and how many were left out since."""
    last: dict[tuple[int, int], tuple[float, int]] = field(default_factory=dict)

    def note(self, client, opcode: int, why: object, now: float) -> None:
        """Log this refused setup command of ``client`` unless one of the same client and
        opcode was logged within ``REFUSAL_EVERY_S`` (then only counted)."""
        key = (client.uid, opcode)
        logged_at, num_left_out = self.last.get(key, (-REFUSAL_EVERY_S, 0))
        if now - logged_at < REFUSAL_EVERY_S:
            self.last[key] = (logged_at, num_left_out + 1)
            return
        if len(self.last) > 4096:  # (clients come and go: forget the old ones)
            self.last = {k: v for k, v in self.last.items() if now - v[0] < REFUSAL_EVERY_S}
        self.last[key] = (now, 0)
        logger.warning("slot %d (pid %d): %s refused: %s%s", client.slot, client.pid,
                       _NAMES.get(opcode, opcode), why, f" ({num_left_out} more refused "
                       f"in the last {now - logged_at:.0f} s, not logged)" if num_left_out else "")
