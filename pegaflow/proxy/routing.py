"""Which server serves a request next, and what the prefill server is asked."""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from pegaflow.platform.errors import ConfigError

# Fields a prefill request must not carry: it returns one token, whole, once.
_PREFILL_DROPPED = ("stream_options", "min_tokens", "best_of", "logprobs", "top_logprobs",
                    "prompt_logprobs", "echo")


def check_url(url: str) -> str:
    """``url`` without a trailing slash, or ConfigError if it is not http(s)://host:port."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{url!r}: expected http://host:port")
    try:
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError as exc:
        raise ConfigError(f"{url!r}: {exc}") from exc
    return url.rstrip("/")


FAILURES_TO_DEGRADE = 3  # failed requests in a row that mark a server failing


@dataclass(slots=True)
class ServerState:
    """What the proxy saw of one server's recent requests."""

    url: str
    num_failures_in_row: int = 0
    last_failure: str = ""
    last_sent: float = -math.inf  # time.monotonic() of the last request sent to it

    @property
    def is_failing(self) -> bool:
        return self.num_failures_in_row >= FAILURES_TO_DEGRADE


@dataclass(slots=True)
class RoundRobin:
    """Servers of one kind, handed out in turn, each with its recent failures.

    With ``retry_s`` set, a failing server (FAILURES_TO_DEGRADE failed requests in a row) is
    passed over while another is not failing, and gets one request per ``retry_s`` until
    one succeeds; ``pick`` answers None where every server is failing and none is due."""

    urls: tuple[str, ...]
    retry_s: float | None = None
    _states: dict[str, ServerState] = field(init=False)
    _next: itertools.cycle = field(init=False)

    def __post_init__(self) -> None:
        if not self.urls:
            raise ConfigError("at least one server of each kind is needed")
        self.urls = tuple(check_url(u) for u in self.urls)
        self._states = {url: ServerState(url) for url in self.urls}
        self._next = itertools.cycle(self.urls)

    def pick(self, now: float | None = None) -> str | None:
        now = time.monotonic() if now is None else now
        for _ in self.urls:
            state = self._states[next(self._next)]
            if self.retry_s is None or not state.is_failing or now - state.last_sent >= self.retry_s:
                state.last_sent = now
                return state.url
        return None

    def record(self, url: str, failure: str | None) -> None:
        """The outcome of a request sent to ``url``: None where it succeeded, else why not."""
        state = self._states[url]
        if failure is None:
            state.num_failures_in_row, state.last_failure = 0, ""
        else:
            state.num_failures_in_row += 1
            state.last_failure = failure

    def states(self) -> list[ServerState]:
        return list(self._states.values())


def prefill_body(body: dict) -> dict:
    """The request a prefill server computes: the same prompt and sampling, one token, no
    stream (its answer is thrown away: only the KV it saves matters)."""
    prefill = {k: v for k, v in body.items() if k not in _PREFILL_DROPPED}
    prefill["max_tokens"] = 1
    if "max_completion_tokens" in prefill:  # (chat's newer name wins where both are given)
        prefill["max_completion_tokens"] = 1
    prefill["stream"] = False
    prefill["n"] = 1
    return prefill
