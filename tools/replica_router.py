"""The router and the per-replica figures of ``tools/bench_replicas.py`` (no GPU, no server:
unit-tested in CI).

- ``Router``: picks a replica for each request, as a load balancer in front of N ``vllm serve``
  processes does.  ``round-robin`` takes requests in the order they arrive (a round's requests
  arrive in a shuffled order, as concurrent clients' do), ``random`` draws, and ``affinity``
  keeps each user on one replica (the friendly case a session-sticky balancer gives).
- ``replica_figures``: per replica and in all, the served share (from host memory), the cached
  share (not computed: host or the replica's own GPU cache) and the TTFT of a set of routed
  results.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tools.serving_workload import RequestResult, percentile

ROUTERS = ("round-robin", "random", "affinity")


class Router:
    def __init__(self, kind: str, num_replicas: int, seed: int = 0):
        if kind not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, not {kind!r}")
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, not {num_replicas}")
        self.kind, self.num_replicas = kind, num_replicas
        self._rng = random.Random(seed)
        self._next = 0

    def arrival_order(self, count: int) -> list[int]:
        """The order in which ``count`` requests sent together reach the balancer: shuffled,
        except under ``affinity``, where it does not matter."""
        order = list(range(count))
        if self.kind != "affinity":
            self._rng.shuffle(order)
        return order

    def pick(self, user: int) -> int:
        """The replica of the next request, from ``user``."""
        if self.kind == "affinity":
            return user % self.num_replicas
        if self.kind == "random":
            return self._rng.randrange(self.num_replicas)
        replica = self._next
        self._next = (self._next + 1) % self.num_replicas
        return replica

    def route(self, users: list[int]) -> list[int]:
        """The replica of each of a round's requests (``users[i]`` sends request i), the
        requests reaching the balancer in ``arrival_order``."""
        replicas = [0] * len(users)
        for i in self.arrival_order(len(users)):
            replicas[i] = self.pick(users[i])
        return replicas


@dataclass(frozen=True)
class Routed:
    """One request's result and where it went."""
    result: RequestResult
    replica: int
    cacheable_tokens: int
    moved: bool  # this user's previous request went to another replica


def replica_figures(routed: list[Routed], hit_tokens: dict[int, float], num_replicas: int) -> dict:
    """Per replica and in all: requests, TTFT p50/p99 (ms), the cacheable tokens of the
    requests it got, the tokens it was served from outside its GPU cache (``hit_tokens``, from
    its counters) and their share, and the share of requests whose user moved to it."""
    out: dict = {"per_replica": []}
    for replica in range(num_replicas):
        mine = [r for r in routed if r.replica == replica]
        out["per_replica"].append(_figures(mine, hit_tokens.get(replica, 0.0)) | {"replica": replica})
    out.update(_figures(routed, sum(hit_tokens.values())))
    return out


def _figures(routed: list[Routed], hits: float) -> dict:
    ok = [r for r in routed if not r.result.error]
    ttft = [r.result.ttft_s * 1e3 for r in ok]
    cacheable = sum(r.cacheable_tokens for r in routed)
    # Not computed, wherever it came from (the replica's GPU cache or the host), per request
    # from its answer's usage; capped at what could be cached, like the served share.
    known = [r for r in ok if r.result.cached_tokens is not None]
    known_cacheable = sum(r.cacheable_tokens for r in known)
    not_computed = sum(min(r.result.cached_tokens, r.cacheable_tokens) for r in known)
    return {"cached_share": round(not_computed / known_cacheable, 4) if known_cacheable else None,
            "requests": len(routed), "errors": len(routed) - len(ok),
            "ttft_p50_ms": round(percentile(ttft, 50), 2), "ttft_p99_ms": round(percentile(ttft, 99), 2),
            "cacheable_tokens": cacheable, "served_tokens": hits,
            "served_share": round(hits / cacheable, 4) if cacheable else None,
            "moved_share": round(sum(r.moved for r in routed) / len(routed), 4) if routed else None}
