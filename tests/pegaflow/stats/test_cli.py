"""pegaflow-stat against a live engine, a crashed one, and a reader that goes away."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import readline_within

ROOT = Path(__file__).resolve().parents[3]


def _stat(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pegaflow.stats.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=30)


def test_stat_cli_crashed_engine_is_reported_dead_not_running(engine_factory):
    # 1. A live engine: its snapshot says alive.
    engine = engine_factory()
    live = _stat("--once", "--json", "--name", engine.name)
    assert live.returncode == 0 and json.loads(live.stdout)["alive"] is True
    # 2. It dies by SIGKILL, leaving its segments: the text view fails with the reason...
    engine.is_clean_exit_expected = False
    engine.stop(signal.SIGKILL)
    once = _stat("--once", "--name", engine.name)
    assert once.returncode == 1 and "is not running" in once.stderr and "crash" in once.stderr
    assert f"pegaflow-engine --clean {engine.name}" in once.stderr  # the way to remove it
    # 3. ...and the JSON view still shows the last counters, with alive false and exit 1.
    dead = _stat("--once", "--json", "--name", engine.name)
    assert dead.returncode == 1 and json.loads(dead.stdout)["alive"] is False
    # 4. (teardown) a new engine under the name would remove the leftovers; do it here.
    engine_factory(engine.name)


def test_stat_cli_live_view_into_a_closed_pipe_exits_quietly(engine):
    # 1. `pegaflow-stat | head -1`: the reader leaves after one line.
    proc = subprocess.Popen([sys.executable, "-m", "pegaflow.stats.cli", "--name", engine.name,
                             "--interval", "0.05"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert readline_within(proc)
    proc.stdout.close()
    # 2. Its next line meets the closed pipe: exit 0, no traceback.
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "Traceback" not in stderr, stderr


def test_stat_cli_engine_still_preparing_its_pool_is_starting_not_dead():
    # 1. The stats segment exists, its engine_pid not written yet (the pool is being
    #    pre-touched): alive and starting, exit 0.
    from pegaflow.platform import shm
    from pegaflow.platform.wire import STATS
    name = f"t{os.getpid()}_starting"
    segment = shm.create_segment(shm.ipc_name(name, "stats"), STATS.itemsize)
    try:
        snapshot = _stat("--once", "--json", "--name", name)
        assert snapshot.returncode == 0, snapshot.stderr
        assert json.loads(snapshot.stdout)["starting"] is True
        once = _stat("--once", "--name", name)
        assert once.returncode == 0 and "is starting" in once.stdout
    finally:
        segment.close()
        segment.unlink()


def test_stat_cli_engine_that_died_while_starting_is_dead_not_starting():
    # 1. Stats without a pid (the pool was being prepared) and a control header naming a
    #    process that has exited (killed while pre-touching its pool, say).
    from pegaflow.platform import shm
    from pegaflow.platform.wire import CONTROL_HEADER, STATS
    name = f"t{os.getpid()}_diedstarting"
    stats = shm.create_segment(shm.ipc_name(name, "stats"), STATS.itemsize)
    control = shm.create_segment(shm.ipc_name(name, "control"), CONTROL_HEADER.itemsize)
    control.array(CONTROL_HEADER, 1)["engine_pid"] = _exited_pid()
    try:
        # 2. Reported dead, exit 1, not "starting" forever.
        once = _stat("--once", "--name", name)
        assert once.returncode == 1 and "is not running" in once.stderr
        dead = _stat("--once", "--json", "--name", name)
        assert dead.returncode == 1 and json.loads(dead.stdout)["alive"] is False
    finally:
        for segment in (stats, control):
            segment.close()
            segment.unlink()


def _exited_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stat_cli_stopped_engine_that_kept_its_pool_says_how_many_blocks(engine_factory, rng):
    # 1. An engine that keeps its pool stores 3 blocks and stops.
    from tests.engine.conftest import KVClient
    engine = engine_factory(extra=("--keep-pool",))
    client = KVClient(engine.name)
    try:
        client.store(rng, 4, [1, 2, 3])
    finally:
        client.close()
    assert engine.stop() == 0
    # 2. No engine runs; the message says what the kept pool holds.
    once = _stat("--once", "--name", engine.name)
    assert once.returncode == 1 and "no engine named" in once.stderr
    assert "the pool it kept holds 3 blocks" in once.stderr
    # 3. (teardown) an engine without --keep-pool removes the kept pool.
    engine_factory(engine.name)


@pytest.mark.parametrize("argv, says", [
    (["--name", "bad.name", "--once"], "engine name"),
    (["--interval", "-1"], "--interval"),
    (["--interval", "0"], "--interval"),  # would spin
    (["--serve-metrics", "127.0.0.1:99999"], "0..65535"),
    (["--serve-metrics", "nine"], "0..65535"),
    (["--stale-after", "0"], "--stale-after"),
    (["--stale-after", "nan"], "--stale-after"),
    (["--stale-after", "inf"], "--stale-after"),
    (["--stale-after", "1e300"], "--stale-after"),
    (["--interval", "nan"], "--interval"),
    (["--interval", "1e300"], "--interval"),
    (["--interval", "soon"], "--interval"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_stat_cli_mistake_is_one_line_and_exit_2(argv, says):
    # A mistake on the command line: one line on stderr naming it, exit 2, no traceback.
    done = _stat(*argv)
    assert done.returncode == 2, done.stderr
    assert says in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_stat_cli_help_is_tidy():
    # 1. No RST markup, no empty default; each default said once, where it has one.
    done = _stat("--help")
    assert done.returncode == 0 and "``" not in done.stdout and "default )" not in done.stdout
    assert "a read-only view of a running engine's counters" in done.stdout


def test_stat_cli_version_names_the_release_and_the_wire_protocol():
    import pegaflow
    from pegaflow.platform.wire import WIRE_VERSION
    done = _stat("--version")
    assert done.returncode == 0
    assert done.stdout.strip() == f"pegaflow-stat {pegaflow.__version__} (wire protocol v{WIRE_VERSION})"


@pytest.mark.parametrize("stale_after", ["nan", "inf", "-1", "0", "1e300"])
def test_stat_cli_serve_metrics_refuses_a_bad_stale_after(monkeypatch, capsys, stale_after):
    # --serve-metrics checks --stale-after as the other modes do: one line, exit 2, never serving.
    from pegaflow.stats import cli as stat_cli
    served = []
    monkeypatch.setattr(stat_cli, "serve_metrics", lambda *args: served.append(args) or 0)
    with pytest.raises(SystemExit) as info:
        stat_cli.main(["--serve-metrics", "127.0.0.1:0", "--stale-after", stale_after])
    assert info.value.code == 2 and served == []
    assert "--stale-after" in capsys.readouterr().err


def test_stat_cli_serve_metrics_is_given_the_stale_after(monkeypatch):
    from pegaflow.stats import cli as stat_cli
    served = []
    monkeypatch.setattr(stat_cli, "serve_metrics", lambda *args: served.append(args) or 0)
    assert stat_cli.main(["--name", "x", "--serve-metrics", "127.0.0.1:0", "--stale-after", "3"]) == 0
    assert served == [("x", "127.0.0.1:0", 3.0)]


def _wait_heartbeat_older_than(name: str, age_s: float) -> None:
    """Until engine ``name``'s last heartbeat is older than ``age_s`` (it is stopped)."""
    from pegaflow.stats.engine_stats import read_stats
    deadline = time.monotonic() + age_s + 60.0
    while read_stats(name)["heartbeat_age_s"] <= age_s:
        if time.monotonic() >= deadline:
            pytest.fail(f"engine {name}: heartbeat never older than {age_s}s")
        time.sleep(0.1)


