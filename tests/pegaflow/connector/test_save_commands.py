"""pegaflow/connector/save_commands.py: a step's SAVEs, one of every layer or one per KV cache
group with layers here, fenced by the group's first save event, a voter's blocks tagged by
step and request; a lost connection stops the rest; a step that wrote only some layers saves
nothing.  The engine client, the layers and the memory are stand-ins here."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pegaflow.connector.metadata import GroupBlocks, SaveSpec, save_tag
from pegaflow.connector.save_commands import LayersWritten, SaveCommands
from pegaflow.platform.errors import EngineGoneError
from pegaflow.platform.wire import NO_EVENT

pytestmark = pytest.mark.vllm

HAS_EVENTS = SimpleNamespace(has_events=True)


class FakeClient:
    def __init__(self, fail_after: int | None = None):
        self.saves, self.fail_after = [], fail_after

    def submit_save(self, namespace, ids, records, **kwargs) -> int:
        if self.fail_after is not None and len(self.saves) >= self.fail_after:
            raise EngineGoneError("the engine went away")
        self.saves.append((namespace, ids.tolist(), len(records), kwargs))
        return len(self.saves)


class FakeLayers:
    """Group 0 on layers 0-1, group 1 on layer 2, group 2 (a drafter's) on none here."""

    num_groups = 3
    save_layers = {"l0", "l1", "l2"}

    def layers_of(self, group: int) -> list[int]:
        return {0: [0, 1], 1: [2], 2: []}[group]

    def first_layer_of(self, group: int) -> int:
        return self.layers_of(group)[0]


def _hashes(n: int) -> tuple[bytes, ...]:
    return tuple(bytes([i]) * 32 for i in range(n))


def test_save_commands_one_save_of_every_layer_tagged_for_a_voter():
    saves = [SaveSpec("a", (1, 2), _hashes(2)), SaveSpec("b", (3,), _hashes(1))]
    client = FakeClient()
    sent = SaveCommands(9, is_voter=True).send(client, saves, FakeLayers(), HAS_EVENTS, step=4, one_event=False)
    assert sent.lost is None and [s.command_id for s in sent.saves] == [1]
    namespace, ids, num_records, kwargs = client.saves[0]
    assert (namespace, ids, num_records) == (9, [1, 2, 3], 3)
    assert kwargs == dict(event_index=0, one_event=False, tags=[save_tag(4, "a")] * 2 + [save_tag(4, "b")])
    # Not a voter, and no events (the host backend): untagged, unfenced.
    SaveCommands(9, is_voter=False).send(client, saves, FakeLayers(), SimpleNamespace(has_events=False), 4, True)
    assert client.saves[1][3] == dict(event_index=NO_EVENT, one_event=False)


def test_save_commands_one_save_per_group_with_layers_fenced_by_its_first_layer():
    saves = [SaveSpec("a", (1, 2, 3), _hashes(2), groups=(
        GroupBlocks(0, (1, 2), _hashes(2)), GroupBlocks(1, (3,), _hashes(1)), GroupBlocks(2, (4,), _hashes(1))))]
    client = FakeClient()
    sent = SaveCommands(9, is_voter=False).send(client, saves, FakeLayers(), HAS_EVENTS, step=1, one_event=False)
    assert [s.command_id for s in sent.saves] == [1, 2]  # none for the group without layers here
    assert [(ids, kw["group"], kw["event_index"]) for _, ids, _, kw in client.saves] == [([1, 2], 0, 0),
                                                                                          ([3], 1, 2)]


def test_save_commands_lost_connection_stops_the_rest():
    saves = [SaveSpec("a", (1, 2), _hashes(2), groups=(GroupBlocks(0, (1,), _hashes(1)),
                                                      GroupBlocks(1, (2,), _hashes(1))))]
    sent = SaveCommands(9, is_voter=False).send(FakeClient(fail_after=1), saves, FakeLayers(), HAS_EVENTS, 1, False)
    assert len(sent.saves) == 1 and isinstance(sent.lost, EngineGoneError)


def test_layers_written_only_some_of_the_layers_is_partial():
    memory, written = SimpleNamespace(has_events=False), LayersWritten()
    assert not written.is_partial(FakeLayers())  # none: a full CUDA graph replay wrote them all
    written.add("l0", FakeLayers(), memory)
    assert written.is_partial(FakeLayers())
    written.add("l1", FakeLayers(), memory)
    written.add("l2", FakeLayers(), memory)
    assert not written.is_partial(FakeLayers())
