"""Prometheus metrics of a running engine, read from its stats segment at each scrape.

    pegaflow-stat --name pegaflow --serve-metrics 9464      # then scrape 127.0.0.1:9464/metrics

Each metric is named for the key ``pegaflow-stat --once --json`` shows, by one rule
(``metric_name``; docs/operations.md has the table): ``pegaflow_`` + the key, a time in
nanoseconds (``*_ns``) spelt out in Prometheus's base unit (``*_seconds``, its value divided
by 1e9), and ``_total`` after a counter's name.  So ``disk_write_ns`` is
``pegaflow_disk_write_seconds_total`` and ``pool_pin_ns`` ``pegaflow_pool_pin_seconds``;
``promtool check metrics`` passes on them.  ``METRICS`` is that one list, with its help
text.  Also: ``pegaflow_commands_total{opcode}`` and ``pegaflow_errors_total{status}`` (the
keys ``commands`` and ``errors``, by label), ``pegaflow_latency_seconds{opcode}`` (a
histogram of the engine's receipt-to-answer time of LOOKUP, LOAD and SAVE),
``pegaflow_start_time_seconds`` (``start_ns``), ``pegaflow_build_info{version,
wire_version}``, and ``pegaflow_up``: 1 while the engine runs and beats its heartbeat
(``heartbeat_ns``; 0, and nothing else, while it does not: down, stopped or stuck).  Every
series has an ``engine`` label.  Read-only: the exporter never attaches to the engine as a
client.
"""

from __future__ import annotations

import logging

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from pegaflow.platform.errors import EngineNotRunningError, PegaflowError
from pegaflow.platform.values import package_version
from pegaflow.platform.wire import WIRE_VERSION
from pegaflow.stats.engine_stats import STALE_AFTER_S, read_stats

logger = logging.getLogger(__name__)

# JSON key -> (is a counter, help)
METRICS = {
    "blocks_saved": (True, "KV blocks stored into the pool by SAVEs"),
    "bytes_saved": (True, "bytes of KV copied into the pool by SAVEs"),
    "blocks_loaded": (True, "KV blocks copied from the pool to a client by LOADs"),
    "bytes_loaded": (True, "bytes of KV copied from the pool by LOADs"),
    "save_dedup_blocks": (True, "blocks a SAVE offered that the pool held already (or had on their way)"),
    "save_dropped_blocks": (True, "blocks a SAVE offered that the pool could not take (full of pinned blocks)"),
    "save_votes": (True, "blocks a voter's SAVE vouched for without copying them (one stored copy "
                         "of KV that several TP ranks compute alike, e.g. MLA's)"),
    "save_vote_conflicts": (True, "blocks a SAVE left alone: a copy of another step or request "
                                  "was waiting for its votes (a miss, never a wrong byte)"),
    "lookups": (True, "LOOKUP commands answered"),
    "lookup_blocks": (True, "blocks asked for by LOOKUPs"),
    "lookup_hit_blocks": (True, "blocks LOOKUPs found (the prefix served from the pool)"),
    "evictions": (True, "blocks evicted to make room for new ones"),
    "lease_expiries": (True, "lookup leases that expired unused (their blocks unpinned)"),
    "pool_bytes_used": (False, "bytes of the pool holding KV blocks"),
    "pool_bytes_capacity": (False, "bytes of the pool"),
    "pool_bytes_ready": (False, "bytes of the pool pinned and in use (below the capacity while "
                                "the engine pins the rest in the background)"),
    "pool_pin_ns": (False, "seconds pinning the whole pool took (0 until it is done)"),
    "pool_blocks_used": (False, "KV blocks the pool holds"),
    "leases_active": (False, "lookup leases pinning blocks for a coming LOAD"),
    "clients_attached": (False, "client slots in use (a vLLM scheduler or worker each)"),
    "inflight_copies": (False, "SAVE and LOAD copies in flight on the backend"),
    "clients_refused": (True, "slot claims refused and clients closed for values they wrote into shared "
                              "memory (a pid not theirs, a slot state rewritten, no ATTACH in time)"),
    "disk_bytes_used": (False, "bytes of KV blocks the disk tier holds"),
    "disk_bytes_capacity": (False, "bytes the disk tier may hold (all its paths; 0: no disk tier)"),
    "disk_blocks_used": (False, "KV blocks the disk tier holds"),
    "disk_blocks_written": (True, "blocks written from the pool to the disk tier"),
    "disk_bytes_written": (True, "bytes written to the disk tier"),
    "disk_write_ns": (True, "seconds the disk tier's threads spent writing (summed over threads)"),
    "disk_blocks_read": (True, "blocks read back from the disk tier into the pool (promoted)"),
    "disk_bytes_read": (True, "bytes read from the disk tier"),
    "disk_read_ns": (True, "seconds the disk tier's threads spent reading (summed over threads)"),
    "disk_checksum_failures": (True, "disk blocks found corrupt (checksum or key): dropped, served as misses"),
    "disk_io_errors": (True, "disk tier reads and writes that failed (a miss; the block stays in the pool)"),
    "disk_writes_refused": (True, "blocks the disk tier had no room for"),
    "disk_evictions": (True, "blocks evicted from the disk tier to make room"),
    "lookup_disk_blocks": (True, "blocks LOOKUPs found on disk (read into the pool for the LOAD)"),
    "disk_late_loads": (True, "LOADs answered MISSING_BLOCK after waiting too long for disk reads"),
    "remote_enabled": (False, "1 with a remote tier (--remote), else 0"),
    "remote_blocks_put": (True, "blocks published from the pool to the remote store"),
    "remote_bytes_put": (True, "bytes published to the remote store"),
    "remote_put_ns": (True, "seconds spent publishing to the remote store (summed over batches)"),
    "remote_put_failures": (True, "blocks the remote store refused or failed to take"),
    "remote_puts_dropped": (True, "blocks not published: the remote tier's queue was full"),
    "remote_lookups": (True, "LOOKUPs whose local prefix ended short and asked the remote store"),
    "remote_lookup_ns": (True, "seconds of the remote store's answers to those LOOKUPs (summed)"),
    "lookup_remote_blocks": (True, "blocks LOOKUPs found in the remote store (fetched into the pool)"),
    "remote_blocks_fetched": (True, "blocks fetched from the remote store, checked and READY"),
    "remote_bytes_fetched": (True, "bytes fetched from the remote store"),
    "remote_fetch_ns": (True, "seconds spent fetching from the remote store (summed over batches)"),
    "remote_fetch_failures": (True, "blocks that could not be fetched (gone mid-fetch, store errors): misses"),
    "remote_checksum_failures": (True, "fetched blocks whose length or checksum was wrong: misses, never served"),
    "remote_lookup_timeouts": (True, "LOOKUPs answered without the remote store: it was slow or unreachable"),
    "remote_errors": (True, "remote store calls that failed (unreachable master, RPC errors)"),
    "lookup_waits": (True, "LOOKUPs that waited for blocks other clients were still saving"),
    "lookup_wait_blocks": (True, "blocks those LOOKUPs were served because they waited"),
    "lookup_wait_timeouts": (True, "waiting LOOKUPs answered at --lookup-wait-ms with the READY part"),
    "lookup_wait_ns": (True, "seconds LOOKUPs waited for saves in flight (summed)"),
    "lookup_waits_refused": (True, "LOOKUPs not let wait (too many waiting): answered at once with the READY part"),
    "claims": (True, "compute once: claims made on blocks a vLLM was about to compute"),
    "claim_blocks": (True, "blocks those claims named"),
    "claim_waits": (True, "LOOKUPs that waited for blocks another vLLM claimed"),
    "claim_wait_blocks": (True, "blocks those LOOKUPs were served because they waited (not computed again)"),
    "claim_tokens_saved": (True, "prompt tokens those blocks hold: prefill computed once instead of twice"),
    "claim_wait_ns": (True, "seconds LOOKUPs waited for other vLLMs' claims (summed)"),
    "claim_declines": (True, "LOOKUPs that reached a claim and computed instead: the wait looked longer"),
    "claim_timeouts": (True, "claims past their deadline before their blocks were saved"),
    "claims_dropped": (True, "claims ended unsaved: claimer gone, request aborted or preempted, save failed"),
    "resets": (True, "RESETs: a namespace's cache emptied (vLLM's reset_prefix_cache with reset_external)"),
    "reset_blocks_dropped": (True, "pool blocks RESETs dropped"),
    "reset_blocks_held": (True, "of those, blocks in use then (leased or being copied): freed when let go"),
    "reset_disk_blocks_dropped": (True, "disk tier blocks RESETs removed"),
}


