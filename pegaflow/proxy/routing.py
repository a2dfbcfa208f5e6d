"""Which server serves a request next, and what the prefill server is asked."""

from __future__ import annotations

import itertools
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


@dataclass(slots=True)
class RoundRobin:
    """Servers of one kind, handed out in turn."""

    urls: tuple[str, ...]
    _next: itertools.cycle = field(init=False)

    def __post_init__(self) -> None:
        if not self.urls:
            raise ConfigError("at least one server of each kind is needed")
        self.urls = tuple(check_url(u) for u in self.urls)
        self._next = itertools.cycle(self.urls)

    def pick(self) -> str:
        return next(self._next)


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
