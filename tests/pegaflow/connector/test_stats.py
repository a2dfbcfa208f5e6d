"""pegaflow.connector.stats: pegaflow's figures in vLLM's own metrics, through vLLM's real
aggregation (workers -> scheduler -> SchedulerStats -> Prometheus and the log line)."""

from __future__ import annotations

import pytest

from pegaflow.connector.stats import PegaKVConnectorStats
from tests.pegaflow.connector.vllm_harness import BLOCK, VllmInstance, make_request
from tools.engine_process import EngineProcess

pytestmark = pytest.mark.vllm


def _stats(**counts) -> PegaKVConnectorStats:
    stats = PegaKVConnectorStats()
    for key, value in counts.items():
        if key.endswith("_s"):
            for seconds in value:
                stats.observe(key, seconds)
        else:
            stats.add(key, value)
    return stats


def test_stats_aggregate_sums_counts_and_joins_latencies():
    # 1. Two workers of a TP group and the scheduler, summed as vLLM does.
    total = _stats(load_blocks=4, loaded_blocks=4, load_s=[0.001]).aggregate(
        _stats(load_blocks=4, loaded_blocks=3, load_failed_blocks=1, load_s=[0.003]))
    total = total.aggregate(_stats(lookups=1, lookup_tokens=64, lookup_hit_tokens=48))
    assert total.data["load_blocks"] == 8 and total.data["load_failed_blocks"] == 1
    assert sorted(total.data["load_s"]) == [0.001, 0.003]
    # 2. The log line's figures.
    reduced = total.reduce()
    assert reduced["loaded blocks"] == 7 and reduced["lookup hit rate"] == 0.75
    assert reduced["load p50 ms"] == 3.0 and reduced["engine reachable"] == 1


def test_stats_clone_and_reset_hands_off_a_snapshot():
    # vLLM may keep the object it is given (in one process it is the very dict): the
    # connector's own counts must start again, the snapshot keep what it had.
    stats = _stats(saved_blocks=3)
    snapshot = stats.clone_and_reset()
    stats.add("saved_blocks", 5)
    assert snapshot.data["saved_blocks"] == 3 and stats.data["saved_blocks"] == 5
    assert PegaKVConnectorStats().is_empty() and not snapshot.is_empty()


def test_stats_from_an_older_sender_lacking_keys_are_filled_in():
    stats = PegaKVConnectorStats(data={"saved_blocks": 2})
    assert stats.data["load_s"] == [] and stats.data["lookups"] == 0 and stats.reduce()["saved blocks"] == 2


def test_stats_a_failure_reported_after_its_load_never_makes_a_counter_go_down():
    # An async load planned in one step fails in a later one: that step's report has more
    # failed than planned blocks, and vLLM's Prometheus path must not raise on it.
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from pegaflow.connector.stats import PegaPromMetrics
    registry = CollectorRegistry()

    def typed(kind):
        return lambda *a, **k: kind(*a, registry=registry, **k)

    from types import SimpleNamespace
    metrics = PegaPromMetrics(SimpleNamespace(kv_transfer_config=None),
                              {Counter: typed(Counter), Gauge: typed(Gauge), Histogram: typed(Histogram)},
                              ["engine"], {0: ["0"]})
    metrics.observe(_stats(load_blocks=4).data)
    metrics.observe(_stats(load_failed_blocks=4).data)
    malformed = _stats(load_failed_blocks=0).data | {"loaded_blocks": -4}  # e.g. a buggy older sender
    metrics.observe(malformed)
    assert registry.get_sample_value("vllm:pegaflow_load_failed_blocks_total", {"engine": "0"}) == 4
    assert registry.get_sample_value("vllm:pegaflow_loaded_blocks_total", {"engine": "0"}) in (None, 0.0)


def _prometheus_text(vllm: VllmInstance) -> str:
    """vLLM's own Prometheus logger, fed every step's SchedulerStats as a frontend is."""
    from prometheus_client import REGISTRY, generate_latest
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    logger = PrometheusStatLogger(vllm.config, engine_indexes=[0])
    for scheduler_stats in vllm.scheduler_stats:
        logger.record(scheduler_stats=scheduler_stats, iteration_stats=None, engine_idx=0)
    return generate_latest(REGISTRY).decode()


def _sample(text: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_stats_reach_vllms_prometheus_metrics_and_log_line(tmp_path):
    # 1. A computes a prompt (saved), B is served it (looked up, loaded), one engine.
    name = f"stats{__import__('os').getpid()}"
    prompt = list(range(100, 100 + 6 * BLOCK + 3))
    with EngineProcess(name):
        a, b = VllmInstance(name), VllmInstance(name)
        try:
            a.add(make_request("a0", prompt))
            a.run_until_done()
            b.add(make_request("b0", prompt))
            b.run_until_done()
            # 2. vLLM's aggregation carried both sides' figures into its SchedulerStats.
            total = PegaKVConnectorStats()
            for scheduler_stats in b.scheduler_stats:
                if scheduler_stats.kv_connector_stats:
                    total.aggregate(PegaKVConnectorStats(data=dict(scheduler_stats.kv_connector_stats)))
            assert total.data["lookup_hit_tokens"] == 6 * BLOCK == total.data["lookup_tokens"]
            assert total.data["load_blocks"] == total.data["loaded_blocks"] == 6
            assert total.data["load_failed_blocks"] == 0
            assert total.data["lookups"] == 1 and len(total.data["lookup_s"]) == 1
            # 3. vLLM's Prometheus logger shows them, under vllm:pegaflow_*.
            text_a, text_b = _prometheus_text(a), _prometheus_text(b)
            assert _sample(text_a, "vllm:pegaflow_saved_blocks_total") == 6
            assert _sample(text_b, "vllm:pegaflow_loaded_blocks_total") == 6
            assert _sample(text_b, "vllm:pegaflow_lookup_hit_tokens_total") == 6 * BLOCK
            assert _sample(text_b, "vllm:pegaflow_lookup_seconds_count") == 1
            assert _sample(text_b, "vllm:pegaflow_engine_up") == 1
            # 4. ...and so does vLLM's periodic log line.
            from vllm.v1.metrics.loggers import LoggingStatLogger
            log = LoggingStatLogger(b.config)
            for scheduler_stats in b.scheduler_stats:
                log.record(scheduler_stats=scheduler_stats, iteration_stats=None)
            lines = []
            log.kv_connector_logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
            assert any("KV Transfer metrics" in line and "loaded blocks=6" in line for line in lines), lines
        finally:
            a.close()
            b.close()
