"""pegaflow's figures in vLLM's own metrics: what each side of the connector did since
vLLM last asked, through vLLM's ``KVConnectorStats`` (summed over the workers of a TP group
and the scheduler), shown in ``vllm serve``'s ``/metrics`` (``PegaPromMetrics``) and in its
periodic "KV Transfer metrics" log line (``reduce``).

``data`` holds plain numbers and lists only: it crosses processes by pickle and msgpack.

| key | side | meaning |
|---|---|---|
| lookups, lookup_tokens, lookup_hit_tokens | scheduler | lookups answered, the tokens they asked for and found |
| lookup_deferrals | scheduler | times a lookup's answer was not in at once and vLLM asked again next step |
| lookup_timeouts | scheduler | lookups past ``lookup_timeout_ms``, served as misses |
| lookup_waits_refused | scheduler | answers given at once, too many LOOKUPs waiting (WAIT_REFUSED): the rest computed |
| load_blocks, loaded_blocks, load_failed_blocks | worker | blocks planned, loaded, and failed (recomputed) |
| saved_blocks, save_dropped_blocks | worker | blocks SAVEs stored, and those the engine could not take |

Block counts are each worker rank's, summed over the TP x PP ranks of an instance (every
rank moves its own shard of a block); token counts are the scheduler's, counted once.
| engine_up_reports, engine_down_reports | both | how many sides found the engine reachable, or not |
| lookup_s, load_s, save_s | both | seconds from a command's submission to its answer, one entry each |
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

COUNTS = ("lookups", "lookup_tokens", "lookup_hit_tokens", "lookup_deferrals", "lookup_timeouts",
          "lookup_waits_refused", "load_blocks", "loaded_blocks", "load_failed_blocks", "saved_blocks",
          "save_dropped_blocks", "engine_up_reports", "engine_down_reports")
LATENCIES = ("lookup_s", "load_s", "save_s")
MAX_SAMPLES = 4096  # latencies kept per interval; the counts stay exact past it


@dataclass
class PegaKVConnectorStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()
        else:  # built from another process's data: fill in what an older sender lacks
            for key in COUNTS:
                self.data.setdefault(key, 0)
            for key in LATENCIES:
                self.data.setdefault(key, [])

    def reset(self) -> None:
        self.data = {**{key: 0 for key in COUNTS}, **{key: [] for key in LATENCIES}}

    def add(self, key: str, amount: int = 1) -> None:
        self.data[key] += amount

    def observe(self, key: str, seconds: float) -> None:
        samples = self.data[key]
        if len(samples) < MAX_SAMPLES:
            samples.append(seconds)

    def engine_seen(self, is_up: bool) -> None:
        self.data["engine_up_reports" if is_up else "engine_down_reports"] = 1

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in COUNTS:
            self.data[key] += other.data.get(key, 0)
        for key in LATENCIES:
            self.data[key] = (self.data[key] + list(other.data.get(key, ())))[:MAX_SAMPLES]
        return self

    def is_empty(self) -> bool:
        return not any(self.data[key] for key in COUNTS) and not any(self.data[k] for k in LATENCIES)

    def take(self, is_engine_up: bool) -> "PegaKVConnectorStats | None":
        """What happened since vLLM last asked (None: nothing, and the engine is there),
        with whether the engine is reachable; the counts start again from zero."""
        if self.is_empty() and is_engine_up:
            return None
        self.engine_seen(is_engine_up)
        return self.clone_and_reset()

    def clone_and_reset(self) -> "PegaKVConnectorStats":
        """A snapshot to hand to vLLM (which may keep the very object), and a fresh start."""
        snapshot = copy.copy(self)
        self.reset()
        return snapshot

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {
            "lookup hit rate": round(d["lookup_hit_tokens"] / d["lookup_tokens"], 3) if d["lookup_tokens"] else 0.0,
            "hit tokens": d["lookup_hit_tokens"],
            "loaded blocks": d["loaded_blocks"],
            "failed load blocks": d["load_failed_blocks"],
            "saved blocks": d["saved_blocks"],
            "lookup timeouts": d["lookup_timeouts"],
            "engine reachable": int(not d["engine_down_reports"]),
        }
        for key in LATENCIES:
            if d[key]:
                samples = sorted(d[key])
                out[f"{key[:-2]} p50 ms"] = round(samples[len(samples) // 2] * 1e3, 3)
                out[f"{key[:-2]} p99 ms"] = round(samples[min(len(samples) - 1, int(len(samples) * 0.99))] * 1e3, 3)
        return out


_BUCKETS_S = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_COUNTERS = {  # metric -> (help, value of a step's data)
    "vllm:pegaflow_lookup_tokens": ("tokens pegaflow was asked to look up", lambda d: d["lookup_tokens"]),
    "vllm:pegaflow_lookup_hit_tokens": ("tokens pegaflow found cached (served from host memory)",
                                        lambda d: d["lookup_hit_tokens"]),
    "vllm:pegaflow_lookup_deferrals": ("lookups whose answer came a step later (the request waited a step)",
                                       lambda d: d["lookup_deferrals"]),
    "vllm:pegaflow_lookup_timeouts": ("lookups past lookup_timeout_ms, served as misses",
                                      lambda d: d["lookup_timeouts"]),
    "vllm:pegaflow_lookup_waits_refused": ("lookups the engine answered at once, too many waiting for saves "
                                           "(the blocks not yet saved are computed)",
                                           lambda d: d["lookup_waits_refused"]),
    "vllm:pegaflow_loaded_blocks": ("KV blocks loaded from pegaflow (per worker rank, summed over ranks)",
                                    lambda d: d["loaded_blocks"]),
    "vllm:pegaflow_load_failed_blocks": ("KV blocks whose load failed and were recomputed (per worker "
                                         "rank, summed over ranks)", lambda d: d["load_failed_blocks"]),
    "vllm:pegaflow_saved_blocks": ("KV blocks stored into pegaflow (per worker rank, summed over ranks)",
                                   lambda d: d["saved_blocks"]),
    "vllm:pegaflow_save_dropped_blocks": ("KV blocks pegaflow could not store, its pool full of pinned "
                                          "blocks (per worker rank, summed over ranks)",
                                          lambda d: d["save_dropped_blocks"]),
}
_HISTOGRAMS = {
    "vllm:pegaflow_lookup_seconds": ("lookup", "lookup_s"),
    "vllm:pegaflow_load_seconds": ("load (to its answer; layer-wise loads are fenced on the GPU)", "load_s"),
    "vllm:pegaflow_save_seconds": ("save (its copy out of GPU memory)", "save_s"),
}


class PegaPromMetrics(KVConnectorPromMetrics):
    """pegaflow's series in vLLM's Prometheus registry, labelled per vLLM engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {name: self._per_engine(self._counter_cls(name=name, documentation=text,
                                                                  labelnames=labelnames))
                         for name, (text, _) in _COUNTERS.items()}
        self.histograms = {
            name: self._per_engine(self._histogram_cls(
                name=name, documentation=f"seconds from a pegaflow {what}'s submission to its answer",
                buckets=list(_BUCKETS_S), labelnames=labelnames))
            for name, (what, _) in _HISTOGRAMS.items()}
        self.engine_up = self._per_engine(self._gauge_cls(
            name="vllm:pegaflow_engine_up", documentation="1 while the pegaflow engine is reachable",
            multiprocess_mode="mostrecent", labelnames=labelnames))

    def _per_engine(self, metric) -> dict[int, Any]:
        return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = PegaKVConnectorStats(data=dict(transfer_stats_data)).data
        for name, (_, value) in _COUNTERS.items():
            if (amount := value(data)) > 0:  # a counter only grows (a malformed report must not raise here)
                self.counters[name][engine_idx].inc(amount)
        for name, (_, key) in _HISTOGRAMS.items():
            for seconds in data[key]:
                self.histograms[name][engine_idx].observe(seconds)
        if data["engine_up_reports"] or data["engine_down_reports"]:
            self.engine_up[engine_idx].set(0 if data["engine_down_reports"] else 1)
