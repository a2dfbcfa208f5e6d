"""tools/lib/serving_setup.py: what a serving bench's configuration runs beside vLLM, with the
engine and the peers' servers faked (no GPU)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

import pegaflow.stats.engine_stats
import tools.engine_process
from tools.lib import peers, serving_setup
from tools.lib.serving_setup import pegaflow_transfer_args, side_processes, vllm_settings


class _FakeEngine:
    made: list[_FakeEngine] = []

    def __init__(self, name, *flags, **kwargs):
        self.name, self.flags, self.kwargs, self.stopped_with = name, flags, kwargs, None
        _FakeEngine.made.append(self)

    def stop(self, timeout_s=None):
        self.stopped_with = timeout_s

    def wait_pool_pinned(self):
        self.pinned = True


@pytest.fixture
def fakes(monkeypatch):
    """The engine, its stats and the peers' servers faked; what each was asked, kept."""
    _FakeEngine.made = []
    sides = []

    @contextlib.contextmanager
    def side_process(plan, log_path):
        sides.append([plan.config, log_path.name, "up"])
        yield
        sides[-1][2] = "stopped"
    monkeypatch.setattr(tools.engine_process, "EngineProcess", _FakeEngine)
    monkeypatch.setattr(pegaflow.stats.engine_stats, "read_stats", lambda name: {
        "blocks_saved": 4, "blocks_loaded": 2, "lookup_hit_blocks": 3, "evictions": 1, "pool_bytes_ready": 9,
        "latency": {"load": {"counts": [1]}}})
    monkeypatch.setattr(peers, "side_process", side_process)
    return sides


def _sides(config: str, tmp_path: Path, **kwargs):
    return side_processes(config, "eng", ["--copy-backend=staged"], 32, tmp_path, "t0",
                          peer_pool_bytes=kwargs.get("peer_pool_bytes", 8 << 30),
                          engine_start_timeout_s=kwargs.get("engine_start_timeout_s", 300))


def test_pegaflow_transfer_args_is_the_connectors_config_in_its_role():
    flag, text = pegaflow_transfer_args("bench7", "kv_producer")
    assert flag == "--kv-transfer-config"
    assert json.loads(text) == {"kv_connector": "PegaKVConnector", "kv_connector_module_path": "pegaflow.connector",
                                "kv_role": "kv_producer", "kv_connector_extra_config": {"engine_name": "bench7"}}
    _, text = pegaflow_transfer_args("bench7", **serving_setup.PEGAFLOW_CONFIGS["pegaflow-async"])
    assert json.loads(text)["kv_role"] == "kv_both"
    assert json.loads(text)["kv_connector_extra_config"] == {"engine_name": "bench7", "load_mode": "async"}


def test_side_processes_pegaflow_starts_an_engine_reads_its_stats_and_stops_it_last(fakes, tmp_path):
    # 1. A fresh engine with the bench's flags and pool, its log beside the run's; no peer.
    with _sides("pegaflow-layerwise", tmp_path, engine_start_timeout_s=600) as sides:
        (engine,) = _FakeEngine.made
        assert engine.name == "eng" and engine.flags == ("--copy-backend=staged",)
        assert engine.kwargs == {"backend": "cuda", "pool_size": "32GiB", "start_timeout_s": 600,
                                 "log_level": "INFO", "stderr_path": tmp_path / "t0.engine.log"}
        assert sides.plan is None and engine.stopped_with is None
        # 2. Its block counters and command latencies, only those the benches record.
        assert sides.engine_stats() == {"blocks_saved": 4, "blocks_loaded": 2, "lookup_hit_blocks": 3,
                                        "evictions": 1, "latency": {"load": {"counts": [1]}}}
    # 3. Stopped on the way out, given a large pool's time.
    assert engine.stopped_with == tools.engine_process.LARGE_POOL_STOP_S and fakes == []


def test_side_processes_pegaflow_hold_is_the_engine_with_hold_saves(fakes, tmp_path):
    # pegaflow-hold: the same connector as pegaflow, its engine started with --hold-saves after the
    # bench's own engine flags (an A/B of the flag in one run of a bench).
    with _sides("pegaflow-hold", tmp_path):
        (engine,) = _FakeEngine.made
        assert engine.flags == ("--copy-backend=staged", "--hold-saves")
    assert serving_setup.PEGAFLOW_CONFIGS["pegaflow-hold"] == serving_setup.PEGAFLOW_CONFIGS["pegaflow"]


def test_side_processes_pegaflow_groups_configurations_add_their_engine_flags(fakes, tmp_path):
    with _sides("pegaflow-hold-groups4", tmp_path):
        (engine,) = _FakeEngine.made
        assert engine.flags == ("--copy-backend=staged", "--hold-saves", "--load-layer-groups=4")
    # Every flag a configuration names is one the engine takes, with the value meant.
    from engine.process.options import config_from_args
    config = config_from_args(serving_setup.ENGINE_FLAGS["pegaflow-hold-groups4"], environ={})
    assert config.hold_saves is True and config.load_layer_groups == 4
    for flags in serving_setup.ENGINE_FLAGS.values():
        config_from_args(flags, environ={})


