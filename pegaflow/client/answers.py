"""The answers a client has read but nobody has asked for yet.

The completion ring is read in order, so waiting for one request reads the answers of
others: each is kept here until ``take``n, dropped on arrival if nobody wants it
(``ignore``: a fire-and-forget RELEASE or DROP), or set aside as an orphan when its
waiter gave up (``abandon``: a lookup's lease, say, that still has to be released).
"""

from __future__ import annotations

import logging

from pegaflow.client.completion import Completion

logger = logging.getLogger(__name__)


class Answers:
    def __init__(self) -> None:
        self._done: dict[int, Completion] = {}
        self._abandoned: set[int] = set()
        self._unwanted: set[int] = set()
        self._orphans: list[Completion] = []

    def is_awaited(self, request_id: int) -> bool:
        """Whether a caller still waits for this request's answer."""
        return request_id not in self._abandoned and request_id not in self._unwanted

    def keep(self, completion: Completion) -> None:
        request_id = completion.request_id
        if request_id in self._unwanted:
            self._unwanted.discard(request_id)
            if not completion.is_ok:
                logger.debug("engine answered request %d with %s", request_id, completion.status)
        elif request_id in self._abandoned:
            self._abandoned.discard(request_id)
            self._orphans.append(completion)
        else:
            self._done[request_id] = completion

    def take(self, request_id: int) -> Completion | None:
        return self._done.pop(request_id, None)

    def ignore(self, request_id: int) -> None:
        """Nobody will wait for this answer: drop it when it arrives."""
        self._unwanted.add(request_id)

    def abandon(self, request_id: int) -> None:
        """The waiter gave up: the answer (read already, or when it comes) is an orphan."""
        done = self._done.pop(request_id, None)
        if done is not None:
            self._orphans.append(done)
        else:
            self._abandoned.add(request_id)

    def take_orphans(self) -> list[Completion]:
        orphans, self._orphans = self._orphans, []
        return orphans
