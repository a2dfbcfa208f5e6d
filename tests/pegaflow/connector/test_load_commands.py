"""pegaflow/connector/load_commands.py: a planned load's LOADs, one of every layer or one per KV
cache group with layers here (a Mamba state first and without the lease, the largest group
last, ending the lease), each fenced by its group's first event; a load never sent gives its
lease back.  The engine client and the layers are stand-ins here."""

from __future__ import annotations

import pytest

from pegaflow.connector.load_commands import lease_of, release_lease, submit_loads
from pegaflow.connector.metadata import GroupBlocks, LoadSpec
from pegaflow.platform.errors import EngineGoneError
from pegaflow.platform.wire import NO_EVENT

pytestmark = pytest.mark.vllm

NAMESPACE, SLOT = 5, 1


class FakeClient:
    def __init__(self, fail: Exception | None = None):
        self.loads, self.released, self.fail = [], [], fail

    def submit_load(self, namespace, block_ids, hashes, **kwargs) -> int:
        self.loads.append((namespace, list(block_ids), len(hashes), kwargs))
        return 100 + len(self.loads)

    def release_nowait(self, lease: int) -> None:
        if self.fail:
            raise self.fail
        self.released.append(lease)


class FakeLayers:
    """Group 0 on layers 0-1, group 1 on layer 2, group 2 (a drafter's) on none here."""

    def load_event_base(self, slot: int) -> int:
        return 10 * slot

    def layers_of(self, group: int) -> list[int]:
        return {0: [0, 1], 1: [2], 2: []}[group]

    def first_layer_of(self, group: int) -> int:
        return self.layers_of(group)[0]


def _spec(groups=(), lease_ids=(7, 8)) -> LoadSpec:
    return LoadSpec("r", (1, 2, 3), (b"a", b"b", b"c"), lease_ids, True, groups)


def test_submit_loads_one_load_of_every_layer_under_the_ranks_lease():
    client = FakeClient()
    sent = submit_loads(client, NAMESPACE, 1, _spec(), FakeLayers(), SLOT, has_events=True)
    assert [tuple(s) for s in sent] == [(101, None)]
    assert client.loads == [(NAMESPACE, [1, 2, 3], 3, dict(lease_id=8, event_index=10, after_client=True))]
    # Unfenced, and a rank past the lookup's leases: no event, no lease.
    submit_loads(client, NAMESPACE, 2, _spec(), FakeLayers(), None, has_events=False)
    assert client.loads[1][3] == dict(lease_id=0, event_index=NO_EVENT, after_client=False)


def test_submit_loads_one_per_group_state_first_largest_last_ending_the_lease():
    groups = (GroupBlocks(0, (1, 2, 3), (b"a", b"b", b"c")), GroupBlocks(1, (4,), (b"c",)),
              GroupBlocks(2, (5,), (b"c",)), GroupBlocks(1, (6,), (b"s",), is_state=True))
    client = FakeClient()
    sent = submit_loads(client, NAMESPACE, 0, _spec(groups), FakeLayers(), SLOT, has_events=False)
    assert [s.group for s in sent] == [1, 1, 0]  # the state, the window, the full group; none of 2
    assert [(kw["lease_id"], kw["ends_lease"], kw["event_index"]) for *_, kw in client.loads] == [
        (0, False, 12), (7, False, 12), (7, True, 10)]


def test_release_lease_of_a_load_never_sent_gives_it_back_or_says_why_not():
    client = FakeClient()
    assert release_lease(client, _spec(), 0) is None and client.released == [7]
    assert release_lease(client, _spec(lease_ids=()), 0) is None and client.released == [7]  # none held
    gone = EngineGoneError("the engine went away")
    assert release_lease(FakeClient(fail=gone), _spec(), 1) is gone
    assert lease_of(_spec(), 1) == 8 and lease_of(_spec(), 2) == 0
