"""The scheduler side's lookups under compute once (``pegaflow/connector/lookups.py``), two
vLLM schedulers of different instances on one real engine (host backend): a request's miss
claims its blocks, the other instance's lookup of them is deferred (vLLM asks again each
step), and the claim is given back when the request is aborted or preempted, so the other
vLLM computes instead of waiting for blocks that will not come."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from pegaflow.connector.config import ConnectorConfig
from pegaflow.connector.scheduler import SchedulerSide
from pegaflow.stats.engine_stats import read_stats

BLOCK = 16
NAMESPACE = 0xC0
ASK_DEADLINE_S = 30.0  # how long a test asks again for an answer it is owed (generous)


def _step_output(new_ids=(), preempted=()):
    """A SchedulerOutput of the fields SchedulerSide reads: new and preempted requests, no tokens."""
    return SimpleNamespace(preempted_req_ids=set(preempted), num_scheduled_tokens={},
                           scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=([],), num_computed_tokens=0)
                                               for r in new_ids],
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                                                 num_computed_tokens=[]))


def _scheduler(engine_name: str, instance: int, **options) -> SchedulerSide:
    # One block a second: a claim lives MAX_CLAIM_S, far beyond every step here.
    config = ConnectorConfig(engine_name=engine_name, prefill_tokens_per_s=16, **options)
    return SchedulerSide(config, namespaces=[NAMESPACE], block_size=BLOCK, instance=instance)


def _request(req_id: str, num_blocks: int = 4) -> SimpleNamespace:
    hashes = [bytes([i + 1]) * 32 for i in range(num_blocks)]
    return SimpleNamespace(request_id=req_id, num_tokens=num_blocks * BLOCK + 3, num_computed_tokens=0,
                           block_hashes=hashes)


def _answer(scheduler: SchedulerSide, request) -> int:
    """Ask as vLLM does, step after step, until the lookup's answer is a number."""
    deadline = time.monotonic() + ASK_DEADLINE_S
    while (hit := scheduler.get_num_new_matched_tokens(request, 0)[0]) is None:
        assert time.monotonic() < deadline, "the lookup was never answered"
        time.sleep(0.01)
    return hit


def _claimed_and_waiting(engine):
    """Scheduler A's request missed and claimed its 4 blocks; B's lookup of them is deferred."""
    first, second = _scheduler(engine.name, 1), _scheduler(engine.name, 2)
    assert _answer(first, _request("a")) == 0
    assert read_stats(engine.name)["claims"] == 1
    waiter = _request("b")
    for _ in range(5):  # steps go by: vLLM is told to ask again each time
        assert second.get_num_new_matched_tokens(waiter, 0) == (None, False)
        time.sleep(0.01)
    return first, second, waiter


def _wait_stats(engine_name: str, predicate) -> dict:
    deadline = time.monotonic() + ASK_DEADLINE_S
    while not predicate(stats := read_stats(engine_name)):
        assert time.monotonic() < deadline, f"stats never satisfied the condition: {stats}"
        time.sleep(0.01)
    return stats


def test_lookups_claim_of_an_aborted_request_is_released_and_the_waiter_computes(engine):
    first, second, waiter = _claimed_and_waiting(engine)
    try:
        # vLLM aborts A's request before its prefill: the claim is released, and B's lookup
        # is answered with a miss (its vLLM computes the prefix) instead of at the deadline.
        first.request_finished(_request("a"), [])
        assert _answer(second, waiter) == 0
        stats = _wait_stats(engine.name, lambda s: s["claims_dropped"] == 1)
        assert stats["claim_timeouts"] == 0 and stats["claim_wait_blocks"] == 0
    finally:
        first.shutdown()
        second.shutdown()


def test_lookups_claim_of_a_preempted_request_is_released_and_the_waiter_computes(engine):
    first, second, waiter = _claimed_and_waiting(engine)
    try:
        # A's request was scheduled, then preempted before its blocks were saved (vLLM
        # recomputes it later, after a new lookup): its claim goes with the preemption.
        first.build_connector_meta(_step_output(new_ids=["a"]))
        first.build_connector_meta(_step_output(preempted=["a"]))
        assert _answer(second, waiter) == 0
        stats = _wait_stats(engine.name, lambda s: s["claims_dropped"] == 1)
        assert stats["claim_timeouts"] == 0
    finally:
        first.shutdown()
        second.shutdown()


