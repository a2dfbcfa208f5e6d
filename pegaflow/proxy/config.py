"""The proxy's one frozen config: its servers, and every bound and timeout with its default.

The flags of ``pegaflow-proxy`` (cli.py) fill it; each value is checked here, once.
docs/disaggregation.md lists the same defaults and what a caller gets past each bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pegaflow.platform.errors import ConfigError

# vLLM's OpenAI server (uvicorn) takes a request body of any size; the proxy holds a whole
# body in memory (it must read the prompt before the prefill server gets it), so it needs a
# bound: one generous enough for a million-token prompt or a few large images.
DEFAULT_MAX_BODY_BYTES = 128 << 20


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    prefill_timeout_s: float = 60.0  # a prefill past this is abandoned: decode computes the prompt
    decode_timeout_s: float = 3600.0  # a whole decode answer, at most
    prefill_retry_s: float = 10.0  # a failing prefill server gets one request per this, until one succeeds
    idle_timeout_s: float = 15.0  # a connection with no whole request head this long after it opened
    #                               or after its last answer is closed (the header and the idle timeout)
    body_timeout_s: float = 60.0  # a request body not whole this long after its head: 408
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # a longer body: 413
    max_body_bytes_in_flight: int = 1 << 30  # bodies held at once (being read or served); past it: 503
    max_in_flight: int = 512  # requests served at once (body read, upstream requests open); past it: 503

    def __post_init__(self) -> None:
        for key in ("prefill_timeout_s", "decode_timeout_s", "prefill_retry_s", "idle_timeout_s",
                    "body_timeout_s"):
            if not 0 < getattr(self, key) < math.inf:  # nan fails too
                raise ConfigError(f"timeouts must be positive finite seconds: {key}={getattr(self, key)}")
        for key in ("max_body_bytes", "max_body_bytes_in_flight", "max_in_flight"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ConfigError(f"{key} must be a positive whole number: {getattr(self, key)!r}")
        if self.max_body_bytes > self.max_body_bytes_in_flight:
            raise ConfigError(f"max_body_bytes ({self.max_body_bytes}) must not exceed "
                              f"max_body_bytes_in_flight ({self.max_body_bytes_in_flight})")
