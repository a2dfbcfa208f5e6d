"""Request bodies the proxy must answer itself, each with an OpenAI-style JSON error: too
slow (408), too long (413), not a JSON object it can read (400); and a long body vLLM would
take, which it must pass on."""

from __future__ import annotations

import asyncio
import json

import pytest

from pegaflow.proxy.request_body import RequestRefused, parse_json_object
from tests.pegaflow.proxy.fakes import FakeServer, serve, url, wait_until, with_proxy

DEEP = b"[" * 100_000 + b"]" * 100_000
LONG_NUMBER = b'{"prompt": "x", "max_tokens": ' + b"1" * 5000 + b"}"


async def _against_proxy(scenario, **limits):
    """``scenario(client, proxy)`` against a proxy in front of well-behaved servers; the
    servers' log after it."""
    log = []
    servers = await serve(FakeServer("p", log), FakeServer("d", log))
    try:
        return await with_proxy([url(servers[0])], [url(servers[1])], scenario, **limits), log
    finally:
        for server in servers:
            await server.close()


@pytest.mark.parametrize("data,content_type,why", [
    (b'{"prompt": "x"}', "application/json; charset=no-such-charset", "unknown charset"),
    (b'{"prompt": "\xff\xfe"}', "application/json", "not valid utf-8"),
    (DEEP, "application/json", "nested too deep"),
    (LONG_NUMBER, "application/json", "the body is not JSON"),
    (b"{not json", "application/json", "the body is not JSON"),
    (b"[1, 2]", "application/json", "must be a JSON object"),
])
def test_proxy_unreadable_body_is_answered_400_json(data, content_type, why):
    async def scenario(client, proxy):
        answer = await client.post("/v1/completions", data=data, headers={"Content-Type": content_type})
        return answer.status, answer.content_type, await answer.json()

    (status, content_type, error), log = asyncio.run(_against_proxy(scenario))
    assert (status, content_type) == (400, "application/json")
    assert why in error["error"]["message"] and error["error"]["code"] == 400
    assert log == []  # nothing went on to a server


def test_proxy_body_past_max_is_answered_413_json_declared_or_chunked():
    async def scenario(client, proxy):
        big = json.dumps({"prompt": "x" * (2 << 20)}).encode()

        async def chunked():  # (no Content-Length: the proxy counts as it reads)
            for i in range(0, len(big), 1 << 16):
                yield big[i:i + (1 << 16)]

        answers = [await client.post("/v1/completions", data=big, headers={"Content-Type": "application/json"}),
                   await client.post("/v1/completions", data=chunked(), headers={"Content-Type": "application/json"})]
        return [(a.status, (await a.json())["error"]["message"]) for a in answers]

    answers, log = asyncio.run(_against_proxy(scenario, max_body_bytes=1 << 20))
    for status, message in answers:
        assert status == 413 and "longer than 1.0 MiB" in message and "--max-body-size" in message
    assert log == []


def test_proxy_long_body_vllm_would_take_is_passed_on_as_sent():
    prompt = "word " * (4 << 20)  # a 20 MiB prompt: past aiohttp's default 1 MiB, within the proxy's default

    async def scenario(client, proxy):
        answer = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        return answer.status, await answer.json()

    (status, answer), log = asyncio.run(_against_proxy(scenario))
    assert status == 200 and answer["server"] == "d"
    assert [(name, body["prompt"] == prompt) for name, _, body, _ in log] == [("p", True), ("d", True)]


def test_proxy_body_slower_than_body_timeout_is_answered_408_json():
    async def scenario(client, proxy):
        reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n" + b'{"prompt": ')
        # The rest of the body never comes: the proxy answers by itself.
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
        rest = await asyncio.wait_for(reader.read(1000), 20)
        writer.close()
        return head, rest

    (head, rest), log = asyncio.run(_against_proxy(scenario, body_timeout_s=0.3))
    assert head.startswith(b"HTTP/1.1 408")
    assert b'"code": 408' in rest and b"did not arrive within 0.3 s" in rest
    assert log == []


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"])
def test_proxy_connection_without_request_head_is_closed_after_idle_timeout(sent):
    async def scenario(client, proxy):
        reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
        writer.write(sent)  # nothing, or a head that never ends
        data = await asyncio.wait_for(reader.read(1000), 20)  # b"": the proxy closed it
        writer.close()
        return data

    data, _ = asyncio.run(_against_proxy(scenario, idle_timeout_s=0.3))
    assert data == b""


def test_parse_json_object_takes_any_charset_python_knows():
    assert parse_json_object('{"prompt": "é"}'.encode("utf-16"), "utf-16") == {"prompt": "é"}
    with pytest.raises(RequestRefused) as refused:
        parse_json_object(b"{}", "no-such-charset")
    assert refused.value.status == 400


def test_proxy_bodies_past_budget_in_flight_are_answered_503_json_and_given_back():
    async def scenario(client, proxy):
        # 1. A body of 600 KiB is held (its prefill hangs) against a budget of 1 MiB.
        held = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "x" * (600 << 10)}))
        await wait_until(lambda: proxy.bodies.num_bytes > 600 << 10)
        # 2. A second one of 600 KiB would pass the budget: 503, and nothing of it is kept.
        refused = await client.post("/v1/completions", json={"prompt": "y" * (600 << 10)})
        refused = (refused.status, (await refused.json())["error"]["message"])
        num_held = proxy.bodies.num_bytes
        # 3. Once the first is done (its prefill timed out: decode answered), all is given back.
        done = (await held).status
        return refused, num_held, done, proxy.bodies.num_bytes

    async def run():
        log = []
        servers = await serve(FakeServer("p", log, mode="hang"), FakeServer("d", log))
        try:
            return await with_proxy([url(servers[0])], [url(servers[1])], scenario, prefill_timeout_s=1,
                                    max_body_bytes=1 << 20, max_body_bytes_in_flight=1 << 20)
        finally:
            for server in servers:
                await server.close()

    (status, message), num_held, done, num_left = asyncio.run(run())
    assert status == 503 and "--max-body-bytes-in-flight" in message
    assert (600 << 10) < num_held < (601 << 10) and done == 200 and num_left == 0
