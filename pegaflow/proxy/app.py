"""The proxy's aiohttp application: prefill first (one token), then decode, streamed back."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp
from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pegaflow.proxy.config import ProxyConfig
from pegaflow.proxy.metrics import ProxyMetrics
from pegaflow.proxy.request_body import BodyBudget, RequestRefused, parse_json_object, read_body
from pegaflow.proxy.routing import RoundRobin, prefill_body

logger = logging.getLogger(__name__)

GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
FORWARDED_HEADERS = ("Authorization", "X-Request-Id")
HEALTH_TIMEOUT_S = 5.0  # a server's /health (and /v1/models) later than this counts as down
PREFILL_ANSWER_MAX_BYTES = 1 << 20  # a prefill answer (dropped) read past this: the connection is closed
MODELS_ANSWER_MAX_BYTES = 1 << 20
_READ_CHUNK_BYTES = 1 << 16
_SESSION = web.AppKey("session", aiohttp.ClientSession)


class Proxy:
    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.prefill = RoundRobin(tuple(config.prefill_urls), retry_s=config.prefill_retry_s)
        self.decode = RoundRobin(tuple(config.decode_urls))
        self.metrics = ProxyMetrics()
        self.bodies = BodyBudget(config.max_body_bytes_in_flight)
        self._num_in_flight = 0

    def app(self) -> web.Application:
        app = web.Application()  # (bodies are read by read_body, within their own bounds)
        app.cleanup_ctx.append(self._session)
        for path in GENERATE_PATHS:
            app.router.add_post(path, self._generate)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        return app

    def server_options(self) -> dict:
        """aiohttp server settings the proxy relies on; whatever serves ``app()`` passes them.
        A connection without a whole request head ``idle_timeout_s`` after it opened or after
        its last answer is closed; a caller that hangs up cancels its handler, which closes
        the upstream requests (vLLM then aborts them)."""
        return {"keepalive_timeout": self.config.idle_timeout_s, "handler_cancellation": True}

    async def _session(self, app: web.Application):
        # no cap on connections here: max_in_flight bounds the requests that hold one
        app[_SESSION] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await app[_SESSION].close()

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        self.metrics.requests.labels(request.path).inc()
        try:
            try:
                raw = await read_body(request, self.config.max_body_bytes, self.config.body_timeout_s,
                                      self.bodies)
            except RequestRefused as exc:
                return self._refuse(exc)
            try:
                return await self._serve(request, raw)
            finally:
                self.bodies.give_back(len(raw))
        except asyncio.CancelledError:  # (handler_cancellation: the caller hung up)
            self._caller_left(request, "before its answer")
            raise

    async def _serve(self, request: web.Request, raw: bytes) -> web.StreamResponse:
        """A whole body: prefill, then decode, while fewer than max_in_flight are served."""
        if self._num_in_flight >= self.config.max_in_flight:
            return self._refuse(RequestRefused(503, f"the proxy is serving {self._num_in_flight} requests, "
                                                    "its most (pegaflow-proxy --max-in-flight): retry later"))
        try:
            prefill = _encode(prefill_body(parse_json_object(raw, request.charset)))
        except RequestRefused as exc:
            return self._refuse(exc)
        headers = {k: request.headers[k] for k in FORWARDED_HEADERS if k in request.headers}
        self._num_in_flight += 1
        try:
            with self.metrics.in_flight.track_inprogress():
                await self._prefill(request.app[_SESSION], request.path, prefill, headers)
                del prefill
                headers["Content-Type"] = request.headers.get("Content-Type", "application/json")
                return await self._decode(request, raw, headers)
        finally:
            self._num_in_flight -= 1

    def _caller_left(self, request: web.Request, when: str) -> None:
        self.metrics.caller_hangups.inc()
        logger.info("%s: the caller left %s: its upstream requests are closed", request.path, when)

    def _refuse(self, refusal: RequestRefused) -> web.Response:
        self.metrics.refused.labels(str(refusal.status)).inc()
        return _error(refusal.status, str(refusal))

    async def _prefill(self, session: aiohttp.ClientSession, path: str, body: bytes, headers: dict) -> bool:
        """The prompt computed and saved by a prefill server; False (counted, logged) where
        it failed or every prefill server is failing: the decode server then computes it."""
        url = self.prefill.pick()
        if url is None:
            self.metrics.prefill_skipped.inc()
            return False
        started = time.monotonic()
        timeout = aiohttp.ClientTimeout(total=self.config.prefill_timeout_s)
        try:
            async with session.post(url + path, data=body, headers={**headers, "Content-Type": "application/json"},
                                    timeout=timeout) as answer:
                if answer.status == 200:  # (its body, one token, is dropped)
                    await _read_at_most(answer, PREFILL_ANSWER_MAX_BYTES)
                    self.metrics.prefill_seconds.observe(time.monotonic() - started)
                    self.prefill.record(url, None)
                    return True
                failure = f"HTTP {answer.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            failure = f"{type(exc).__name__}: {exc}"
        self.prefill.record(url, failure)
        self.metrics.prefill_failures.inc()
        logger.warning("prefill server %s failed (%s): the decode server computes the prompt", url, failure)
        return False

    async def _decode(self, request: web.Request, raw: bytes, headers: dict) -> web.StreamResponse:
        """The request as it came, to a decode server; its answer passed through as it arrives."""
        url = self.decode.pick()
        timeout = aiohttp.ClientTimeout(total=self.config.decode_timeout_s)
        try:
            answer = await request.app[_SESSION].post(url + request.path, data=raw, timeout=timeout,
                                                      headers=headers)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return self._decode_failed(url, exc)
        async with answer:
            self.decode.record(url, None)
            response = web.StreamResponse(status=answer.status, headers={
                "Content-Type": answer.headers.get("Content-Type", "application/json")})
            try:
                await response.prepare(request)
            except ConnectionResetError:
                self._caller_left(request, "before its answer")
                return response
            await self._relay(request, url, answer, response)
            return response

    def _decode_failed(self, url: str, exc: BaseException) -> web.Response:
        failure = f"{type(exc).__name__}: {exc}"
        self.decode.record(url, failure)
        self.metrics.decode_failures.inc()
        logger.warning("decode server %s failed: %s", url, failure)
        return _error(502, f"decode server {url}: {type(exc).__name__}")

    async def _relay(self, request: web.Request, url: str, answer: aiohttp.ClientResponse,
                     response: web.StreamResponse) -> None:
        """Each chunk of the decode answer on to the caller as it arrives.  A caller that
        leaves, or a decode server that breaks off, ends it with one log line: the caller's
        connection is then closed without the answer's end, so it sees the answer cut."""
        while True:
            try:
                chunk = await answer.content.readany()
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                self.decode.record(url, f"{type(exc).__name__}: {exc}")
                self.metrics.decode_failures.inc()
                logger.warning("decode server %s broke off its answer: %s: %s", url, type(exc).__name__, exc)
                break
            try:
                await (response.write(chunk) if chunk else response.write_eof())
            except ConnectionResetError:  # (aiohttp's own is a ClientError too: caught first)
                self._caller_left(request, "mid-answer")
                break
            if not chunk:
                return
        if request.transport is not None:
            request.transport.close()

    async def _models(self, request: web.Request) -> web.Response:
        url = self.decode.pick()
        try:
            async with request.app[_SESSION].get(url + "/v1/models",
                                                  timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as answer:
                body = await _read_at_most(answer, MODELS_ANSWER_MAX_BYTES)
                if body is None:
                    return _error(502, f"decode server {url}: /v1/models answer over "
                                       f"{MODELS_ANSWER_MAX_BYTES} bytes")
                return web.Response(status=answer.status, body=body, content_type="application/json")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return _error(502, f"decode server {url}: {type(exc).__name__}")

    async def _health(self, request: web.Request) -> web.Response:
        """200 while a prefill and a decode server are healthy: each answers its own
        ``/health`` and its last requests did not fail (FAILURES_TO_DEGRADE in a row)."""
        session = request.app[_SESSION]
        states = [("prefill", s) for s in self.prefill.states()] + [("decode", s) for s in self.decode.states()]
        answers = await asyncio.gather(*(_answers_health(session, s.url) for _, s in states))
        servers = [{"kind": kind, "url": s.url, "healthy": ok and not s.is_failing, "answers_health": ok,
                    "failures_in_row": s.num_failures_in_row, "last_failure": s.last_failure}
                   for (kind, s), ok in zip(states, answers)]
        is_up = all(any(s["healthy"] for s in servers if s["kind"] == kind) for kind in ("prefill", "decode"))
        return web.json_response({"healthy": is_up, "servers": servers}, status=200 if is_up else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _read_at_most(answer: aiohttp.ClientResponse, max_bytes: int) -> bytes | None:
    """The answer's body, or None where it runs past ``max_bytes``: then it is not read
    further, and its connection is closed rather than reused."""
    chunks, size = [], 0
    while chunk := await answer.content.read(_READ_CHUNK_BYTES):
        size += len(chunk)
        if size > max_bytes:
            answer.close()
            return None
        chunks.append(chunk)
    return b"".join(chunks)


async def _answers_health(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as answer:
            return answer.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False


def _encode(fields: dict) -> bytes:
    """The prefill request's JSON; RequestRefused(400) for what parses but does not encode
    (nesting near Python's limit)."""
    try:
        return json.dumps(fields).encode()
    except (RecursionError, ValueError) as exc:
        raise RequestRefused(400, f"the body is not JSON the proxy can forward: {type(exc).__name__}") from None


def _error(status: int, message: str) -> web.Response:
    """An OpenAI-style error answer."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)
