"""pegaflow.stats.metrics and ``pegaflow-stat --serve-metrics``: the engine's stats for Prometheus."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pegaflow.stats.engine_stats import read_stats
from pegaflow.stats.metrics import EngineCollector
from tests.conftest import readline_within

ROOT = Path(__file__).resolve().parents[3]


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
    assert samples[("pegaflow_pool_bytes_capacity", engine_label)] == 64 << 20
    assert samples[("pegaflow_blocks_saved_total", engine_label)] == 0
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
    assert {k: v for k, v in samples.items() if k[0] != "pegaflow_build_info"} == {
        ("pegaflow_up", (("engine", name),)): 0.0}


def test_metrics_names_are_the_json_keys_with_their_own_help(engine):
    # 1. Every counter and gauge is pegaflow_ + the key pegaflow-stat --json shows, with a
    #    help text of its own (not the key spelt out).
    from pegaflow.stats.engine_stats import read_stats
    from pegaflow.stats.metrics import METRICS, metric_name
    snapshot = read_stats(engine.name)
    families = {f.name: f for f in text_string_to_metric_families(_scrape(engine.name))}
    for key, (is_counter, _) in METRICS.items():
        name = metric_name(key).removesuffix("_total") if is_counter else metric_name(key)
        assert is_counter or not name.endswith("_total"), key  # Prometheus: _total is a counter's
        assert key in snapshot and name in families, key
        assert families[name].type == ("counter" if is_counter else "gauge")
        assert families[name].documentation not in ("", key.replace("_", " ")), key
        assert "nanosecond" not in families[name].documentation, key  # its value is seconds
    # 2. The start time is a timestamp (the convention), and the build is named.
    assert abs(families["pegaflow_start_time_seconds"].samples[0].value - snapshot["start_ns"] / 1e9) < 1e-3
    import pegaflow
    from pegaflow.platform.wire import WIRE_VERSION
    info = families["pegaflow_build_info"].samples[0]
    assert info.labels["version"] == pegaflow.__version__ and info.labels["wire_version"] == str(WIRE_VERSION)


def test_metrics_name_rule_spells_nanoseconds_out_as_seconds():
    # 1. One rule from JSON key to metric: pegaflow_ + key, _ns as _seconds, _total on counters.
    from pegaflow.stats.metrics import METRICS, metric_name, metric_value
    assert metric_name("disk_write_ns") == "pegaflow_disk_write_seconds_total"
    assert metric_name("pool_pin_ns") == "pegaflow_pool_pin_seconds"
    assert metric_name("blocks_saved") == "pegaflow_blocks_saved_total"
    assert metric_name("pool_bytes_used") == "pegaflow_pool_bytes_used"
    assert metric_value("remote_put_ns", 1_500_000_000) == 1.5 and metric_value("lookups", 7) == 7
    # 2. No name keeps an abbreviated unit, and every time the engine counts is exported.
    from pegaflow.platform.wire import STATS_COUNTER_NAMES
    assert not [key for key in METRICS if "_ns" in metric_name(key)]
    exported_elsewhere = {"engine_pid", "start_ns", "heartbeat_ns", "commands", "errors"}
    assert set(STATS_COUNTER_NAMES) - set(METRICS) == exported_elsewhere


def test_metrics_times_are_seconds_of_the_json_nanoseconds(engine):
    # 1. Once the pool is pinned, pool_pin_ns is set: its metric is the same time in seconds.
    snapshot = engine.wait_stats(lambda s: s["pool_pin_ns"] > 0, 30.0)
    samples = _samples(_scrape(engine.name))
    assert samples[("pegaflow_pool_pin_seconds", (("engine", engine.name),))] == snapshot["pool_pin_ns"] / 1e9


def test_metrics_latency_histogram_counts_each_lookup(engine):
    # 1. Three LOOKUPs answered: the lookup histogram counts three, its buckets cumulative,
    #    its sum positive; LOAD and SAVE have none.
    client = engine.connect()
    try:
        for _ in range(3):
            client.lookup(1, [os.urandom(32) for _ in range(4)])
    finally:
        client.close()
    samples = _samples(_scrape(engine.name))

    def sample(suffix, opcode, **extra):
        labels = {"engine": engine.name, "opcode": opcode, **extra}
        return samples[(f"pegaflow_latency_seconds{suffix}", tuple(sorted(labels.items())))]

    assert sample("_count", "lookup") == 3 and sample("_bucket", "lookup", le="+Inf") == 3
    assert 0 < sample("_sum", "lookup") < 3.0
    assert sample("_bucket", "lookup", le="2.5e-05") <= sample("_bucket", "lookup", le="0.001") <= 3
    assert sample("_count", "load") == sample("_count", "save") == 0


def _serve_and_scrape(engine_name: str) -> str:
    """``pegaflow-stat --serve-metrics`` on an ephemeral port, scraped once over HTTP."""
    proc = subprocess.Popen([sys.executable, "-m", "pegaflow.stats.cli", "--name", engine_name,
                             "--serve-metrics", "127.0.0.1:0"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        # 1. The exporter says where it serves.
        line = readline_within(proc)
        assert "/metrics" in line, proc.stderr.read() if proc.poll() is not None else line
        url = line.split(" at ", 1)[1].strip()
        # 2. A scrape returns the engine's metrics.
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.read().decode()
    finally:
        proc.terminate()
        proc.wait(10)


def test_stat_cli_serves_metrics_over_http(engine):
    body = _serve_and_scrape(engine.name)
    assert f'pegaflow_up{{engine="{engine.name}"}} 1.0' in body


def _promtool() -> str:
    found = shutil.which("promtool") or shutil.which("promtool", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip("promtool not found (on PATH or beside this Python): `make test` puts it in the "
                    "venv from Debian's prometheus package, or apt-get install prometheus")
    return found


def test_stat_cli_metrics_pass_promtool_check(engine):
    # 1. An engine that has saved, looked up and loaded (the smoke check): every family has samples.
    from pegaflow.smoke import run
    assert run(engine.name) is None
    engine.wait_stats(lambda s: s["pool_pin_ns"] > 0, 30.0)
    body = _serve_and_scrape(engine.name)
    assert "pegaflow_pool_pin_seconds" in body and "pegaflow_latency_seconds_bucket" in body
    # 2. Prometheus's own linter finds nothing: units spelt out, _total on counters only.
    check = subprocess.run([_promtool(), "check", "metrics"], input=body, capture_output=True, text=True,
                           timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def test_promtool_check_fails_on_an_abbreviated_unit():
    # The check above can fail: promtool refuses the names this exporter once had.
    bad = ('# HELP pegaflow_disk_write_ns_total time\n# TYPE pegaflow_disk_write_ns_total counter\n'
           'pegaflow_disk_write_ns_total{engine="x"} 5.0\n')
    check = subprocess.run([_promtool(), "check", "metrics"], input=bad, capture_output=True, text=True,
                           timeout=60)
    assert check.returncode != 0 and "abbreviated units" in check.stdout + check.stderr


def test_metrics_operations_page_lists_every_name_by_the_rule():
    # docs/operations.md's table of JSON keys and metric names cannot drift from the code.
    from pegaflow.stats.metrics import METRICS, metric_name
    page = (ROOT / "docs" / "operations.md").read_text()
    for key, (is_counter, _) in METRICS.items():
        kind = "counter" if is_counter else "gauge"
        assert f"| `{key}` | `{metric_name(key)}` | {kind} |" in page, key


def test_metrics_stopped_engine_is_down_past_the_stale_after_given(engine):
    # 1. SIGSTOPped: once its heartbeat is older than the exporter's --stale-after, it is
    #    down (pegaflow_up 0, nothing else), though its process is there.
    engine.wait_stats(lambda s: s["heartbeat_ns"] > 0, 30.0)  # it has beaten once
    os.kill(engine.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 60.0
        while read_stats(engine.name)["heartbeat_age_s"] <= 1.0:
            if time.monotonic() >= deadline:
                pytest.fail("the stopped engine's heartbeat never aged")
            time.sleep(0.1)
        registry = CollectorRegistry()
        registry.register(EngineCollector(engine.name, stale_after_s=1.0))
        samples = _samples(generate_latest(registry).decode())
        assert samples[("pegaflow_up", (("engine", engine.name),))] == 0.0
        assert not any(name.startswith("pegaflow_commands") for name, _ in samples)
    finally:
        os.kill(engine.pid, signal.SIGCONT)
