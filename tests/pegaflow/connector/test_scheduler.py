"""SchedulerSide paths that need no engine: how long a lookup may hold vLLM's scheduler."""

from __future__ import annotations

import time
from types import SimpleNamespace

from pegaflow.connector.config import ConnectorConfig
from pegaflow.connector.scheduler import FIRST_WAIT_S, SchedulerSide
from pegaflow.errors import EngineTimeoutError


class SlowClient:
    """An engine that answers each rank's LOOKUP 1.5 ms after it is waited for; counts
    the time spent waiting."""

    ANSWER_S = 1.5e-3

    def __init__(self):
        self.waited_s, self.num_answered, self._ids = 0.0, 0, iter(range(1, 1000))

    def take_orphans(self):
        return []

    def submit_lookup(self, namespace, records):
        return next(self._ids)

    def wait(self, request_id, timeout_s):
        self.waited_s += min(timeout_s, self.ANSWER_S)
        time.sleep(min(timeout_s, self.ANSWER_S))
        if timeout_s < self.ANSWER_S:
            raise EngineTimeoutError("no answer yet")
        self.num_answered += 1
        return SimpleNamespace(is_ok=True, value=4, value2=0)


def test_scheduler_lookup_of_many_ranks_waits_once_not_once_per_rank():
    # 1. TP=8: one LOOKUP per rank, each answered 1.5 ms after it is waited for.
    scheduler = SchedulerSide(ConnectorConfig(lookup_timeout_ms=1000), namespaces=list(range(1, 9)),
                              block_size=16)
    client = SlowClient()
    scheduler.link._client = client
    request = SimpleNamespace(request_id="r", num_tokens=64, block_hashes=[b"h" * 32] * 4)
    # 2. vLLM is told to ask again (None) once one FIRST_WAIT_S is spent, not 8 of them.
    assert scheduler.get_num_new_matched_tokens(request, 0) == (None, False)
    assert client.num_answered < 8 and client.waited_s <= FIRST_WAIT_S + 1e-9
