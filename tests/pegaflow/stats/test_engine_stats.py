"""pegaflow/stats/engine_stats.py: a latency quantile read off the engine's histogram, its
bucket bound (inf for the open last bucket), None before any command.  (``read_stats``
against a running engine: tests/pegaflow/stats/test_cli.py.)"""

from __future__ import annotations

from pegaflow.stats.engine_stats import latency_quantile

HISTOGRAM = {"buckets_s": [0.001, 0.01, 0.1], "counts": [50, 40, 9, 1]}  # 100 commands


def test_latency_quantile_is_the_bound_of_the_bucket_that_reaches_it():
    assert latency_quantile(HISTOGRAM, 0.5) == 0.001   # exactly the first bucket's 50
    assert latency_quantile(HISTOGRAM, 0.51) == 0.01
    assert latency_quantile(HISTOGRAM, 0.99) == 0.1
    assert latency_quantile(HISTOGRAM, 1.0) == float("inf")  # the one past the last bound


def test_latency_quantile_of_no_command_is_none():
    assert latency_quantile({"buckets_s": [0.001], "counts": [0, 0]}, 0.5) is None