def test_stat_cli_stopped_engine_is_not_responding_and_exits_3(engine):
    # 1. A live engine answers with exit 0.
    assert _stat("--name", engine.name, "--once").returncode == 0
    # 2. SIGSTOPped: its process is there, and once its heartbeat is older than the
    #    --stale-after given, it is not responding.
    os.kill(engine.pid, signal.SIGSTOP)
    try:
        _wait_heartbeat_older_than(engine.name, 1.0)
        done = _stat("--name", engine.name, "--once", "--stale-after", "1")
        assert done.returncode == 3 and "not responding" in done.stderr, done.stderr
        snapshot = _stat("--name", engine.name, "--once", "--json", "--stale-after", "1")
        assert snapshot.returncode == 3
        assert json.loads(snapshot.stdout)["responding"] is False
    finally:
        os.kill(engine.pid, signal.SIGCONT)
    # 3. Resumed, it beats again (its next beat within 2.5 s; waited for far longer).
    deadline = time.monotonic() + 60
    while _stat("--name", engine.name, "--once", "--stale-after", "4").returncode != 0:
        if time.monotonic() >= deadline:
            pytest.fail("the resumed engine never answered pegaflow-stat")


def test_stat_cli_detached_client_leaves_the_list_at_once(engine):
    # A client that DETACHed is no longer listed, though the engine frees its slot only at
    # its next housekeeping (up to a second later).
    from pegaflow.stats.engine_stats import read_stats
    client = engine.connect()
    slot = client.slot
    assert slot in {c["slot"] for c in read_stats(engine.name)["clients"]}
    client.close()
    assert slot not in {c["slot"] for c in read_stats(engine.name)["clients"]}


