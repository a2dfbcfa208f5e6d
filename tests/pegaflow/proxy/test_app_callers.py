"""The proxy against callers that hang up, or come too many at once (fakes.py)."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest

from tests.pegaflow.proxy.fakes import FakeServer, serve, url, wait_until, with_proxy


async def _hang_up(client, json: dict, after_s: float = 0.3) -> None:
    """A caller that sends a request and leaves before its answer."""
    with pytest.raises(asyncio.TimeoutError):
        await client.post("/v1/completions", json=json, timeout=aiohttp.ClientTimeout(total=after_s))


@pytest.mark.parametrize("hanging", ["prefill", "decode"])
def test_proxy_caller_hangup_closes_the_upstream_request(hanging):
    async def scenario():
        log = []
        fakes = [FakeServer("p", log, mode="hang" if hanging == "prefill" else None),
                 FakeServer("d", log, mode="hang" if hanging == "decode" else None)]
        servers = await serve(*fakes)

        async def body(client, proxy):
            await _hang_up(client, {"prompt": "x", "max_tokens": 3})
            # The hanging server sees its request closed (vLLM would abort it), long before
            # the proxy's own timeouts (30 s) would have ended it.
            await wait_until(lambda: (hanging[0], "caller left") in log, timeout_s=10)
            return [entry[0] for entry in log if len(entry) == 4], await (await client.get("/metrics")).text()

        try:
            return await with_proxy([url(servers[0])], [url(servers[1])], body)
        finally:
            for server in servers:
                await server.close()

    sent_to, metrics = asyncio.run(scenario())
    assert sent_to == (["p"] if hanging == "prefill" else ["p", "d"])  # no decode after a hang-up in prefill
    assert "pegaflow_proxy_caller_hangups_total 1.0" in metrics


@pytest.mark.parametrize("noticed_by", ["cancellation", "failed_write"])
def test_proxy_caller_hangup_mid_stream_logs_one_line_and_no_traceback(caplog, noticed_by):
    # The proxy notices a caller gone by its handler's cancellation, or, where a write to
    # the closing connection comes first, by that write's failure (served here without
    # handler cancellation, so it always comes first).
    async def scenario():
        log = []
        servers = await serve(FakeServer("p", log), FakeServer("d", log, mode="trickle"))

        async def body(client, proxy):
            answer = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
            assert answer.status == 200
            await answer.content.readuntil(b"\n\n")  # the stream has begun
            answer.close()  # ...and the caller leaves
            await wait_until(lambda: ("d", "caller left") in log, timeout_s=10)
            await asyncio.sleep(0.2)  # (anything the proxy would still log about it)

        try:
            await with_proxy([url(servers[0])], [url(servers[1])], body, server_overrides={
                "handler_cancellation": noticed_by == "cancellation"})
        finally:
            for server in servers:
                await server.close()

    with caplog.at_level(logging.INFO):
        asyncio.run(scenario())
    hangups = [r for r in caplog.records if "the caller left" in r.getMessage()]
    assert len(hangups) == 1 and hangups[0].levelno == logging.INFO
    assert [r.getMessage() for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR] == []


def test_proxy_requests_past_max_in_flight_are_answered_503_json():
    async def scenario():
        log = []
        servers = await serve(FakeServer("p", log, mode="hang"), FakeServer("d", log))

        async def body(client, proxy):
            # 1. Two requests in flight (their prefill hangs), the most this proxy serves.
            held = [asyncio.ensure_future(client.post("/v1/completions", json={"prompt": f"x{i}"}))
                    for i in range(2)]
            await wait_until(lambda: sum(1 for entry in log if entry[0] == "p") == 2)
            # 2. A third is refused at once, with an OpenAI-style error.
            refused = await client.post("/v1/completions", json={"prompt": "y"})
            refused = (refused.status, await refused.json())
            # 3. Once the two are done (their prefill timed out: decode answered), room again.
            done = [(await answer).status for answer in held]
            again = await client.post("/v1/completions", json={"prompt": "z"})
            return refused, done, again.status, await (await client.get("/metrics")).text()

        try:
            return await with_proxy([url(servers[0])], [url(servers[1])], body, max_in_flight=2,
                                    prefill_timeout_s=1)
        finally:
            for server in servers:
                await server.close()

    (status, error), done, again, metrics = asyncio.run(scenario())
    assert status == 503 and "--max-in-flight" in error["error"]["message"] and error["error"]["code"] == 503
    assert done == [200, 200] and again == 200
    assert 'pegaflow_proxy_refused_total{status="503"} 1.0' in metrics
