"""A caller's request body: read within its size bound and its deadline, then parsed as JSON.

Every way a body can be unusable ends in ``RequestRefused`` carrying the HTTP status the
caller gets (400 not a JSON object, 408 not whole in time, 413 too long), never in a 500.
"""

from __future__ import annotations

import asyncio
import codecs
import json
from dataclasses import dataclass

from aiohttp import web

from pegaflow.platform.errors import PegaflowError
from pegaflow.platform.values import format_size

_CHUNK_BYTES = 1 << 16


class RequestRefused(PegaflowError):
    """A request the proxy answers itself with ``status`` (JSON error), sending nothing on."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class RequestBody:
    raw: bytes  # as the caller sent it: what the decode server gets
    content_type: str
    fields: dict  # parsed: what the prefill request is built from


async def read_json_body(request: web.Request, max_bytes: int, timeout_s: float) -> RequestBody:
    """The body, whole, within ``timeout_s`` and ``max_bytes``, parsed as a JSON object."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise _too_large(max_bytes)
    try:
        raw = await asyncio.wait_for(_read_bounded(request, max_bytes), timeout_s)
    except asyncio.TimeoutError:
        raise RequestRefused(408, f"the request body did not arrive within {timeout_s:g} s") from None
    fields = parse_json_object(raw, request.charset)
    return RequestBody(raw, request.headers.get("Content-Type", "application/json"), fields)


async def _read_bounded(request: web.Request, max_bytes: int) -> bytes:
    chunks, size = [], 0
    while chunk := await request.content.read(_CHUNK_BYTES):
        size += len(chunk)
        if size > max_bytes:  # (a chunked body, whose length was not declared)
            raise _too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


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
