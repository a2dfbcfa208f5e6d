"""The answers a client has read but nobody has asked for yet.

The completion ring is read in order, so waiting for one request reads the answers of
others: each is kept here until ``take``n, dropped on arrival if nobody wants it
(``ignore``: a fire-and-forget RELEASE or DROP), or set aside as an orphan when its
waiter gave up (``abandon``: a lookup's lease, say, that still has to be released).
"""

from __future__ import annotations

import logging

from pegaflow.platform.protocol import Completion

logger = logging.getLogger(__name__)


class Answers:
    def __init__(self) -> None:
        self._done: dict[int, Completion] = {}
        self._abandoned: set[int] = set()
        self._unwanted: set[int] = set()
        self._orphans: list[Completion] = []

    def is_awaited(self, command_id: int) -> bool:
        """Whether a caller still waits for this request's answer."""
        return command_id not in self._abandoned and command_id not in self._unwanted

    def keep(self, completion: Completion) -> None:
        command_id = completion.command_id
        if command_id in self._unwanted:
            self._unwanted.discard(command_id)
            if not completion.is_ok:
                logger.debug("engine answered command %d with %s", command_id, completion.status)
        elif command_id in self._abandoned:
            self._abandoned.discard(command_id)
            self._orphans.append(completion)
        else:
            self._done[command_id] = completion

    def take(self, command_id: int) -> Completion | None:
        return self._done.pop(command_id, None)

    def ignore(self, command_id: int) -> None:
        """Nobody will wait for this answer: drop it when it arrives."""
        self._unwanted.add(command_id)

    def abandon(self, command_id: int) -> None:
        """The waiter gave up: the answer (read already, or when it comes) is an orphan."""
        done = self._done.pop(command_id, None)
        if done is not None:
            self._orphans.append(done)
        else:
            self._abandoned.add(command_id)

    def take_orphans(self) -> list[Completion]:
        orphans, self._orphans = self._orphans, []
        return orphans
