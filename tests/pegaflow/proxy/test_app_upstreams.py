"""The proxy against prefill and decode servers that misbehave: one that hangs while its
/health says 200, one whose answer never ends, several failures in a row (fakes.py)."""

from __future__ import annotations

import asyncio

from tests.pegaflow.proxy.fakes import FakeServer, serve, url, wait_until, with_proxy


def test_proxy_hung_prefill_times_out_to_decode_then_is_passed_over_and_unhealthy():
    async def scenario():
        log = []
        fakes = [FakeServer("p", log, mode="hang"), FakeServer("d", log)]
        servers = await serve(*fakes)

        async def body(client, proxy):
            # 1. Three requests: each prefill hangs past its timeout, and the decode server
            #    answers (it computes the prompt itself).
            answers = []
            for i in range(3):
                answer = await client.post("/v1/completions", json={"prompt": f"x{i}", "max_tokens": 3})
                answers.append((answer.status, await answer.json()))
            # 2. /health says the prefill server is failing, though its own /health says 200.
            health = await client.get("/health")
            health = (health.status, await health.json())
            # 3. The next request goes straight to decode: the failing prefill server is not
            #    due a retry yet, so it waits for no prefill timeout.
            fourth = await client.post("/v1/completions", json={"prompt": "y", "max_tokens": 3})
            return answers, health, fourth.status, await (await client.get("/metrics")).text()

        try:
            return log, await with_proxy([url(servers[0])], [url(servers[1])], body,
                                         prefill_timeout_s=0.3, prefill_retry_s=600)
        finally:
            for server in servers:
                await server.close()

    log, (answers, (health_status, health), fourth_status, metrics) = asyncio.run(scenario())
    assert [(status, answer["server"]) for status, answer in answers] == [(200, "d")] * 3
    assert health_status == 503 and not health["healthy"]
    prefill, decode = health["servers"]
    assert prefill["answers_health"] and not prefill["healthy"] and prefill["failures_in_row"] == 3
    assert "TimeoutError" in prefill["last_failure"] and decode["healthy"]
    assert fourth_status == 200
    assert [entry[0] for entry in log if len(entry) == 4].count("p") == 3  # the 4th never reached it
    assert "pegaflow_proxy_prefill_failures_total 3.0" in metrics
    assert "pegaflow_proxy_prefill_skipped_total 1.0" in metrics


def test_proxy_failing_prefill_is_retried_once_per_retry_and_recovers():
    async def scenario():
        log = []
        fakes = [FakeServer("p", log, status=500), FakeServer("d", log)]
        servers = await serve(*fakes)

        async def body(client, proxy):
            async def post():
                answer = await client.post("/v1/completions", json={"prompt": "x"})
                assert answer.status == 200

            for _ in range(5):  # 3 failures mark it failing; the next 2 pass it over
                await post()
            num_sent_failing = sum(1 for entry in log if entry[0] == "p")
            proxy.prefill.states()[0].last_sent -= 600  # time passes: its retry is due
            fakes[0].status = 200  # ...and it is well again
            await post()
            await post()
            health = await (await client.get("/health")).json()
            return num_sent_failing, sum(1 for entry in log if entry[0] == "p"), health

        try:
            return await with_proxy([url(servers[0])], [url(servers[1])], body, prefill_retry_s=600)
        finally:
            for server in servers:
                await server.close()

    num_sent_failing, num_sent, health = asyncio.run(scenario())
    assert num_sent_failing == 3
    assert num_sent == 5  # the retry succeeded: the next request went to it as usual
    assert health["healthy"] and health["servers"][0]["failures_in_row"] == 0


def test_proxy_endless_prefill_answer_is_not_read_whole():
    async def scenario():
        log = []
        fakes = [FakeServer("p", log, mode="endless"), FakeServer("d", log)]
        servers = await serve(*fakes)

        async def body(client, proxy):
            answer = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
            # The prefill server's writes stop: the proxy dropped the connection.
            await wait_until(lambda: ("p", "caller left") in log)
            return answer.status, await answer.json()

        try:
            result = await with_proxy([url(servers[0])], [url(servers[1])], body)
        finally:
            for server in servers:
                await server.close()
        return result, fakes[0].num_bytes_sent

    (status, answer), num_bytes_sent = asyncio.run(scenario())
    assert status == 200 and answer["server"] == "d"
    # The proxy read at most PREFILL_ANSWER_MAX_BYTES (1 MiB); what the server got out
    # beyond that sat in socket buffers when the connection closed.
    assert num_bytes_sent < 64 << 20
