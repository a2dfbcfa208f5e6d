"""pegaflow/proxy/routing.py: servers taken in turn, a failing one passed over and retried once
per retry interval, urls checked, and the prefill's body a copy asking for one token."""

from __future__ import annotations

import copy

import pytest

from pegaflow.platform.errors import ConfigError
from pegaflow.proxy.routing import RoundRobin, prefill_body


def test_round_robin_checks_urls_and_prefill_body_keeps_the_prompt():
    with pytest.raises(ConfigError, match="http://host:port"):
        RoundRobin(("localhost:8000",))
    with pytest.raises(ConfigError, match="at least one"):
        RoundRobin(())
    servers = RoundRobin(("http://a:1/", "http://b:2"))
    assert [servers.pick() for _ in range(3)] == ["http://a:1", "http://b:2", "http://a:1"]
    body = {"prompt": [5, 6], "max_tokens": 50, "temperature": 0.0, "n": 3, "min_tokens": 4,
            "logprobs": 2, "stream": True, "stream_options": {}}
    original = copy.deepcopy(body)
    assert prefill_body(body) == {"prompt": [5, 6], "max_tokens": 1, "temperature": 0.0, "n": 1,
                                  "stream": False}
    assert body == original  # the request itself, which goes on to the decode server, is left alone


def test_round_robin_passes_over_a_failing_server_and_retries_it_once_per_retry():
    servers = RoundRobin(("http://a:1", "http://b:2"), retry_s=10)
    for _ in range(3):
        servers.record("http://a:1", "TimeoutError")  # 3 in a row: failing
    assert [servers.pick(now=100.0) for _ in range(3)] == ["http://a:1", "http://b:2", "http://b:2"]
    assert servers.pick(now=109.9) == "http://b:2"  # a's retry (sent at 100) is not due yet
    assert servers.pick(now=110.0) == "http://a:1"  # ...now it is, once
    servers.record("http://b:2", "HTTP 500")
    servers.record("http://b:2", "HTTP 500")
    servers.record("http://b:2", "HTTP 500")
    assert servers.pick(now=111.0) is None  # every server failing, none due
    servers.record("http://a:1", None)  # a's retry succeeded
    assert servers.pick(now=111.0) == "http://a:1" and not servers.states()[0].is_failing
