"""Fake prefill and decode servers for the proxy's tests, and a proxy in front of them.

Each fake server is a real aiohttp server on a free port of 127.0.0.1 that records what it
was sent (in one log shared by all, so the order of prefill and decode shows) and answers
like vLLM's OpenAI server: JSON, or server-sent events when asked to stream.  Its ``mode``
makes it misbehave: ``hang`` never answers a request (its /health still says 200),
``endless`` answers 200 with a body that never ends, ``trickle`` streams a chunk every
10 ms forever.  A fake server notices a caller that leaves (its handler is cancelled or
its write fails, where vLLM aborts the request) and logs ``(name, "caller left")``.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from pegaflow.proxy.app import Proxy
from pegaflow.proxy.config import ProxyConfig

STREAM_CHUNKS = [b'data: {"choices":[{"text":"a"}]}\n\n', b'data: {"choices":[{"text":"b"}]}\n\n',
                 b"data: [DONE]\n\n"]
ENDLESS_CHUNK = b"x" * (1 << 20)


class FakeServer:
    def __init__(self, name: str, log: list, status: int = 200, hold_last: asyncio.Event | None = None,
                 mode: str | None = None):
        self.name, self.log, self.status, self.mode = name, log, status, mode
        self.hold_last = hold_last  # set: the last chunk waits for it (what came before must be through)
        self.num_bytes_sent = 0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/health", self._health)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.status)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.log.append((self.name, request.path, body, request.headers.get("X-Request-Id")))
        try:
            return await self._answer(request, body)
        except (asyncio.CancelledError, ConnectionResetError):
            self.log.append((self.name, "caller left"))
            raise

    async def _answer(self, request: web.Request, body: dict) -> web.StreamResponse:
        if self.mode == "hang":
            await asyncio.Event().wait()
        if self.status != 200:
            return web.json_response({"error": "down"}, status=self.status)
        if self.mode is None and not body.get("stream"):
            return web.json_response({"server": self.name, "max_tokens": body.get("max_tokens")})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if self.mode == "endless":
            while True:  # (ends when the reader closes the connection: the write raises)
                await response.write(ENDLESS_CHUNK)
                self.num_bytes_sent += len(ENDLESS_CHUNK)
        for i, chunk in enumerate(STREAM_CHUNKS if self.mode is None else iter(lambda: STREAM_CHUNKS[0], None)):
            if i == len(STREAM_CHUNKS) - 1 and self.hold_last is not None:
                await self.hold_last.wait()
            await response.write(chunk)
            await asyncio.sleep(0.01)  # (separate writes: the proxy must pass each through)
        await response.write_eof()
        return response


async def serve(*fakes: FakeServer) -> list[TestServer]:
    servers = [TestServer(f.app(), host="127.0.0.1") for f in fakes]  # (handler_cancellation on)
    for server in servers:
        await server.start_server()
    return servers


def url(server: TestServer) -> str:
    return f"http://127.0.0.1:{server.port}"


class ProxyClient:
    """A caller of the proxy on ``port``: ``post`` and ``get`` take its paths."""

    def __init__(self, session: aiohttp.ClientSession, port: int) -> None:
        self.session, self.port = session, port

    def post(self, path: str, **kwargs):
        return self.session.post(path, **kwargs)

    def get(self, path: str, **kwargs):
        return self.session.get(path, **kwargs)


async def with_proxy(prefill: list[str], decode: list[str], body, server_overrides: dict | None = None,
                     **limits):
    """Run ``body(client, proxy)`` against a proxy in front of those servers, served as
    pegaflow-proxy serves it: with the settings the proxy asks of aiohttp's server (but
    ``server_overrides``)."""
    config = {"prefill_timeout_s": 30, "decode_timeout_s": 30, **limits}
    proxy = Proxy(ProxyConfig(tuple(prefill), tuple(decode), **config))
    runner = web.AppRunner(proxy.app(), **{**proxy.server_options(), **(server_overrides or {})})
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as session:
            return await body(ProxyClient(session, port), proxy)
    finally:
        await runner.cleanup()


async def wait_until(predicate, timeout_s: float = 20.0) -> None:
    """Poll ``predicate`` until true; fail after ``timeout_s`` (generous: a loaded machine)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)