def test_side_processes_restart_engine_stops_it_and_starts_an_empty_one_under_its_name(fakes, tmp_path):
    with _sides("pegaflow-hold", tmp_path) as sides:
        # 1. The engine stopped (a large pool's time given), a fresh one started with the same
        #    name and flags, its log a file of its own, and waited for until its pool is pinned.
        assert sides.restart_engine() >= 0.0
        first, second = _FakeEngine.made
        assert first.stopped_with == tools.engine_process.LARGE_POOL_STOP_S and second.stopped_with is None
        assert (second.name, second.flags) == (first.name, first.flags) and second.pinned
        assert second.kwargs["stderr_path"] == tmp_path / "t0.engine1.log"
    # 2. On the way out the engine stopped is the one running then.
    assert second.stopped_with == tools.engine_process.LARGE_POOL_STOP_S
    with _sides("none", tmp_path) as sides:
        assert sides.restart_engine is None


def test_side_processes_engine_variant_is_the_engine_with_its_flags_and_the_connectors_defaults(fakes, tmp_path):
    # --engine-variants load-layer-groups=4+hold-saves: a configuration of its own, its engine
    # started with the variant's flags after the bench's, its vLLM on the connector's defaults.
    with _sides("pegaflow+load-layer-groups=4+hold-saves", tmp_path):
        (engine,) = _FakeEngine.made
        assert engine.flags == ("--copy-backend=staged", "--load-layer-groups=4", "--hold-saves")
    assert serving_setup.connector_options("pegaflow+hold-saves") == {}
    assert serving_setup.is_pegaflow("pegaflow+hold-saves") and not serving_setup.is_pegaflow("pegaflow-rs")


def test_side_processes_stops_the_engine_when_the_run_fails(fakes, tmp_path):
    with pytest.raises(RuntimeError, match="vllm serve exited"), _sides("pegaflow", tmp_path):
        raise RuntimeError("vllm serve exited (1)")
    assert _FakeEngine.made[0].stopped_with == tools.engine_process.LARGE_POOL_STOP_S


def test_side_processes_peer_plans_its_pool_and_runs_its_server_for_the_block(fakes, tmp_path, monkeypatch):
    monkeypatch.setenv("PEGAFLOW_PEERS_DIR", str(tmp_path))
    with _sides("pegaflow-rs", tmp_path, peer_pool_bytes=16 << 30) as sides:
        assert fakes == [["pegaflow-rs", "t0.peer.log", "up"]]
        assert sides.plan.config == "pegaflow-rs" and "--pool-size" in sides.plan.server_argv
        assert sides.plan.server_argv[sides.plan.server_argv.index("--pool-size") + 1] == str(16 << 30)
        assert sides.engine_stats() is None and _FakeEngine.made == []
    assert fakes == [["pegaflow-rs", "t0.peer.log", "stopped"]]


def test_side_processes_plain_configurations_run_nothing_beside_vllm(fakes, tmp_path):
    for config in ("none", "native"):
        with _sides(config, tmp_path) as sides:
            assert sides.plan is None and sides.engine_stats() is None
    assert _FakeEngine.made == [] and fakes == []


def test_vllm_settings_of_a_peer_and_of_none(tmp_path, monkeypatch):
    assert vllm_settings(None) == (None, {}, None)
    monkeypatch.setenv("PEGAFLOW_PEERS_DIR", str(tmp_path))
    plan = peers.plan("lmcache", 4 << 30)
    args, env, cwd = vllm_settings(plan)
    assert args == plan.serve_args() and env == plan.env and env is not plan.env and cwd == plan.cwd
    assert env["LMCACHE_MAX_LOCAL_CPU_SIZE"] == "4"


def test_pegaflow_no_compute_once_turns_it_off_in_the_engine_and_the_connector(fakes, tmp_path):
    # The engine started with --no-compute-once, the connector told compute_once false: neither
    # claims nor waits, and a lookup's deadline is the plain one.
    from engine.process.options import config_from_args
    from pegaflow.connector.config import ConnectorConfig
    with _sides("pegaflow-no-compute-once", tmp_path):
        (engine,) = _FakeEngine.made
        assert config_from_args(list(engine.flags), environ={}).compute_once is False
    _, text = pegaflow_transfer_args("bench7", **serving_setup.PEGAFLOW_CONFIGS["pegaflow-no-compute-once"])
    connector = ConnectorConfig.from_sources(json.loads(text)["kv_connector_extra_config"], environ={})
    assert connector.is_claiming is False and connector.lookup_deadline_ms == connector.lookup_timeout_ms
    assert config_from_args([], environ={}).compute_once is True  # (pegaflow's: on)
