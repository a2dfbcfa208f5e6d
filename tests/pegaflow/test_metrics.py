"""pegaflow.metrics and ``pegaflow-stat --serve-metrics``: the engine's stats for Prometheus."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pegaflow.metrics import EngineCollector
from tests.conftest import readline_within

ROOT = Path(__file__).resolve().parents[2]


def _scrape(name: str) -> str:
    registry = CollectorRegistry()
    registry.register(EngineCollector(name))
    return generate_latest(registry).decode()


def _samples(text: str) -> dict:
    """(sample name, sorted labels) -> value."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_of_a_running_engine_are_its_stats(engine):
    # 1. A running engine: up, its pool size as a gauge, counters with _total, by opcode.
    samples = _samples(_scrape(engine.name))
    engine_label = (("engine", engine.name),)
    ping_label = (("engine", engine.name), ("opcode", "ping"))
    assert samples[("pegaflow_up", engine_label)] == 1.0
    assert samples[("pegaflow_pool_capacity_bytes", engine_label)] == 64 << 20
    assert samples[("pegaflow_saved_blocks_total", engine_label)] == 0
    before = samples[("pegaflow_commands_total", ping_label)]
    # 2. A counter follows the engine: a PING answered shows up at the next scrape.
    client = engine.connect()
    try:
        client.ping()
    finally:
        client.close()
    assert _samples(_scrape(engine.name))[("pegaflow_commands_total", ping_label)] == before + 1


def test_metrics_of_an_absent_engine_say_down_and_nothing_else():
    name = f"t{os.getpid()}_absent"
    samples = _samples(_scrape(name))
    assert samples == {("pegaflow_up", (("engine", name),)): 0.0}


def test_stat_cli_serves_metrics_over_http(engine):
    # 1. The exporter on an ephemeral port says where it serves.
    proc = subprocess.Popen([sys.executable, "-m", "pegaflow.stat_cli", "--name", engine.name,
                             "--serve-metrics", "127.0.0.1:0"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = readline_within(proc)
        assert "/metrics" in line, proc.stderr.read() if proc.poll() is not None else line
        url = line.split(" at ", 1)[1].strip()
        # 2. A scrape returns the engine's metrics.
        with urllib.request.urlopen(url, timeout=10) as response:
            body = response.read().decode()
        assert f'pegaflow_up{{engine="{engine.name}"}} 1.0' in body
    finally:
        proc.terminate()
        proc.wait(10)