def test_stat_cli_latency_quantile_is_the_bucket_bound_that_covers_it():
    from pegaflow.stats.engine_stats import latency_quantile
    histogram = {"buckets_s": [0.001, 0.01, 0.1], "counts": [50, 40, 9, 1]}
    assert latency_quantile(histogram, 0.5) == 0.001 and latency_quantile(histogram, 0.9) == 0.01
    assert latency_quantile(histogram, 0.99) == 0.1 and latency_quantile(histogram, 1.0) == float("inf")
    assert latency_quantile({"buckets_s": [0.001], "counts": [0, 0]}, 0.5) is None


def test_stat_cli_once_shows_how_fast_lookups_were_answered(engine):
    client = engine.connect()
    try:
        client.lookup(1, [os.urandom(32)])
    finally:
        client.close()
    once = _stat("--once", "--name", engine.name)
    assert once.returncode == 0 and "answered within" in once.stdout and "lookup p50" in once.stdout


def test_stat_cli_remote_line_only_with_a_remote_tier():
    from pegaflow.platform.wire import STATS_COUNTER_NAMES
    from pegaflow.stats.cli import remote_lines
    stats = dict.fromkeys(STATS_COUNTER_NAMES, 0)
    assert remote_lines(stats) == []
    stats.update(remote_enabled=1, remote_blocks_put=10, remote_bytes_put=10 << 21, remote_put_ns=10**7,
                 remote_lookups=2, remote_lookup_ns=4 * 10**6, lookup_remote_blocks=8, remote_checksum_failures=1)
    [line] = remote_lines(stats)
    assert line.startswith("remote  put 10") and "2 lookups asked it (mean 2.0 ms)" in line and "1 corrupt" in line


def test_stat_cli_claims_line_once_a_claim_was_made():
    from pegaflow.platform.wire import STATS_COUNTER_NAMES
    from pegaflow.stats.cli import claim_lines
    stats = dict.fromkeys(STATS_COUNTER_NAMES, 0)
    assert claim_lines(stats) == []
    stats.update(claims=3, claim_blocks=24, claim_waits=2, claim_wait_ns=5 * 10**8, claim_wait_blocks=16,
                 claim_tokens_saved=256, claim_declines=1)
    [line] = claim_lines(stats)
    assert line.startswith("claims  3 (24 blocks); 2 lookups waited 0.5 s") and "(256 tokens not" in line
    assert "1 declined" in line


def test_stat_cli_resets_line_once_a_reset_came():
    from pegaflow.platform.wire import STATS_COUNTER_NAMES
    from pegaflow.stats.cli import reset_lines
    stats = dict.fromkeys(STATS_COUNTER_NAMES, 0)
    assert reset_lines(stats) == []
    stats.update(resets=2, reset_blocks_dropped=40, reset_blocks_held=3, reset_disk_blocks_dropped=7)
    assert reset_lines(stats) == ["resets  2: 40 pool blocks dropped (3 in use then, freed when let go), "
                                  "7 disk blocks"]


def test_stat_cli_client_list_shows_each_kv_role(engine):
    # A prefill vLLM's worker and a decode vLLM's scheduler say their kv_role at ATTACH;
    # the client list (JSON and text) shows it beside their role.
    from pegaflow.client.connection import EngineClient
    from pegaflow.platform.wire import ClientRole, KvRole, attach_role
    producer = EngineClient.connect(engine.name, role=attach_role(ClientRole.WORKER, KvRole.PRODUCER))
    consumer = EngineClient.connect(engine.name, role=attach_role(ClientRole.SCHEDULER, KvRole.CONSUMER))
    plain = engine.connect()
    try:
        listed = {c["slot"]: (c["role"], c["kv_role"]) for c in json.loads(
            _stat("--once", "--json", "--name", engine.name).stdout)["clients"]}
        assert listed == {producer.slot: ("worker", "kv_producer"), consumer.slot: ("scheduler", "kv_consumer"),
                          plain.slot: ("other", "kv_both")}
        text = _stat("--once", "--name", engine.name).stdout
        assert "kv_role" in text and "kv_producer" in text and "kv_consumer" in text
    finally:
        for client in (producer, consumer, plain):
            client.close()


def _line_with(proc: subprocess.Popen, text: str, max_lines: int = 200) -> str:
    """The live view's first line (of the next ``max_lines``) that contains ``text``."""
    for _ in range(max_lines):
        line = readline_within(proc, 60)
        if text in line:
            return line
        assert line, f"the live view ended before saying {text!r}"
    pytest.fail(f"no line with {text!r} in {max_lines} lines")


