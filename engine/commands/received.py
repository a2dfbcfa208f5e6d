"""A command as the engine received it, and the rule that answers it exactly once.

The dispatcher decodes a record into a typed command (``pegaflow.platform.protocol``) and
a ``Received``: whose it is, its command id, when it came.  A handler returns its answer
(the command's answer type), which the dispatcher sends; or it returns ``LATER``, having
handed the ``Received`` to the one place that answers it when its work ends: the copies in
flight (``transfers.py``), a LOAD parked on disk reads (``load_waits.py``), a LOOKUP
waiting for saves (``lookup_waits.py``) or for the remote store (``remote/store_lookups.py``),
or a DETACH waiting for its client's copies (``ClientState.pending_detach``).  That place
gives it to ``Dispatcher.answer`` and lets go of it in the same step, so no command is
answered twice and none is forgotten.
"""

from __future__ import annotations

from typing import NamedTuple


class Received(NamedTuple):
    client: object       # engine.clients.ClientState
    command_id: int      # the client's count of its commands
    opcode: int          # as sent (a number no opcode has is answered BAD_OPCODE)
    num_items: int       # as sent: echoed in the answer
    received_at: float   # time.perf_counter() at receipt (0.0: not timed)


class _Later:
    __slots__ = ()

    def __repr__(self) -> str:
        return "LATER"


LATER = _Later()  # a handler's return when the place it handed the command to answers it


def untimed(received: Received) -> Received:
    """``received`` answered outside its command's own work (a stop, a deadline, a bug):
    no items echoed, and kept out of the latency histograms."""
    return received._replace(num_items=0, received_at=0.0)
