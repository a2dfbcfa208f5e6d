"""tools.bench_serving's HTTP client and headline, against a small fake OpenAI server (no
GPU): streamed token ids, time to the first token, errors, concurrency."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tools import bench_serving
from tools.bench_serving import headline, main
from tools.lib import vllm_serve
from tools.lib.vllm_serve import complete, run_all


class _Fake(BaseHTTPRequestHandler):
    """Answers a completion with the prompt's first ``max_tokens`` ids, one chunk each
    (the first after ``FIRST_S``); a prompt starting with 0 gets HTTP 400."""
    FIRST_S = 0.05
    in_flight = peak = 0
    lock = threading.Lock()

    def log_message(self, *args):
        pass

    METRICS = ("# TYPE vllm:external_prefix_cache_hits counter\n"
               'vllm:external_prefix_cache_hits_total{engine="0"} 32.0\n'
               "# TYPE vllm:pegaflow_lookup_deferrals counter\n"
               'vllm:pegaflow_lookup_deferrals_total{engine="0"} 2.0\n'
               'vllm:pegaflow_lookup_deferrals_total{engine="1"} 1.0\n'
               "# TYPE vllm:prompt_tokens counter\n"
               'vllm:prompt_tokens_total{engine="0"} 99.0\n')

    def do_GET(self):
        body = self.METRICS.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["stream"] and body["return_token_ids"] and body["model"] == vllm_serve.SERVED_NAME
        if body["prompt"][0] == 0:
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b'{"error": "bad"}')
            return
        with _Fake.lock:
            _Fake.in_flight += 1
            _Fake.peak = max(_Fake.peak, _Fake.in_flight)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        time.sleep(self.FIRST_S)
        self.wfile.write(b'data: {"choices": [{"text": "", "token_ids": []}]}\n\n')  # a role chunk
        for token in body["prompt"][:body["max_tokens"]]:
            self.wfile.write(f'data: {json.dumps({"choices": [{"token_ids": [token]}]})}\n\n'.encode())
            self.wfile.flush()
            time.sleep(0.005)
        if body.get("stream_options", {}).get("include_usage"):  # vLLM's last chunk: usage, no choice
            usage = {"prompt_tokens": len(body["prompt"]), "prompt_tokens_details": {"cached_tokens": 16}}
            self.wfile.write(f'data: {json.dumps({"choices": [], "usage": usage})}\n\n'.encode())
        self.wfile.write(b"data: [DONE]\n\n")
        with _Fake.lock:
            _Fake.in_flight -= 1


@pytest.fixture
def port():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()


def test_complete_collects_streamed_tokens_and_times_the_first(port):
    result = complete(port, [5, 6, 7, 8], 3, "k")
    assert result.error == "" and result.tokens == [5, 6, 7] and result.key == "k"
    assert result.ttft_s >= _Fake.FIRST_S and result.done_s >= result.first_token_s
    assert result.tpot_s is not None and result.tpot_s > 0
    assert result.cached_tokens == 16  # from the usage chunk, which carries no choice


def test_complete_http_error_is_a_result_with_the_error(port):
    result = complete(port, [0, 1], 2, "bad")
    assert result.error.startswith("HTTP 400") and result.tokens == []


def test_run_all_keeps_order_and_bounds_concurrency(port):
    _Fake.peak = 0
    jobs = [(f"j{i}", [i + 1, i + 2], 0.0) for i in range(8)]
    results = run_all(port, jobs, 2, concurrency=3)
    assert [r.key for r in results] == [f"j{i}" for i in range(8)]
    assert [r.tokens for r in results] == [[i + 1, i + 2] for i in range(8)]
    assert _Fake.peak == 3


def _run(config, wall, ttft50, tokens, errors=0):
    later = {"ttft_p50_ms": ttft50, "ttft_p99_ms": ttft50 * 2, "errors": errors}
    return {"config": config, "later_rounds_wall_s": wall, "later_rounds": later,
            "shared_prefix": {"throughput_rps": 10.0 / wall, "errors": 0}, "results": [["r1u0", tokens, ""]]}


def test_headline_medians_spreads_and_identity_against_the_first_none():
    runs = [_run("none", 4.0, 300, [1]), _run("pegaflow", 1.0, 50, [1]), _run("native", 2.0, 100, [2]),
            _run("none", 5.0, 310, [1]), _run("pegaflow", 1.2, 60, [1]), _run("native", 2.2, 90, [1])]
    table = headline(runs)
    assert table["pegaflow"]["later_rounds_wall_s"] == 1.1 and table["pegaflow"]["ttft_p50_ms"] == 55
    assert table["pegaflow"]["later_rounds_wall_s_spread"] == [1.0, 1.2]
    assert table["pegaflow"]["outputs_identical"] and table["none"]["outputs_identical"]
    assert not table["native"]["outputs_identical"] and table["native"]["identical_share"] == 0.0
    assert table["pegaflow"]["errors"] == 0


def test_headline_counts_failed_requests_left_out_of_the_timings():
    table = headline([_run("none", 4.0, 300, [1]), _run("pegaflow", 1.0, 50, [1], errors=3)])
    assert table["pegaflow"]["errors"] == 3 and table["none"]["errors"] == 0


def test_server_command_per_config():
    class Args:
        model, port, max_model_len, gpu_memory_utilization, gpu_blocks, host_gib, eager = "m", 1, 2, 0.5, 9, 4, True
    none = vllm_serve.server_command("none", Args, "e")
    assert "--enforce-eager" in none and "--num-gpu-blocks-override" in none and "--kv-transfer-config" not in none
    native = vllm_serve.server_command("native", Args, "e")
    assert native[native.index("--kv-offloading-size") + 1] == "4"
    pega = vllm_serve.server_command("pegaflow", Args, "eng")
    config = json.loads(pega[pega.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "PegaKVConnector" and config["kv_connector_extra_config"] == {"engine_name": "eng"}
    auto = vllm_serve.server_command("pegaflow-auto", Args, "eng")
    extra = json.loads(auto[auto.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert extra == {"engine_name": "eng", "load_mode": "auto"}
    variant = vllm_serve.server_command("pegaflow+hold-saves", Args, "eng")  # an engine variant's
    assert json.loads(variant[variant.index("--kv-transfer-config") + 1]) == config


def test_counters_sum_labels_of_the_hit_and_pegaflow_counters_only(port):
    assert vllm_serve.counters(port) == {"vllm:external_prefix_cache_hits_total": 32.0,
                                            "vllm:pegaflow_lookup_deferrals_total": 3.0}
    assert vllm_serve.external_hit_tokens(port) == 32.0


def test_main_merge_tables_runs_of_several_files_without_running_a_server(tmp_path, capsys):
    # Two calls' --json files (a none run in the first, a pegaflow run in the second) make one
    # table: pegaflow compared against the first file's none, the first file's GPU kept.
    first, second, merged = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "m.json"
    first.write_text(json.dumps({"gpu": "H200", "model": "m", "runs": [_run("none", 4.0, 300, [1])]}))
    second.write_text(json.dumps({"gpu": "H200", "model": "m", "runs": [_run("pegaflow", 1.0, 50, [2])]}))
    assert main(["--merge", str(first), str(second), "--json", str(merged)]) == 0
    out = json.loads(merged.read_text())
    assert out["gpu"] == "H200" and [r["config"] for r in out["runs"]] == ["none", "pegaflow"]
    assert out["pegaflow"]["identical_share"] == 0.0 and out["none"]["outputs_identical"]
    assert "pegaflow" in capsys.readouterr().out


class _FakeVllmServe:
    """``bench_serving.Server`` for one configuration: the fake OpenAI server on the port asked
    for, whose ``POST /reset_prefix_cache`` refuses ``REFUSALS`` times (saves in flight) before
    it succeeds; each start's command, environment and directory are kept."""
    REFUSALS = 2
    started: list[dict] = []

    class _Handler(_Fake):
        refusals = 0

        def do_GET(self):
            if self.path == "/health":
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            super().do_GET()

        def do_POST(self):
            if self.path != "/reset_prefix_cache":
                return super().do_POST()
            handler = type(self)
            success = handler.refusals >= _FakeVllmServe.REFUSALS
            handler.refusals += 1
            body = json.dumps({"success": success}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    def __init__(self, cmd, port, log_path, extra_env=None, cwd=None, leftovers=None):
        handler = type("Handler", (self._Handler,), {"refusals": 0})
        self.server = ThreadingHTTPServer(("127.0.0.1", port), handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        _FakeVllmServe.started.append({"cmd": cmd, "env": dict(extra_env or {}), "cwd": cwd})

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


def test_main_runs_every_configuration_with_the_peers_end_to_end(tmp_path, monkeypatch, capsys):
    # The GPU run's command (--configs none native lmcache pegaflow-rs pegaflow), with its
    # processes faked: vllm serve (the fake server), pegaflow's engine, the peers' servers.
    import contextlib

    import pegaflow.stats.engine_stats
    import tools.engine_process
    from tools import peers_table
    from tools.lib import peers

    class FakeEngine:
        def __init__(self, name, *flags, **kwargs):
            self.name = name

        def stop(self, timeout_s=None):
            pass
    sides = []

    @contextlib.contextmanager
    def side_process(plan, log_path):
        sides.append(plan.config)
        yield
    monkeypatch.setattr(tools.engine_process, "EngineProcess", FakeEngine)
    monkeypatch.setattr(pegaflow.stats.engine_stats, "read_stats", lambda name: {
        "blocks_saved": 4, "blocks_loaded": 2, "lookup_hit_blocks": 2, "evictions": 0, "latency": {}})
    monkeypatch.setattr(peers, "unavailable", lambda config: None)
    monkeypatch.setattr(peers, "side_process", side_process)
    monkeypatch.setattr(bench_serving, "Server", _FakeVllmServe)
    monkeypatch.setattr(bench_serving, "measured_on", lambda args: ("fake-gpu", args.model))
    monkeypatch.setattr(_Fake, "FIRST_S", 0.0)
    _FakeVllmServe.started = []
    out = tmp_path / "serving.json"
    configs = ["none", "native", "lmcache", "pegaflow-rs", "pegaflow"]
    assert main(["--configs", *configs, "--users", "2", "--rounds", "2", "--context-tokens", "40",
                 "--prefixes", "2", "--prefix-tokens", "24", "--prefix-requests", "4", "--concurrency", "2",
                 "--port", str(peers.free_port()), "--log-dir", str(tmp_path), "--json", str(out)]) == 0
    # 1. One vllm serve per configuration, in order, each with its own settings.
    commands = [s["cmd"] for s in _FakeVllmServe.started]
    assert len(commands) == 5 and sides == ["lmcache", "pegaflow-rs"]

    def transfer(cmd):
        return json.loads(cmd[cmd.index("--kv-transfer-config") + 1]) if "--kv-transfer-config" in cmd else None
    assert transfer(commands[0]) is None and "--kv-offloading-size" not in commands[0]
    assert commands[1][commands[1].index("--kv-offloading-backend") + 1] == "native"
    assert transfer(commands[2])["kv_connector"] == "LMCacheConnectorV1"
    assert _FakeVllmServe.started[2]["env"]["LMCACHE_MAX_LOCAL_CPU_SIZE"] == "32"
    assert transfer(commands[3])["kv_connector_module_path"] == "pegaflow.connector"
    assert _FakeVllmServe.started[3]["env"]["PYTHONPATH"].startswith(str(peers.site_of("pegaflow-rs")))
    assert _FakeVllmServe.started[3]["cwd"] is not None  # outside this repo
    assert transfer(commands[4])["kv_connector_extra_config"]["engine_name"].startswith("bench")
    # 2. The GPU cache was reset between the workloads, after the refusals.
    data = json.loads(out.read_text())
    assert [r["config"] for r in data["runs"]] == configs
    assert all(r["reset_wait_s"] > 0 for r in data["runs"])
    # 3. A row per configuration, each answer equal to none's; the peers' table reads it.
    assert all(data[c]["outputs_identical"] and data[c]["errors"] == 0 for c in configs)
    table = peers_table.build({"serving": data}, "2026-12-06")
    assert set(table["configs"]) == set(configs) and table["versus"]["multi_round"] is not None
    # 4. The later round's cacheable tokens, rebuilt from the workload and the answers given,
    #    and each row's share of them served from host memory.
    from tools.serving_workload import later_rounds_cacheable
    answers = {key: tokens for key, tokens, _ in data["runs"][0]["results"]}
    # (per request: the tokens' hash and vLLM's cached tokens, from each answer's usage)
    from tools.lib.evidence import tokens_sha256
    assert [(r["key"], r["tokens_sha256"], r["cached_tokens"]) for r in data["runs"][0]["requests"]] == [
        (key, tokens_sha256(tokens), 16) for key, tokens, _ in data["runs"][0]["results"]]
    cacheable = later_rounds_cacheable(2, 40, 64, 0, [[answers[f"r{r}u{u}"] for u in range(2)] for r in range(2)])
    assert cacheable > 0 and all(r["cacheable_tokens"] == {"multi_round": cacheable} for r in data["runs"])
    assert all(data[c]["served_share"] == r["host_hit_tokens"]["multi_round"] / cacheable
               for c, r in zip(configs, data["runs"]))
    printed = capsys.readouterr().out
    assert all(f"\n{config} " in printed for config in configs)


def test_main_a_peer_failing_at_run_time_is_a_row_and_the_bench_goes_on(tmp_path, monkeypatch, capsys):
    from tools.lib import peers
    from tools.lib.warm_pass import GpuCacheNotEmptyError
    monkeypatch.setattr(peers, "unavailable", lambda config: None)
    monkeypatch.setattr(bench_serving, "measured_on", lambda args: ("fake-gpu", args.model))

    def run_config(config, args, log_dir, tag):
        if config == "pegaflow-rs":
            raise GpuCacheNotEmptyError("vLLM refused to reset its GPU prefix cache 1500 times in 300 s")
        return dict(_run(config, 2.0, 100, [1]), tag=tag, host_hit_tokens={})
    monkeypatch.setattr(bench_serving, "run_config", run_config)
    out = tmp_path / "serving.json"
    assert main(["--configs", "none", "pegaflow-rs", "pegaflow", "--log-dir", str(tmp_path),
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["pegaflow-rs"] == {"failed": "vLLM refused to reset its GPU prefix cache 1500 times in 300 s",
                                   "errors": 0}
    assert data["pegaflow"]["outputs_identical"] and [r["config"] for r in data["runs"]] == [
        "none", "pegaflow-rs", "pegaflow"]
    captured = capsys.readouterr()
    assert "bench_serving: pegaflow-rs failed: vLLM refused" in captured.err
    assert "pegaflow-rs    failed: vLLM refused" in captured.out


def test_hits_of_prefers_tokens_by_source_over_the_hit_counters():
    # An asynchronously loaded request is counted twice by vLLM's hit counters, once by source.
    from tools.lib.vllm_serve import hits_of
    found = {"vllm:external_prefix_cache_hits_total": 320.0, "vllm:prefix_cache_hits_total": 16.0,
             "vllm:prompt_tokens_by_source:external_kv_transfer": 160.0,
             "vllm:prompt_tokens_by_source:local_cache_hit": 16.0,
             "vllm:prompt_tokens_by_source:local_compute": 40.0}
    assert hits_of(found) == {"gpu_hit_tokens": 16.0, "host_hit_tokens": 160.0}
    older = {k: v for k, v in found.items() if "by_source" not in k}  # a vLLM without it
    assert hits_of(older) == {"gpu_hit_tokens": 16.0, "host_hit_tokens": 320.0}


def test_main_engine_variants_are_configurations_interleaved_under_repeat(tmp_path, monkeypatch, capsys):
    # 1. Two repeats of none and pegaflow's engine under three variants, its processes faked.
    import pegaflow.stats.engine_stats
    import tools.engine_process
    from tools.lib import peers
    engines = []

    class FakeEngine:
        def __init__(self, name, *flags, **kwargs):
            self.name = name
            engines.append(flags)

        def stop(self, timeout_s=None):
            pass
    monkeypatch.setattr(tools.engine_process, "EngineProcess", FakeEngine)
    monkeypatch.setattr(pegaflow.stats.engine_stats, "read_stats", lambda name: {
        "blocks_saved": 4, "blocks_loaded": 2, "lookup_hit_blocks": 2, "evictions": 0, "latency": {}})
    monkeypatch.setattr(bench_serving, "Server", _FakeVllmServe)
    monkeypatch.setattr(bench_serving, "measured_on", lambda args: ("fake-gpu", args.model))
    monkeypatch.setattr(_Fake, "FIRST_S", 0.0)
    _FakeVllmServe.started = []
    out = tmp_path / "serving.json"
    assert main(["--configs", "none", "pegaflow", "--engine-variants", "default", "hold-saves",
                 "load-layer-groups=4", "--repeat", "2", "--users", "2", "--rounds", "2", "--context-tokens", "40",
                 "--prefix-requests", "0", "--port", str(peers.free_port()), "--log-dir", str(tmp_path),
                 "--engine-arg=--copy-backend=staged", "--json", str(out)]) == 0
    # 2. Run in order A B C D A B C D, each variant's engine fresh with its own flags.
    variants = ["pegaflow", "pegaflow+hold-saves", "pegaflow+load-layer-groups=4"]
    data = json.loads(out.read_text())
    assert [r["config"] for r in data["runs"]] == ["none", *variants] * 2
    assert engines == [("--copy-backend=staged",), ("--copy-backend=staged", "--hold-saves"),
                       ("--copy-backend=staged", "--load-layer-groups=4")] * 2
    # 3. One row per variant over its two runs, with the spread, answers compared with none's.
    for config in variants:
        row = data[config]
        assert row["runs"] == 2 and len(row["later_rounds_wall_s_spread"]) == 2 and row["outputs_identical"]
    assert "pegaflow+load-layer-groups=4 " in capsys.readouterr().out
