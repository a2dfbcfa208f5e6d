"""Run the engine with its finished SAVE copies held back while a file exists: a SAVE's
blocks stay WRITING (its copies "in flight") until the test removes the file (LOADs go on)::

    python -m tests.pegaflow.connector.held_copies HOLD_PATH PYTHON -m engine ARGS...

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


def main(argv: list[str]) -> int:
    hold_path, command = argv[0], argv[1:]
    hold_copies(hold_path)
    from engine.__main__ import main as engine_main
    return engine_main(command[command.index("engine") + 1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
