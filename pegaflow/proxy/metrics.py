"""What the proxy counts, served at ``GET /metrics`` (docs/disaggregation.md lists each)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pegaflow_proxy_requests", "requests received, by endpoint",
                                ["endpoint"], registry=r)
        self.refused = Counter("pegaflow_proxy_refused", "requests answered by the proxy itself, by "
                               "status: 400 not a JSON object, 408 body too slow, 413 body too long, "
                               "503 too many requests in flight", ["status"], registry=r)
        self.prefill_failures = Counter("pegaflow_proxy_prefill_failures", "prefill requests that failed "
                                        "(refused, an error status, timed out): decode computed the prompt",
                                        registry=r)
        self.prefill_skipped = Counter("pegaflow_proxy_prefill_skipped", "requests sent straight to decode "
                                       "because every prefill server was failing", registry=r)
        self.decode_failures = Counter("pegaflow_proxy_decode_failures", "decode requests that could not "
                                       "be sent or broke off (answered 502 where nothing was sent yet)",
                                       registry=r)
        self.caller_hangups = Counter("pegaflow_proxy_caller_hangups", "callers that left before the "
                                      "whole answer: their upstream requests were closed", registry=r)
        self.prefill_seconds = Histogram("pegaflow_proxy_prefill_seconds", "time to the prefill server's "
                                         "answer", registry=r)
        self.in_flight = Gauge("pegaflow_proxy_requests_in_flight", "requests being served", registry=r)
