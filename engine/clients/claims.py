"""What a client writes where the engine reads it, checked there: the pid of its slot claim,
the pid its ATTACH names, the state word of its slot.

A client maps the control segment and its ring read-write, so every such value may be
anything its process wrote (by mistake or not).  The engine trusts none of them: a claim's
pid must be a live process other than the engine, init or the idle task; an ATTACH must
name the claimant itself, and the kernel must say that process maps the slot's ring.  A value
that fails closes that one client (``ClientTable.close``), with the reason logged and
counted in ``clients_refused``; the engine serves on.
"""

from __future__ import annotations

import os

from pegaflow.platform import shm
from pegaflow.platform.shm import MAX_PID, is_pid_alive
from pegaflow.platform.wire import SlotState

_SLOT_STATES = frozenset(int(s) for s in SlotState)


def _pid_range_problem(pid: int, own_pid_is_client: bool) -> str | None:
    if not 1 < pid <= MAX_PID:
        return f"pid {pid} is no client's (a pid lies in [2, {MAX_PID}])"
    if pid == os.getpid() and not own_pid_is_client:
        return f"pid {pid} is the engine's own"
    return None


def claim_problem(pid: int, own_pid_is_client: bool = False) -> str | None:
    """Why a slot claim naming ``pid`` is refused (None: accepted): it must be a live
    process other than the engine, init or the idle task.  (Cheap: a claim is accepted on
    the attach's path.  Whether that process is the claimant is ATTACH's check; one that
    never ATTACHes loses the slot at the attach timeout.)"""
    why = _pid_range_problem(pid, own_pid_is_client)
    if why is None and not is_pid_alive(pid):
        why = f"pid {pid} is not a running process"
    return why


def attach_problem(pid: int, claimant_pid: int, ring_name: str, own_pid_is_client: bool = False) -> str | None:
    """Why an ATTACH naming ``pid`` is refused (None: accepted): it must name the process
    that claimed the slot, which maps the slot's ring by then (the kernel says so)."""
    if pid != claimant_pid:
        return f"pid {pid} is not the claimant's (pid {claimant_pid})"
    why = _pid_range_problem(pid, own_pid_is_client)
    if why is None and not shm.maps_segment(pid, ring_name):
        why = f"pid {pid} is not a process of this user that maps {ring_name}"
    return why


def state_name(state: int) -> str:
    """A slot state word as a person reads it (any value a client may have written)."""
    return SlotState(state).name if state in _SLOT_STATES else f"{state} (no state)"
