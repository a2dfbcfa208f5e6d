"""Serving the proxy: its open-file limit, failed accepts and malformed requests logged as one
line each (not a traceback), aiohttp's settings."""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import resource
import time

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from pegaflow.proxy.app import Proxy

logger = logging.getLogger(__name__)

WANTED_OPEN_FILES = 65536  # each caller's connection holds a descriptor, each request in flight two more
ACCEPT_FAILURE_LOG_EVERY_S = 10.0
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def raise_open_files_limit(wanted: int = WANTED_OPEN_FILES) -> int:
    """The soft RLIMIT_NOFILE raised to ``wanted`` (or to the hard limit, if lower);
    the limit in force after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(hard, wanted)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return target
    return soft


class AcceptFailureLog:
    """The event loop's exception handler.  asyncio reports every accept() that fails for
    want of descriptors or memory with a traceback, hundreds a second while it lasts; this
    logs one line per ``every_s`` saying how many, and hands everything else to asyncio's
    default handler."""

    def __init__(self, open_files_limit: int, every_s: float = ACCEPT_FAILURE_LOG_EVERY_S) -> None:
        self.open_files_limit = open_files_limit
        self.every_s = every_s
        self.num_failures = 0  # since the last line
        self._last_logged = -math.inf

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exc = context.get("exception")
        if not (isinstance(exc, OSError) and exc.errno in _OUT_OF_RESOURCES):
            loop.default_exception_handler(context)
            return
        self.num_failures += 1
        now = time.monotonic()
        if now - self._last_logged >= self.every_s:
            logger.warning("%d connection(s) not accepted: %s (open-file limit %d); they wait in the "
                           "listen queue while connections close (the idle and body timeouts close slow "
                           "ones)", self.num_failures, exc.strerror, self.open_files_limit)
            self.num_failures, self._last_logged = 0, now


class BadRequestLogFilter(logging.Filter):
    """On aiohttp's server logger: a request that is not valid HTTP (answered 400 by aiohttp)
    is logged as one INFO line, not an ERROR with a traceback each."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            why = str(exc.message).splitlines()[0] if exc.message else type(exc).__name__
            record.msg, record.args = "%s: %d %s", (record.getMessage(), exc.code, why)
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def serve(proxy: Proxy, host: str, port: int, access_log: logging.Logger | None) -> None:
    """Serve ``proxy`` on ``host:port`` until SIGINT or SIGTERM."""
    limit = raise_open_files_limit()
    logger.info("open-file limit %d; at most %d requests in flight", limit, proxy.config.max_in_flight)
    app = proxy.app()

    async def install_accept_failure_log(app: web.Application) -> None:
        asyncio.get_running_loop().set_exception_handler(AcceptFailureLog(limit))

    app.on_startup.append(install_accept_failure_log)
    logging.getLogger("aiohttp.server").addFilter(BadRequestLogFilter())
    web.run_app(app, host=host, port=port, print=None, access_log=access_log, **proxy.server_options())
