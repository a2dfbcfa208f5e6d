"""An answer as a client reads it (``pegaflow/client/completion.py``): a COMPLETION record's
status typed, its values by name, and which statuses ``checked`` lets through."""

from __future__ import annotations

import numpy as np
import pytest

from pegaflow.client.completion import checked, completion_of
from pegaflow.platform.errors import CommandError
from pegaflow.platform.wire import COMPLETION, Opcode, Status


def _record(status: int, value: int = 0, value2: int = 0):
    record = np.zeros(1, dtype=COMPLETION)[0]
    record["command_id"], record["opcode"], record["status"] = 9, int(Opcode.LOOKUP), status
    record["value"], record["value2"] = value, value2
    return record


def test_completion_wait_refused_round_trips_typed_with_its_values():
    # A LOOKUP answered at once past the engine's bounds: WAIT_REFUSED on the wire, read back
    # as that status (not a bare number), its values those of an OK answer.
    done = completion_of(_record(int(Status.WAIT_REFUSED), value=3, value2=41))
    assert done.status is Status.WAIT_REFUSED and done.is_ok
    assert (done.result.num_hit_blocks, done.result.lease_id) == (3, 41)
    assert checked(Opcode.LOOKUP, done) is done


@pytest.mark.parametrize("status", [s for s in Status if s not in (Status.OK, Status.WAIT_REFUSED)])
def test_completion_other_statuses_are_errors(status):
    done = completion_of(_record(int(status)))
    assert not done.is_ok
    with pytest.raises(CommandError):
        checked(Opcode.LOOKUP, done)


def test_completion_status_this_client_does_not_know_stays_a_number():
    done = completion_of(_record(200))
    assert done.status == 200 and not isinstance(done.status, Status) and not done.is_ok