NS_SUFFIX = "_ns"  # a JSON key's unit: nanoseconds, exported as seconds


def metric_name(key: str) -> str:
    """The exported name of JSON key ``key``: ``disk_write_ns`` -> ``pegaflow_disk_write_seconds_total``."""
    is_counter, _ = METRICS[key]
    base = key.removesuffix(NS_SUFFIX) + "_seconds" if key.endswith(NS_SUFFIX) else key
    return f"pegaflow_{base}_total" if is_counter else f"pegaflow_{base}"


def metric_value(key: str, value: int) -> float:
    """JSON key ``key``'s value in its metric's unit (nanoseconds become seconds)."""
    return value / 1e9 if key.endswith(NS_SUFFIX) else value


class EngineCollector(Collector):
    def __init__(self, engine_name: str, stale_after_s: float = STALE_AFTER_S):
        self.engine_name = engine_name
        self.stale_after_s = stale_after_s  # a heartbeat older than this: not responding, down

    def collect(self):
        up = GaugeMetricFamily("pegaflow_up", "1 while the engine runs and answers", labels=["engine"])
        try:
            stats = read_stats(self.engine_name, self.stale_after_s)
        except EngineNotRunningError:
            stats = None
        except PegaflowError as exc:  # unreadable (permissions, another wire layout): down
            logger.warning("metrics of engine %r: %s", self.engine_name, exc)
            stats = None
        is_up = stats is not None and stats["alive"] and stats["responding"] and not stats["starting"]
        up.add_metric([self.engine_name], 1.0 if is_up else 0.0)
        yield up
        labels = [self.engine_name]
        info = GaugeMetricFamily("pegaflow_build_info", "the exporter's release and wire protocol",
                                 labels=["engine", "version", "wire_version"])
        info.add_metric(labels + [package_version(), str(WIRE_VERSION)], 1.0)
        yield info
        if not is_up:
            return
        for key, (is_counter, text) in METRICS.items():
            family_type = CounterMetricFamily if is_counter else GaugeMetricFamily
            family = family_type(metric_name(key).removesuffix("_total"), text, labels=["engine"])
            family.add_metric(labels, metric_value(key, stats[key]))
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
        latency = HistogramMetricFamily(
            "pegaflow_latency_seconds", "engine time from a command's receipt to its answer, by opcode",
            labels=["engine", "opcode"])
        for opcode, histogram in stats["latency"].items():
            cumulative, buckets = 0, []
            for bound, count in zip([*histogram["buckets_s"], float("inf")], histogram["counts"]):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            latency.add_metric(labels + [opcode], buckets, histogram["sum_s"])
        yield latency
        start = GaugeMetricFamily("pegaflow_start_time_seconds", "when the engine started (Unix time)",
                                  labels=["engine"])
        start.add_metric(labels, stats["start_ns"] / 1e9)
        yield start
