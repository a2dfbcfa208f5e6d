"""A caller's request body: read within its size bound, its deadline and the proxy's budget
of body bytes, then parsed as JSON.

Every way a body can be unusable ends in ``RequestRefused`` carrying the HTTP status the
caller gets (400 not a JSON object, 408 not whole in time, 413 too long, 503 the budget
spent), never in a 500.
"""

from __future__ import annotations

import asyncio
import codecs
import json

from aiohttp import web

from pegaflow.platform.errors import PegaflowError
from pegaflow.platform.values import format_size

_CHUNK_BYTES = 1 << 16


class RequestRefused(PegaflowError):
    """A request the proxy answers itself with ``status`` (JSON error), sending nothing on."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class BodyBudget:
    """The bytes of request bodies the proxy holds at once: taken as they are read, given
    back when their request ends.  A body that would take it past ``max_bytes`` is answered
    503, so callers sending big bodies at once cannot run the proxy out of memory."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0

    def take(self, num_bytes: int) -> None:
        if self.num_bytes + num_bytes > self.max_bytes:
            raise RequestRefused(503, f"the proxy holds {format_size(self.num_bytes)} of request bodies, "
                                      "its most (pegaflow-proxy --max-body-bytes-in-flight): retry later")
        self.num_bytes += num_bytes

    def give_back(self, num_bytes: int) -> None:
        self.num_bytes -= num_bytes


async def read_body(request: web.Request, max_bytes: int, timeout_s: float, budget: BodyBudget) -> bytes:
    """The body, whole, within ``timeout_s`` and ``max_bytes``, its bytes taken from
    ``budget``: the caller gives ``len(body)`` back when the request ends."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise _too_large(max_bytes)
    chunks: list[bytes] = []
    try:
        await asyncio.wait_for(_read_bounded(request, max_bytes, budget, chunks), timeout_s)
    except asyncio.TimeoutError:
        budget.give_back(sum(map(len, chunks)))
        raise RequestRefused(408, f"the request body did not arrive within {timeout_s:g} s") from None
    except BaseException:  # (refused, or the caller left: what was read is dropped)
        budget.give_back(sum(map(len, chunks)))
        raise
    return b"".join(chunks)


async def _read_bounded(request: web.Request, max_bytes: int, budget: BodyBudget, chunks: list[bytes]) -> None:
    size = 0
    while chunk := await request.content.read(_CHUNK_BYTES):
        size += len(chunk)
        if size > max_bytes:  # (a chunked body, whose length was not declared)
            raise _too_large(max_bytes)
        budget.take(len(chunk))
        chunks.append(chunk)


def parse_json_object(raw: bytes, charset: str | None) -> dict:
    """``raw`` as a JSON object, or RequestRefused(400) saying why not: an unknown or wrong
    charset, bad JSON, nesting or a number too deep or long for Python's parser."""
    try:
        text = raw.decode(codecs.lookup(charset or "utf-8").name)
    except LookupError:
        raise RequestRefused(400, f"unknown charset {charset!r}") from None
    except UnicodeDecodeError as exc:
        raise RequestRefused(400, f"the body is not valid {charset or 'utf-8'}: {exc.reason}") from None
    try:
        fields = json.loads(text)
    except RecursionError:
        raise RequestRefused(400, "the body is not JSON the proxy can read: nested too deep") from None
    except ValueError as exc:  # (JSONDecodeError, and an integer past Python's digit limit)
        raise RequestRefused(400, f"the body is not JSON: {exc}") from None
    if not isinstance(fields, dict):
        raise RequestRefused(400, "the body must be a JSON object")
    return fields


def _too_large(max_bytes: int) -> RequestRefused:
    return RequestRefused(413, f"the request body is longer than {format_size(max_bytes)} "
                               f"(pegaflow-proxy --max-body-size)")
