"""The proxy against fake prefill and decode servers (fakes.py): routing, streaming, a
failing prefill."""

from __future__ import annotations

import asyncio

import pytest

from tests.pegaflow.proxy.fakes import STREAM_CHUNKS, FakeServer, serve, url, with_proxy


def test_proxy_sends_prefill_then_decode_round_robin():
    async def scenario():
        log = []
        fakes = [FakeServer("p0", log), FakeServer("p1", log), FakeServer("d0", log), FakeServer("d1", log)]
        servers = await serve(*fakes)

        async def body(client, proxy):
            answers = []
            for i in range(4):
                answer = await client.post("/v1/completions", json={"prompt": [1, 2, i], "max_tokens": 9},
                                           headers={"X-Request-Id": f"r{i}"})
                assert answer.status == 200
                answers.append(await answer.json())
            return answers

        try:
            answers = await with_proxy([url(s) for s in servers[:2]], [url(s) for s in servers[2:]], body)
        finally:
            for server in servers:
                await server.close()
        return log, answers

    log, answers = asyncio.run(scenario())
    # 1. Each request went to a prefill server (one token, no stream), then to a decode
    #    server (as sent), each kind in turn.
    assert [(name, body["prompt"][2]) for name, _, body, _ in log] == [
        ("p0", 0), ("d0", 0), ("p1", 1), ("d1", 1), ("p0", 2), ("d0", 2), ("p1", 3), ("d1", 3)]
    for name, _, body, request_id in log:
        assert body["max_tokens"] == (1 if name.startswith("p") else 9)
        assert body["stream"] is False if name.startswith("p") else "stream" not in body
        assert request_id is not None
    # 2. The caller got the decode server's answer.
    assert [a["server"] for a in answers] == ["d0", "d1", "d0", "d1"]


def test_proxy_streams_decode_answer_through_byte_for_byte():
    async def scenario():
        log, last = [], asyncio.Event()
        servers = await serve(FakeServer("p", log), FakeServer("d", log, hold_last=last))

        async def body(client, proxy):
            answer = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5,
                "stream": True, "stream_options": {"include_usage": True}})
            assert answer.status == 200 and answer.headers["Content-Type"].startswith("text/event-stream")
            # The first chunks arrive while the decode server still holds its last one: the
            # proxy passes the stream through, it does not buffer the whole answer.
            first = [await asyncio.wait_for(answer.content.readuntil(b"\n\n"), 30)
                     for _ in STREAM_CHUNKS[:-1]]
            last.set()
            return b"".join(first) + await answer.read()

        try:
            data = await with_proxy([url(servers[0])], [url(servers[1])], body)
        finally:
            for server in servers:
                await server.close()
        return log, data

    log, data = asyncio.run(scenario())
    assert data == b"".join(STREAM_CHUNKS)
    (_, _, prefill, _), (_, _, decode, _) = log
    assert prefill["max_completion_tokens"] == 1 and prefill["stream"] is False
    assert "stream_options" not in prefill
    assert decode["stream"] is True and decode["max_completion_tokens"] == 5


@pytest.mark.parametrize("failure", ["error_status", "refused", "timeout"])
def test_proxy_falls_back_to_decode_when_prefill_fails(failure):
    async def scenario():
        log = []
        servers = await serve(FakeServer("p", log, status=500, mode="hang" if failure == "timeout" else None),
                              FakeServer("d", log))
        prefill_url = url(servers[0])
        if failure == "refused":
            await servers[0].close()  # nothing listens there any more

        async def body(client, proxy):
            answer = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
            metrics = await (await client.get("/metrics")).text()
            health = await client.get("/health")
            return answer.status, await answer.json(), metrics, health.status, await health.json()

        try:
            result = await with_proxy([prefill_url], [url(servers[1])], body, prefill_timeout_s=0.3)
        finally:
            for server in servers:
                await server.close()
        return log, result

    log, (status, answer, metrics, health_status, health) = asyncio.run(scenario())
    # The decode server answered (it computed the prompt itself); the failure is counted and
    # the proxy is not healthy without a prefill server.
    assert status == 200 and answer["server"] == "d"
    requests = [entry for entry in log if len(entry) == 4]  # (not a hung prefill's "caller left")
    assert requests[-1][0] == "d" and requests[-1][2]["max_tokens"] == 3
    assert "pegaflow_proxy_prefill_failures_total 1.0" in metrics
    assert health_status == 503 and not health["healthy"]
    assert [s["healthy"] for s in health["servers"]] == [False, True]


def test_proxy_answers_bad_body_400_and_dead_decode_502():
    async def scenario():
        log = []
        servers = await serve(FakeServer("p", log), FakeServer("d", log))
        decode_url = url(servers[1])
        await servers[1].close()

        async def body(client, proxy):
            not_json = await client.post("/v1/completions", data=b"{not json",
                                         headers={"Content-Type": "application/json"})
            not_object = await client.post("/v1/completions", json=[1, 2])
            no_decode = await client.post("/v1/completions", json={"prompt": "x"})
            return (not_json.status, not_object.status, no_decode.status, await no_decode.json(),
                    await (await client.get("/metrics")).text())

        try:
            return await with_proxy([url(servers[0])], [decode_url], body)
        finally:
            await servers[0].close()

    bad, not_object, no_decode, error, metrics = asyncio.run(scenario())
    assert (bad, not_object, no_decode) == (400, 400, 502)
    assert "decode server" in error["error"]["message"]
    assert 'pegaflow_proxy_refused_total{status="400"} 2.0' in metrics
    assert "pegaflow_proxy_decode_failures_total 1.0" in metrics
