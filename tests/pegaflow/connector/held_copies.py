"""Run the engine with its copies held back while a file exists::

    python -m tests.pegaflow.connector.held_copies [--loads] HOLD_PATH PYTHON -m engine ARGS...

By default a finished SAVE's copies are held: its blocks stay WRITING (its copies "in
flight") until the test removes the file (LOADs go on).  With ``--loads`` a LOAD's copies
are held instead, before a byte moves: its blocks in the client's memory keep what they
held and its answer waits, as a GPU's copies queued behind other work (SAVEs go on).

Given as an ``EngineProcess`` prefix, so the engine's pid is this process's.
"""

from __future__ import annotations

import os
import sys


def hold_copies(hold_path: str) -> None:
    """Patch the host backend: SAVE copies end (in order) only while ``hold_path`` is absent."""
    from engine.copy import host
    from engine.copy.base import Direction
    submit, poll, num_inflight = host.HostBackend.submit, host.HostBackend.poll, host.HostBackend.num_inflight
    saves, held = set(), []

    def noted_submit(self, op):
        if op.direction == Direction.SAVE:
            saves.add(op.token)
        submit(self, op)

    def held_poll(self):
        done = poll(self)
        held.extend(d for d in done if d.token in saves)
        done = [d for d in done if d.token not in saves]
        if not os.path.exists(hold_path):
            done += held
            saves.difference_update(d.token for d in held)
            held.clear()
        return done

    host.HostBackend.submit = noted_submit
    host.HostBackend.poll = held_poll
    host.HostBackend.num_inflight = lambda self: num_inflight(self) + len(held)


def hold_loads(hold_path: str) -> None:
    """Patch the host backend: a LOAD's copies run (in order) only once ``hold_path`` is
    absent; until then nothing of it is written and it is not done."""
    from engine.copy import host
    from engine.copy.base import Direction
    submit, poll, num_inflight = host.HostBackend.submit, host.HostBackend.poll, host.HostBackend.num_inflight
    held = []

    def held_submit(self, op):
        if op.direction == Direction.LOAD and (held or os.path.exists(hold_path)):
            held.append(op)  # (one queued behind a held one waits too: loads keep their order)
            return
        submit(self, op)

    def held_poll(self):
        if held and not os.path.exists(hold_path):
            for op in held:
                submit(self, op)
            held.clear()
        return poll(self)

    host.HostBackend.submit = held_submit
    host.HostBackend.poll = held_poll
    host.HostBackend.num_inflight = lambda self: num_inflight(self) + len(held)


def main(argv: list[str]) -> int:
    is_loads = argv[0] == "--loads"
    hold_path, command = argv[int(is_loads)], argv[int(is_loads) + 1:]
    (hold_loads if is_loads else hold_copies)(hold_path)
    from engine.__main__ import main as engine_main
    return engine_main(command[command.index("engine") + 1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
