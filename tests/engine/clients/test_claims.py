"""engine/clients/claims.py: a slot claim's pid must be a live process other than the engine,
init or the idle task; an ATTACH must name the claimant, which maps the slot's ring by the
kernel's account; a slot state word is read as a person reads it, whatever its value."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.clients.claims import attach_problem, claim_problem, state_name
from pegaflow.platform import shm
from pegaflow.platform.shm import MAX_PID
from pegaflow.platform.wire import SlotState


@pytest.fixture
def ring():
    """A segment this process maps, unlinked after the test."""
    name = shm.ipc_name(f"t{os.getpid()}_claims", "ring.0")
    segment = shm.create_segment(name, 4096)
    yield name
    segment.close()
    shm.unlink_segment(name)


@pytest.mark.parametrize("pid,why", [
    (0, "is no client's"), (1, "is no client's"), (MAX_PID + 1, "is no client's"), (-5, "is no client's"),
    (os.getpid(), "is the engine's own"),
])
def test_claim_problem_pid_outside_the_clients_range_or_the_engines_own_is_refused(pid, why):
    assert why in claim_problem(pid)


def test_claim_problem_live_process_accepted_and_a_reaped_one_refused():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert claim_problem(child.pid) is None
    finally:
        child.communicate(b"")
    assert "is not a running process" in claim_problem(child.pid)
    # The engine's own pid is a client's only where the caller says so (a test's engine in-process).
    assert claim_problem(os.getpid(), own_pid_is_client=True) is None


def test_attach_problem_names_the_claimant_which_maps_the_ring(ring):
    me = os.getpid()
    # 1. The claimant, mapping the ring: accepted.
    assert attach_problem(me, me, ring, own_pid_is_client=True) is None
    # 2. Another pid than the claimant's: refused before anything else is read.
    assert "is not the claimant's" in attach_problem(me, me + 1, ring, own_pid_is_client=True)
    # 3. The claimant, not mapping that ring (the kernel says so): refused.
    other = shm.ipc_name(f"t{me}_claims", "ring.1")
    assert f"maps {other}" in attach_problem(me, me, other, own_pid_is_client=True)
    # 4. The engine's own pid, unless the caller says it is a client's.
    assert "is the engine's own" in attach_problem(me, me, ring)


def test_state_name_of_any_word_a_client_wrote():
    assert state_name(int(SlotState.FREE)) == "FREE"
    assert state_name(12345) == "12345 (no state)"
