"""The replicas bench's router and per-replica figures (tools/replica_router.py)."""

from __future__ import annotations

import pytest

from tools.replica_router import Routed, Router, replica_figures
from tools.serving_workload import RequestResult, cacheable_tokens


def _result(key: str, ttft_s: float, error: str = "", cached: int | None = None) -> RequestResult:
    return RequestResult(key, 100, [1, 2], 10.0, 10.0 + ttft_s, 11.0, error, cached_tokens=cached)


def test_router_round_robin_spreads_each_round_evenly():
    router = Router("round-robin", 3, seed=1)
    for _ in range(4):
        replicas = router.route(list(range(9)))
        assert sorted(replicas) == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_router_round_robin_moves_users_between_rounds():
    # 1. Nine users, two replicas, eight rounds: with arrivals in a shuffled order a user's
    #    next turn lands on the other replica about half the time, never always or never.
    router = Router("round-robin", 2, seed=0)
    rounds = [router.route(list(range(9))) for _ in range(8)]
    moves = sum(a != b for prev, cur in zip(rounds, rounds[1:]) for a, b in zip(prev, cur))
    assert 0 < moves < 7 * 9


def test_router_affinity_keeps_each_user_on_one_replica():
    router = Router("affinity", 4)
    assert router.route([0, 1, 2, 3, 4, 5]) == [0, 1, 2, 3, 0, 1]
    assert router.route([0, 1, 2, 3, 4, 5]) == [0, 1, 2, 3, 0, 1]


def test_router_random_is_seeded_and_in_range():
    a = Router("random", 3, seed=5).route(list(range(50)))
    b = Router("random", 3, seed=5).route(list(range(50)))
    assert a == b and set(a) == {0, 1, 2}


@pytest.mark.parametrize("kind,replicas", [("sticky", 2), ("random", 0)])
def test_router_bad_arguments_raise(kind, replicas):
    with pytest.raises(ValueError):
        Router(kind, replicas)


def test_cacheable_tokens_full_blocks_of_the_computed_history_only():
    assert cacheable_tokens(prompt_len=1000, computed_len=0, block_size=16) == 0
    assert cacheable_tokens(prompt_len=1000, computed_len=500, block_size=16) == 496
    # the block holding the prompt's last token is never served
    assert cacheable_tokens(prompt_len=1000, computed_len=1000, block_size=16) == 992
    assert cacheable_tokens(prompt_len=993, computed_len=2000, block_size=16) == 992


def test_replica_figures_share_per_replica_and_in_all():
    routed = [Routed(_result("a", 0.1), 0, 320, True), Routed(_result("b", 0.3), 1, 160, False),
              Routed(_result("c", 0.2), 1, 160, True), Routed(_result("d", 9.0, error="HTTP 500"), 0, 0, True)]
    figures = replica_figures(routed, {0: 160.0, 1: 320.0}, 2)
    r0, r1 = figures["per_replica"]
    assert (r0["replica"], r0["requests"], r0["errors"], r0["cacheable_tokens"]) == (0, 2, 1, 320)
    assert r0["served_share"] == 0.5 and r1["served_share"] == 1.0
    assert r0["ttft_p50_ms"] == pytest.approx(100.0)  # the failed request is not timed
    assert r1["ttft_p50_ms"] == pytest.approx(250.0)
    assert figures["served_share"] == pytest.approx(480 / 640)
    assert figures["moved_share"] == 0.75 and figures["errors"] == 1


def test_replica_figures_nothing_cacheable_has_no_share():
    figures = replica_figures([Routed(_result("a", 0.1), 0, 0, False)], {0: 0.0}, 1)
    assert figures["served_share"] is None


def test_replica_figures_cached_share_counts_what_was_not_computed_capped_at_cacheable():
    # 1. One request hit 320 of its 320 cacheable tokens (more counted: capped), one 80 of 160;
    #    one whose answer said nothing of its cache is left out of the share.
    routed = [Routed(_result("a", 0.1, cached=400), 0, 320, True), Routed(_result("b", 0.1, cached=80), 1, 160, False),
              Routed(_result("c", 0.1), 1, 999, True)]
    figures = replica_figures(routed, {0: 0.0, 1: 0.0}, 2)
    assert figures["cached_share"] == pytest.approx(400 / 480, abs=1e-4)
    assert figures["per_replica"][1]["cached_share"] == 0.5