def test_stat_cli_live_view_waits_for_a_stopped_engine_and_goes_on(engine_factory):
    # 1. The live view of a running engine: a header, then a row.
    engine = engine_factory()
    proc = subprocess.Popen([sys.executable, "-m", "pegaflow.stats.cli", "--name", engine.name,
                             "--interval", "0.05"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        _line_with(proc, "saved blk/s")
        # 2. The engine stops: the view says so once, and waits instead of exiting.
        assert engine.stop() == 0
        waiting = _line_with(proc, "not running")
        assert f"engine {engine.name!r} not running, waiting..." in waiting
        assert proc.poll() is None
        # 3. An engine of that name starts again: the view goes on, header and rows.
        engine_factory(engine.name)
        _line_with(proc, "saved blk/s")
        assert readline_within(proc, 60).split()[1:3] == ["0", "B"]  # its pool: nothing used yet
    finally:
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    # 4. Ctrl-C ends it quietly.
    assert proc.returncode == 0 and "Traceback" not in stderr, stderr


def test_stat_cli_live_view_columns_say_blocks_and_the_pool_in_human_units(engine, rng):
    # 1. 1 MiB of the pool used: a client saves 16 blocks of 64 KiB.
    from pegaflow.client.connection import EngineClient
    from pegaflow.client.host_memory import HostKVBuffer, layer_major_records
    client = EngineClient.connect(engine.name)
    kv = HostKVBuffer(16 * 65536, "statunits")
    try:
        client.register_region(0, kv.region_record(16, 65536, 1), layer_major_records(1, 16, 65536))
        hashes = [rng.bytes(32) for _ in range(16)]
        assert client.wait(client.submit_save(7, list(range(16)), hashes)).value == 16
        engine.wait_stats(lambda s: s["pool_bytes_used"] == 1 << 20)
        # 2. The live view: rates of blocks, named so; the pool used as 1.0 MiB, not 0.00 GiB.
        proc = subprocess.Popen([sys.executable, "-m", "pegaflow.stats.cli", "--name", engine.name,
                                 "--interval", "0.05"], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            header, row = readline_within(proc), readline_within(proc)
        finally:
            proc.kill()
            proc.communicate(timeout=30)
    finally:
        client.close()
        kv.close()
    for label in ("saved blk/s", "loaded blk/s", "hit blk/s", "evicted blk/s", "lookups/s"):
        assert label in header, header
    assert row.split()[1:3] == ["1.0", "MiB"], row


def test_stat_cli_live_view_of_no_engine_waits_for_one():
    name = f"t{os.getpid()}_notyet"
    proc = subprocess.Popen([sys.executable, "-m", "pegaflow.stats.cli", "--name", name, "--interval", "0.05"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        assert f"engine {name!r} not running, waiting..." in readline_within(proc)
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
    assert proc.returncode == 0


def test_stat_cli_live_view_says_once_that_a_stopped_engine_does_not_respond_then_goes_on(engine):
    proc = subprocess.Popen([sys.executable, "-m", "pegaflow.stats.cli", "--name", engine.name,
                             "--interval", "0.05", "--stale-after", "1"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        _line_with(proc, "saved blk/s")
        # 1. SIGSTOPped: once its heartbeat is a second old, the view says so, and waits.
        os.kill(engine.pid, signal.SIGSTOP)
        try:
            assert "is not responding" in _line_with(proc, "not responding")
            _wait_heartbeat_older_than(engine.name, 4.0)  # its age grows meanwhile
        finally:
            os.kill(engine.pid, signal.SIGCONT)
        # 2. Resumed: the next line is the header again (the wait was said once, not each second).
        assert "saved blk/s" in readline_within(proc, 60)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
    assert proc.returncode == 0


def test_stat_cli_live_view_of_an_engine_whose_stats_are_not_yet_written_prints_one_header(engine, monkeypatch,
                                                                                            capsys):
    # 1. What an engine shows in the moment it starts: its stats zeroed, start_ns not yet set;
    #    then its first written snapshot, then another.
    from pegaflow.stats import cli
    from pegaflow.stats.engine_stats import read_stats
    written = read_stats(engine.name)
    snapshots = iter([written | {"start_ns": 0}, written, written])

    def read_live(name, stale_after_s):
        try:
            return next(snapshots)
        except StopIteration:
            raise KeyboardInterrupt from None
    monkeypatch.setattr(cli, "_read_live", read_live)
    monkeypatch.setattr(cli.time, "sleep", lambda s: None)
    # 2. One header, then a row: the unwritten snapshot is no engine of its own.
    with pytest.raises(KeyboardInterrupt):
        cli.live(engine.name, 0.01)
    lines = capsys.readouterr().out.splitlines()
    assert [("saved blk/s" in line) for line in lines] == [True, False]
