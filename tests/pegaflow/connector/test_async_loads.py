"""pegaflow/connector/async_loads.py: asynchronous loads out, and what their answers mean."""

from types import SimpleNamespace

from pegaflow.connector.async_loads import AsyncLoads
from pegaflow.connector.metadata import GroupBlocks, LoadSpec


class Answers:
    """A client whose answers are set by command id (absent: not in yet)."""

    def __init__(self):
        self.answers = {}

    def try_take(self, command_id):
        return self.answers.pop(command_id, None)


def _ok(is_ok=True):
    return SimpleNamespace(is_ok=is_ok)


def _hybrid(req_id):
    parts = (GroupBlocks(0, (1, 2), (b"a" * 32, b"b" * 32)), GroupBlocks(1, (9,), (b"b" * 32,)))
    return LoadSpec(req_id, (1, 2, 9), (b"a" * 32, b"b" * 32), (0,), True, parts)


def test_async_loads_hybrid_load_is_answered_once_its_last_load_is_in():
    # 1. A hybrid load went out as two LOADs (commands 5 and 6).
    loads, client = AsyncLoads(), Answers()
    loads.sent([5, 6], _hybrid("h"), now=10.0)
    # 2. The first answer alone says nothing yet; the second completes the load.
    client.answers[5] = _ok()
    assert loads.collect(client, now=10.1, timeout_s=1.0) == ([], None)
    client.answers[6] = _ok()
    (answered,), expired = loads.collect(client, now=10.2, timeout_s=1.0)
    assert (answered.spec.req_id, answered.is_ok, expired) == ("h", True, None) and not loads


def test_async_loads_hybrid_load_with_one_failed_load_fails_whole_once():
    loads, client = AsyncLoads(), Answers()
    loads.sent([5, 6], _hybrid("h"), now=10.0)
    client.answers.update({5: _ok(False), 6: _ok()})
    answered, _ = loads.collect(client, now=10.1, timeout_s=1.0)
    assert [(a.spec.req_id, a.is_ok) for a in answered] == [("h", False)]


def test_async_loads_deadline_is_said_as_the_expired_load_and_kept_out():
    # A LOAD past its deadline: collect says which (the caller drops the connection and
    # then takes every load out as failed), once per vLLM request.
    loads, client = AsyncLoads(), Answers()
    plain = LoadSpec("p", (3,), (b"c" * 32,), (0,), True)
    loads.sent([7], plain, now=0.0)
    loads.sent([5, 6], _hybrid("h"), now=0.0)
    answered, expired = loads.collect(client, now=5.0, timeout_s=1.0)
    assert answered == [] and expired is plain
    assert sorted(spec.req_id for spec in loads.take_all()) == ["h", "p"] and not loads
