"""The proxy's aiohttp application: prefill first (one token), then decode, streamed back."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pegaflow.platform.errors import ConfigError
from pegaflow.proxy.routing import RoundRobin, prefill_body

logger = logging.getLogger(__name__)

GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
FORWARDED_HEADERS = ("Authorization", "X-Request-Id")
HEALTH_TIMEOUT_S = 5.0
_SESSION = web.AppKey("session", aiohttp.ClientSession)


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    prefill_timeout_s: float = 600.0  # a prefill past this is abandoned: decode computes the prompt
    decode_timeout_s: float = 3600.0  # a whole decode answer, at most

    def __post_init__(self) -> None:
        for key in ("prefill_timeout_s", "decode_timeout_s"):
            if not 0 < getattr(self, key) < math.inf:  # nan fails too
                raise ConfigError(f"timeouts must be positive finite seconds: {key}={getattr(self, key)}")


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pegaflow_proxy_requests", "requests received, by endpoint",
                                ["endpoint"], registry=r)
        self.prefill_failures = Counter("pegaflow_proxy_prefill_failures", "prefill requests that failed "
                                        "(refused, an error status, timed out): decode computed the prompt",
                                        registry=r)
        self.decode_failures = Counter("pegaflow_proxy_decode_failures", "decode requests that could not "
                                       "be sent or broke off (answered 502 where nothing was sent yet)",
                                       registry=r)
        self.bad_requests = Counter("pegaflow_proxy_bad_requests", "requests whose body was not a JSON "
                                    "object (answered 400)", registry=r)
        self.prefill_seconds = Histogram("pegaflow_proxy_prefill_seconds", "time to the prefill server's "
                                         "answer", registry=r)
        self.in_flight = Gauge("pegaflow_proxy_requests_in_flight", "requests being served", registry=r)


class Proxy:
    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.prefill = RoundRobin(tuple(config.prefill_urls))
        self.decode = RoundRobin(tuple(config.decode_urls))
        self.metrics = ProxyMetrics()

    def app(self) -> web.Application:
        app = web.Application()
        app.cleanup_ctx.append(self._session)
        for path in GENERATE_PATHS:
            app.router.add_post(path, self._generate)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def _session(self, app: web.Application):
        # no cap on connections: every request in flight holds one to a decode server
        app[_SESSION] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await app[_SESSION].close()

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        self.metrics.requests.labels(path).inc()
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            body, why = None, f"the body is not JSON: {exc}"
        else:
            why = "the body must be a JSON object"
        if not isinstance(body, dict):
            self.metrics.bad_requests.inc()
            return _error(400, why)
        headers = {k: request.headers[k] for k in FORWARDED_HEADERS if k in request.headers}
        with self.metrics.in_flight.track_inprogress():
            await self._prefill(request.app[_SESSION], path, body, headers)
            return await self._decode(request, path, body, headers)

    async def _prefill(self, session: aiohttp.ClientSession, path: str, body: dict, headers: dict) -> bool:
        """The prompt computed and saved by a prefill server; False (counted, logged) where
        it failed: the decode server then computes it."""
        url = self.prefill.pick()
        started = time.monotonic()
        timeout = aiohttp.ClientTimeout(total=self.config.prefill_timeout_s)
        try:
            async with session.post(url + path, json=prefill_body(body), headers=headers,
                                    timeout=timeout) as answer:
                await answer.read()
                if answer.status == 200:
                    self.metrics.prefill_seconds.observe(time.monotonic() - started)
                    return True
                failure = f"HTTP {answer.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            failure = f"{type(exc).__name__}: {exc}"
        self.metrics.prefill_failures.inc()
        logger.warning("prefill server %s failed (%s): the decode server computes the prompt", url, failure)
        return False

    async def _decode(self, request: web.Request, path: str, body: dict, headers: dict) -> web.StreamResponse:
        """The request as it came, to a decode server; its answer passed through as it arrives."""
        url = self.decode.pick()
        response: web.StreamResponse | None = None
        timeout = aiohttp.ClientTimeout(total=self.config.decode_timeout_s)
        try:
            async with request.app[_SESSION].post(url + path, json=body, headers=headers,
                                                  timeout=timeout) as answer:
                response = web.StreamResponse(status=answer.status, headers={
                    "Content-Type": answer.headers.get("Content-Type", "application/json")})
                await response.prepare(request)
                async for chunk in answer.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            if response is not None and isinstance(exc, ConnectionResetError):
                raise  # writing to the caller, who hung up: not the decode server's failure
            self.metrics.decode_failures.inc()
            logger.warning("decode server %s failed: %s: %s", url, type(exc).__name__, exc)
            if response is not None:  # part of the answer went out: the caller sees it cut
                raise
            return _error(502, f"decode server {url}: {type(exc).__name__}")

    async def _models(self, request: web.Request) -> web.Response:
        url = self.decode.pick()
        try:
            async with request.app[_SESSION].get(url + "/v1/models") as answer:
                return web.Response(status=answer.status, body=await answer.read(),
                                    content_type="application/json")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return _error(502, f"decode server {url}: {type(exc).__name__}")

    async def _health(self, request: web.Request) -> web.Response:
        """200 while a prefill and a decode server answer their ``/health``; each one's state."""
        session = request.app[_SESSION]
        urls = [("prefill", u) for u in self.prefill.urls] + [("decode", u) for u in self.decode.urls]
        states = await asyncio.gather(*(_is_healthy(session, u) for _, u in urls))
        servers = [{"kind": kind, "url": url, "healthy": ok} for (kind, url), ok in zip(urls, states)]
        is_up = all(any(s["healthy"] for s in servers if s["kind"] == kind) for kind in ("prefill", "decode"))
        return web.json_response({"healthy": is_up, "servers": servers}, status=200 if is_up else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _is_healthy(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as answer:
            return answer.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)
