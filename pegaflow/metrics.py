"""Prometheus metrics of a running engine, read from its stats segment at each scrape.

    pegaflow-stat --name pegaflow --serve-metrics 9464      # then scrape :9464/metrics

Counters: ``pegaflow_{saved,loaded}_{blocks,bytes}_total``, ``pegaflow_save_{deduped,dropped}
_blocks_total``, ``pegaflow_lookups_total``, ``pegaflow_lookup_{,hit_}blocks_total``,
``pegaflow_{evictions,lease_expiries}_total``, ``pegaflow_commands_total{opcode}`` and
``pegaflow_errors_total{status}``.  Gauges: ``pegaflow_pool_{used,capacity}_bytes``,
``pegaflow_pool_blocks``, ``pegaflow_{leases,clients,inflight_copies}``,
``pegaflow_uptime_seconds``; ``pegaflow_up`` is 1 while the engine runs and beats its
heartbeat (0, and nothing else, while it does not: down, stopped or stuck).  Every series has an ``engine`` label.  Read-only: the exporter
never attaches to the engine as a client.
"""

from __future__ import annotations

import logging

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pegaflow.errors import EngineNotRunningError, PegaflowError
from pegaflow.stat_cli import read_stats

logger = logging.getLogger(__name__)

# stats field -> metric name (Prometheus style: unit last, counters end in _total)
COUNTERS = {"blocks_saved": "saved_blocks", "bytes_saved": "saved_bytes",
            "blocks_loaded": "loaded_blocks", "bytes_loaded": "loaded_bytes",
            "save_dedup_blocks": "save_deduped_blocks", "save_dropped_blocks": "save_dropped_blocks",
            "lookups": "lookups", "lookup_blocks": "lookup_blocks",
            "lookup_hit_blocks": "lookup_hit_blocks", "evictions": "evictions",
            "lease_expiries": "lease_expiries"}
GAUGES = {"pool_bytes_used": "pool_used_bytes", "pool_bytes_total": "pool_capacity_bytes",
          "pool_blocks_used": "pool_blocks", "leases_active": "leases",
          "clients_attached": "clients", "inflight_copies": "inflight_copies"}


class EngineCollector(Collector):
    def __init__(self, engine_name: str):
        self.engine_name = engine_name

    def collect(self):
        up = GaugeMetricFamily("pegaflow_up", "1 while the engine runs", labels=["engine"])
        try:
            stats = read_stats(self.engine_name)
        except EngineNotRunningError:
            stats = None
        except PegaflowError as exc:  # unreadable (permissions, another wire layout): down
            logger.warning("metrics of engine %r: %s", self.engine_name, exc)
            stats = None
        is_up = stats is not None and stats["alive"] and stats["responding"] and not stats["starting"]
        up.add_metric([self.engine_name], 1.0 if is_up else 0.0)
        yield up
        if not is_up:
            return
        labels = [self.engine_name]
        for field, metric in COUNTERS.items():
            family = CounterMetricFamily(f"pegaflow_{metric}", field.replace("_", " "), labels=["engine"])
            family.add_metric(labels, stats[field])
            yield family
        for field, metric in GAUGES.items():
            family = GaugeMetricFamily(f"pegaflow_{metric}", field.replace("_", " "), labels=["engine"])
            family.add_metric(labels, stats[field])
            yield family
        commands = CounterMetricFamily("pegaflow_commands", "commands answered, by opcode",
                                       labels=["engine", "opcode"])
        for opcode, count in stats["commands_by_opcode"].items():
            commands.add_metric(labels + [opcode], count)
        yield commands
        errors = CounterMetricFamily("pegaflow_errors", "commands answered with an error, by status",
                                     labels=["engine", "status"])
        for status, count in stats["errors_by_status"].items():
            errors.add_metric(labels + [status], count)
        yield errors
        uptime = GaugeMetricFamily("pegaflow_uptime_seconds", "seconds since the engine started",
                                   labels=["engine"])
        uptime.add_metric(labels, stats["uptime_s"])
        yield uptime