def test_lookups_without_compute_once_claim_nothing_and_never_wait(engine):
    first = _scheduler(engine.name, 1, compute_once=False)
    second = _scheduler(engine.name, 2, compute_once=False)
    try:
        assert _answer(first, _request("a")) == 0
        assert second.get_num_new_matched_tokens(_request("b"), 0) == (0, False)
        assert read_stats(engine.name)["claims"] == 0
    finally:
        first.shutdown()
        second.shutdown()


def test_lookups_claiming_lookup_may_stay_out_past_lookup_timeout_ms():
    # A lookup that may wait for another vLLM's prefill is a miss only after that wait too;
    # one of a vLLM that saves nothing claims nothing, and keeps the usual deadline.
    config = ConnectorConfig(lookup_timeout_ms=500, compute_once_wait_ms=3000)
    assert config.is_claiming and config.lookup_deadline_ms == 3500
    consumer = ConnectorConfig.from_sources({"lookup_timeout_ms": 500}, environ={}, kv_role="kv_consumer")
    assert not consumer.is_claiming and consumer.lookup_deadline_ms == 500


class _RefusingEngine:
    """An engine client whose LOOKUPs are all answered at once: WAIT_REFUSED (the engine holds
    too many waiting LOOKUPs) with a READY prefix of ``num_ready`` blocks, leased."""

    def __init__(self, num_ready: int, status):
        self.num_ready, self.status, self.released, self.num_asked = num_ready, status, [], 0

    def submit_lookup(self, namespace: int, records, wait_ms=None, prefill=None) -> int:
        self.num_asked += 1
        return self.num_asked

    def wait(self, command_id: int, timeout_s: float):
        from pegaflow.platform.protocol import Completion
        from pegaflow.platform.wire import Opcode
        return Completion(command_id, Opcode.LOOKUP, self.status, 4, self.num_ready, 500 + command_id, 0)

    def take_orphans(self):
        return []

    def release_nowait(self, lease_id: int) -> None:
        self.released.append(lease_id)


def _lookups_of(engine):
    from pegaflow.connector.prefix_lookups import Lookups
    from pegaflow.connector.stats import PegaKVConnectorStats
    link = SimpleNamespace(client=lambda: engine, fail=lambda exc: pytest.fail(f"link failed: {exc}"))
    lookups = Lookups(ConnectorConfig.from_sources({}), [NAMESPACE], BLOCK, link, PegaKVConnectorStats())
    return lookups


def _state():
    return SimpleNamespace(request=SimpleNamespace(request_id="r"), lookup=None, num_hit_tokens=0, lease_ids=(),
                           is_from_disk=False, claimed={})


def test_prefix_lookups_wait_refused_uses_the_ready_prefix_counts_and_logs_rate_limited(caplog):
    from pegaflow.connector import prefix_lookups
    from pegaflow.platform.wire import Status
    # 1. Every LOOKUP is answered WAIT_REFUSED with 2 of its 4 blocks READY.
    engine = _RefusingEngine(2, Status.WAIT_REFUSED)
    lookups = _lookups_of(engine)
    caplog.set_level("DEBUG", logger=prefix_lookups.__name__)
    for i in range(prefix_lookups.REFUSED_LOG_EVERY + 1):
        state = _state()
        lookups.start(state, _request(f"r{i}"), 0)
        # 2. The answer is taken on the first ask (nothing waits on), its prefix used as an
        #    OK answer's, its lease kept for the load; the rest is vLLM's to compute.
        assert lookups.finish(state) and state.lookup is None
        assert state.num_hit_tokens == 2 * BLOCK and state.lease_ids == (engine.num_asked + 500,)
    assert engine.released == []
    # 3. Counted, each one; a WARNING for the first and the 101st, the others at DEBUG.
    assert lookups.stats.data["lookup_waits_refused"] == prefix_lookups.REFUSED_LOG_EVERY + 1
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and "without waiting" in r.getMessage()]
    assert len(warnings) == 2


def test_prefix_lookups_ok_answer_is_not_counted_as_refused():
    from pegaflow.platform.wire import Status
    engine = _RefusingEngine(2, Status.OK)
    lookups, state = _lookups_of(engine), _state()
    lookups.start(state, _request("r"), 0)
    assert lookups.finish(state) and state.num_hit_tokens == 2 * BLOCK
    assert lookups.stats.data["lookup_waits_refused"] == 0
