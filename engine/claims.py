"""What a client writes where the engine reads it, checked there: the pid of its slot claim,
the pid its ATTACH names, the state word of its slot.

A client maps the control segment and its ring read-write, so every such value may be
anything its process wrote (by mistake or not).  The engine trusts none of them: a pid is
a client's only if it is a real process other than the engine, init or the idle task, and
the kernel says that process maps the segment it must have mapped by then (the control
segment at its claim, its ring at ATTACH); an ATTACH names the claimant itself.  A value
that fails closes that one client (``ClientTable.close``), with the reason logged and
counted in ``clients_refused``; the engine serves on.
"""

from __future__ import annotations

import os

from pegaflow import shm
from pegaflow.shm import MAX_PID
from pegaflow.wire import SlotState

_SLOT_STATES = frozenset(int(s) for s in SlotState)


def pid_problem(pid: int, segment_name: str, own_pid_is_client: bool = False) -> str | None:
    """Why ``pid`` cannot be a client's own process that maps ``segment_name`` (None: it can).
    ``own_pid_is_client``: the engine runs in its clients' process (tests only)."""
    if not 1 < pid <= MAX_PID:
        return f"pid {pid} is no client's (a pid lies in [2, {MAX_PID}])"
    if pid == os.getpid() and not own_pid_is_client:
        return f"pid {pid} is the engine's own"
    if not shm.maps_segment(pid, segment_name):
        return f"pid {pid} is not a process of this user that maps {segment_name}"
    return None


def claim_problem(pid: int, control_name: str, own_pid_is_client: bool = False) -> str | None:
    """Why a slot claim naming ``pid`` is refused (None: accepted): a claimant has mapped
    the control segment before it claims."""
    return pid_problem(pid, control_name, own_pid_is_client)


def attach_problem(pid: int, claimant_pid: int, ring_name: str, own_pid_is_client: bool = False) -> str | None:
    """Why an ATTACH naming ``pid`` is refused (None: accepted): it must name the process
    that claimed the slot, which maps the slot's ring by then."""
    if pid != claimant_pid:
        return f"pid {pid} is not the claimant's (pid {claimant_pid})"
    return pid_problem(pid, ring_name, own_pid_is_client)


def state_name(state: int) -> str:
    """A slot state word as a person reads it (any value a client may have written)."""
    return SlotState(state).name if state in _SLOT_STATES else f"{state} (no state)"
