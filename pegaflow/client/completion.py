"""A command's answer as a client reads it: a ``Completion``, its values by name (the
opcode's answer type in ``pegaflow.platform.protocol``), and CommandError for an answer
that is not OK.  WAIT_REFUSED is OK's twin: a LOOKUP answered at once, its values as OK's
(the READY prefix, leased), the wait it asked for refused by the engine's bounds."""

from __future__ import annotations

import functools
from typing import NamedTuple

from pegaflow.platform.errors import CommandError
from pegaflow.platform.protocol import ANSWERS, LookupAnswer
from pegaflow.platform.wire import Opcode, Status


class Completion(NamedTuple):
    """One answer (a named tuple: built on every round trip, and a frozen dataclass costs
    about a microsecond to build)."""

    command_id: int  # the client's count of its commands, echoed by the engine
    opcode: Opcode | int
    status: Status | int
    num_items: int
    value: int
    value2: int
    value3: int

    @property
    def is_ok(self) -> bool:
        """OK, or WAIT_REFUSED: its values hold (a LOOKUP's lease to use or give back)."""
        return self.status == _OK or self.status == _WAIT_REFUSED

    @property
    def result(self):
        """The answer's values by name (its opcode's answer type): e.g. a LOOKUP's
        ``num_hit_blocks`` and ``lease_id``.  An opcode without named values: ()."""
        kind = ANSWERS.get(self.opcode)
        return kind(*(self.value, self.value2, self.value3)[:len(kind._fields)]) if kind else ()


LookupResult = LookupAnswer


_OK, _WAIT_REFUSED = Status.OK, Status.WAIT_REFUSED  # read once: the hot loop compares against a plain name
_opcode_of = {int(m): m for m in Opcode}.get
_status_of = {int(m): m for m in Status}.get
_new_completion = functools.partial(tuple.__new__, Completion)


def completion_of(record) -> Completion:
    """A COMPLETION record (in field order) as a Completion; an opcode or status this
    client does not know stays a number."""
    _, command_id, opcode, status, num_items, value, value2, value3 = record
    return _new_completion((command_id, _opcode_of(opcode, opcode), _status_of(status, status),
                            num_items, value, value2, value3))


def checked(opcode: Opcode | int, completion: Completion) -> Completion:
    """``completion`` if OK (or WAIT_REFUSED); else CommandError."""
    if completion.status != _OK and completion.status != _WAIT_REFUSED:
        name = getattr(completion.status, "name", completion.status)
        raise CommandError(completion.status, f"{getattr(opcode, 'name', opcode)} failed: {name}")
    return completion
