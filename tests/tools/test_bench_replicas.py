"""tools.bench_replicas's workloads and headline over fake replicas (no GPU): every turn
routed, each replica's figures, the restart round, outputs compared with the ``none`` run."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tools import bench_replicas
from tools.bench_replicas import headline, parse_args
from tools.lib import fleet as fleet_module
from tools.lib import replica_workloads, runs, vllm_serve


class _Replica(BaseHTTPRequestHandler):
    """Answers a completion with the prompt's first ``max_tokens`` ids in one chunk; its
    /metrics says it was served ``hits`` host tokens (one per request so far)."""

    def log_message(self, *args):
        pass

    def _send(self, body: bytes, kind: str = "text/plain") -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        hits = self.server.requests * 100
        self._send(("# TYPE vllm:external_prefix_cache_hits counter\n"
                    f'vllm:external_prefix_cache_hits_total{{engine="0"}} {hits}.0\n'
                    "# TYPE vllm:prefix_cache_hits counter\n"
                    'vllm:prefix_cache_hits_total{engine="0"} 5.0\n').encode())

    def do_POST(self):
        if self.path == "/reset_prefix_cache":  # refused once (a save in flight), then done
            self.server.resets += 1
            self._send(json.dumps({"success": self.server.resets > 1}).encode(), "application/json")
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests += 1
        ids = body["prompt"][:body["max_tokens"]]
        chunk = json.dumps({"choices": [{"token_ids": ids}]})
        self._send(f"data: {chunk}\n\ndata: [DONE]\n\n".encode(), "text/event-stream")


class _FakeFleet:
    def __init__(self, replicas: int):
        self.servers = [self._serve() for _ in range(replicas)]
        self.ready_s = [1.0] * replicas
        self.restarts = 0

    @staticmethod
    def _serve() -> ThreadingHTTPServer:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Replica)
        server.requests = server.resets = 0
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    def port(self, replica: int) -> int:
        return self.servers[replica].server_address[1]

    def counters(self):
        return {r: vllm_serve.counters(self.port(r)) for r in range(len(self.servers))}

    def reset_prefix_caches(self):
        return sum(vllm_serve.reset_gpu_cache(self.port(r)) for r in range(len(self.servers)))

    def stop(self, replica: int):
        self.servers[replica].shutdown()
        self.servers[replica].server_close()

    def start(self, replica: int) -> float:
        self.servers[replica] = self._serve()  # a fresh process: its counters start at 0
        self.restarts += 1
        return 2.5

    def close(self):
        for server in self.servers:
            server.shutdown()
            server.server_close()


@pytest.fixture
def fleet():
    made = _FakeFleet(2)
    yield made
    made.close()


def _args(*extra: str):
    return parse_args(["--users", "3", "--rounds", "3", "--context-tokens", "200", "--question-tokens", "8",
                       "--answer-tokens", "4", "--docs", "2", "--doc-tokens", "100", "--doc-requests", "6",
                       "--replicas", "2", *extra])


def test_workloads_route_every_turn_and_count_each_replica(fleet, monkeypatch):
    p50_of = []  # the routed results each restart TTFT p50 is taken over
    ttft_p50 = replica_workloads.ttft_p50
    monkeypatch.setattr(replica_workloads, "ttft_p50", lambda routed: p50_of.append(routed) or ttft_p50(routed))
    run = replica_workloads.run_workloads("none", _args("--restart"), fleet, "t")
    # 1. Three rounds of three users, the two later rounds timed; six shared-document requests.
    assert [r["requests"] for r in run["rounds"]] == [3, 3, 3]
    assert run["later_rounds"]["requests"] == 6 and run["docs"]["requests"] == 6
    # Before the shared documents every replica's GPU cache was emptied, each reset retried
    # past its first refusal: one wait per replica at least.
    from tools.lib.warm_pass import RESET_POLL_S
    assert run["docs_reset_wait_s"] >= len(fleet.servers) * RESET_POLL_S
    # 2. Each replica's external hits over the later rounds are its own requests' (100 each).
    per = run["chat"]["per_replica"]
    assert sum(p["requests"] for p in per) == 6
    assert [p["served_tokens"] for p in per] == [100.0 * p["requests"] for p in per]
    # 3. Cacheable: the full 16-token blocks of each user's history (200 + 8 + 3 computed).
    #    Each later turn: history 208 + 3 (round 1: prompt 220) or 220 + 3 (round 2: prompt 232),
    #    so 208 tokens (13 blocks) a turn, six turns.
    assert run["chat"]["cacheable_tokens"] == 6 * 208
    # 4. The restart: replica 0 started again, then one more round; its figures apart.
    assert fleet.restarts == 1 and run["restart"]["time_to_ready_s"] == 2.5
    # Before that round, one warm-up request went to the restarted replica (none after it).
    assert len(run["restart"]["warmup_s"]) == 1 and fleet.servers[0].requests == 1 + 1
    # (round-robin: 15 requests before it, so the round's three go to replicas 1, 0, 1)
    assert run["restart"]["first_round"]["requests"] == 1
    # The replica that kept running (two of the round's requests): its TTFT then and warm.
    # Replica 0's warm rounds, then the replica that kept running: its two turns of the restart
    # round and its turns of the later rounds; each figure is the TTFT p50 of those.
    warm0, others, others_warm = p50_of[-3:]
    assert {x.replica for x in warm0} == {0} and len(warm0) == sum(p["requests"] for p in per if p["replica"] == 0)
    assert {x.replica for x in others} == {1} and len(others) == 2
    assert {x.replica for x in others_warm} == {1} and len(others_warm) == 6 - len(warm0)
    assert run["restart"]["others_ttft_p50_ms"] == ttft_p50(others) is not None
    assert run["restart"]["others_warm_ttft_p50_ms"] == ttft_p50(others_warm) is not None
    assert len(run["results"]) == 9 + 6 + 3
    # Per request, evidence that outlives the run: its tokens' hash, its replica.
    from tools.lib.evidence import tokens_sha256
    assert [r["key"] for r in run["requests"]] == [key for key, _, _ in run["results"]]
    assert all(r["tokens_sha256"] == tokens_sha256(tokens)
               for r, (_, tokens, _) in zip(run["requests"], run["results"]))
    assert {r["replica"] for r in run["requests"]} == {0, 1}


def test_headline_compares_every_answer_with_the_none_run(fleet):
    args = _args()
    reference = replica_workloads.run_workloads("none", args, fleet, "a") | {"engine": None}
    same = replica_workloads.run_workloads("pegaflow", args, fleet, "b") | {"engine": None}
    wrong = json.loads(json.dumps(same)) | {"config": "native"}
    wrong["results"][4][1] = [9, 9, 9, 9]  # one answer of one request differs
    table = headline([reference, same, wrong])
    assert table["pegaflow"]["outputs_identical"] is True
    assert table["native"]["outputs_identical"] is False
    assert table["native"]["identical_share"] == pytest.approx(1 - 1 / len(wrong["results"]))
    assert {"later_rounds_wall_s", "ttft_p50_ms", "ttft_p99_ms", "served_share"} <= set(table["none"])


def test_parse_args_splits_the_gpu_among_replicas_and_refuses_none():
    assert parse_args(["--replicas", "4"]).gpu_memory_utilization == pytest.approx(0.212)
    with pytest.raises(SystemExit):
        parse_args(["--replicas", "0"])


def test_available_configs_skips_a_missing_peer_with_one_line(monkeypatch, capsys):
    monkeypatch.setattr(bench_replicas.peers, "unavailable",
                        lambda config: "No module named 'lmcache'" if config == "lmcache" else None)
    assert runs.available_configs(["none", "lmcache", "pegaflow-rs", "pegaflow"]) == \
        ["none", "pegaflow-rs", "pegaflow"]
    assert capsys.readouterr().err.strip().splitlines() == ["skipping lmcache: No module named 'lmcache'"]


def test_run_config_gives_an_in_process_peer_its_share_of_the_host_budget(monkeypatch, tmp_path):
    # 1. LMCache in vLLM's process holds a private cache per replica, split like native's;
    #    LMCache's and PegaFlow's servers are one for every replica, with the whole budget,
    #    each told how many vLLMs it serves.
    pools = {}

    def plan(config, pool_bytes, num_vllms):
        pools[config] = (pool_bytes, num_vllms)
        raise RuntimeError("stop here")

    monkeypatch.setattr(bench_replicas.peers, "plan", plan)
    args = _args("--replicas", "4", "--host-gib", "64")
    for config in ("lmcache", "lmcache-mp", "pegaflow-rs"):
        with pytest.raises(RuntimeError, match="stop here"):
            bench_replicas.run_config(config, args, tmp_path, config)
    assert pools == {"lmcache": (16 << 30, 1), "lmcache-mp": (64 << 30, 4), "pegaflow-rs": (64 << 30, 4)}


def test_fleet_step_timelines_per_replica_within_the_later_rounds(tmp_path):
    # 1. Two pegaflow replicas traced: replica 0 loaded in two steps inside the window and one
    #    before it; replica 1 wrote no trace (no step loaded).
    from tests.tools.test_step_timeline import GPU_LINE
    args = _args("--trace")
    fleet = fleet_module.Fleet.__new__(fleet_module.Fleet)
    fleet.config, fleet.args, fleet.log_dir, fleet.tag = "pegaflow", args, tmp_path, "t"
    fleet.trace_path(0).write_text("\n".join([GPU_LINE.replace("monotonic 812.5", "monotonic 100.0"), GPU_LINE,
                                              GPU_LINE.replace("monotonic 812.5", "monotonic 900.5")]))
    timelines = fleet.step_timelines((800.0, 1000.0))
    assert timelines[0]["steps"] == 2 and timelines[0]["loads"] == 8
    assert timelines[1]["steps"] == 0
    # 2. Without --trace, or for another configuration, nothing is traced.
    fleet.config = "native"
    assert fleet.trace_path(0) is None and fleet.step_timelines((0.0, 1.0)) is None


class _BySourceReplica(_Replica):
    """A vLLM with ``vllm:prompt_tokens_by_source``: its hit counters count a request that
    loaded asynchronously twice (300 host, 10 GPU tokens), the by-source counter once."""

    def do_GET(self):
        self._send(("# TYPE vllm:external_prefix_cache_hits counter\n"
                    'vllm:external_prefix_cache_hits_total{engine="0"} 300.0\n'
                    "# TYPE vllm:prefix_cache_hits counter\n"
                    'vllm:prefix_cache_hits_total{engine="0"} 10.0\n'
                    "# TYPE vllm:prompt_tokens_by_source counter\n"
                    'vllm:prompt_tokens_by_source_total{engine="0",source="local_compute"} 40.0\n'
                    'vllm:prompt_tokens_by_source_total{engine="0",source="local_cache_hit"} 5.0\n'
                    'vllm:prompt_tokens_by_source_total{engine="0",source="external_kv_transfer"} 150.0\n'
                    'vllm:prompt_tokens_by_source_total{engine="1",source="external_kv_transfer"} 2.0\n').encode())


@pytest.mark.parametrize("handler,expected", [(_BySourceReplica, {"gpu_hit_tokens": 5.0, "host_hit_tokens": 152.0}),
                                              (_Replica, {"gpu_hit_tokens": 5.0, "host_hit_tokens": 0.0})])
def test_bench_replicas_hit_counters_by_source_where_vllm_has_it(handler, expected):
    # 1. A vLLM with prompt_tokens_by_source: its split, summed over engines, not the hit
    #    counters (which count an asynchronously loaded request twice); 2. one without: those.
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.requests = server.resets = 0
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert vllm_serve.hit_counters(server.server_address[1]) == expected
    finally:
        server.shutdown()
        server.server_close()


class _LaunchLog:
    """A stand-in for ``Server``: records each launch (its command) and each wait, in order."""

    events: list = []

    def __init__(self, cmd, port, log_path, env, cwd, wait=True, leftovers=None):
        assert wait is False
        self.cmd, self.port = cmd, port
        _LaunchLog.events.append(("launch", port))

    def wait_ready(self):
        _LaunchLog.events.append(("wait", self.port))
        return 12.345

    def stop(self):
        _LaunchLog.events.append(("stop", self.port))


@pytest.mark.parametrize("start,warm,expected", [
    ("together", True, ["launch 0", "launch 1", "launch 2", "wait 0", "wait 1", "wait 2"]),
    ("together", False, ["launch 0", "wait 0", "launch 1", "launch 2", "wait 1", "wait 2"]),
    ("at-once", False, ["launch 0", "launch 1", "launch 2", "wait 0", "wait 1", "wait 2"]),
    ("one-by-one", True, ["launch 0", "wait 0", "launch 1", "wait 1", "launch 2", "wait 2"])])
def test_fleet_starts_replicas_together_after_the_compile_cache_is_warm(monkeypatch, tmp_path, start, warm,
                                                                          expected):
    # 1. Together: every replica launched before any is waited for, unless vLLM's compile
    #    cache is empty (then replica 0 first, alone; at-once: not even then); one-by-one: each
    #    after the previous.
    # 2. Together, each replica's KV cache is given in bytes (the 8B shape's 2 MiB a block),
    #    beside the block count; one-by-one leaves vLLM's memory profile as it is.
    _LaunchLog.events = []
    monkeypatch.setattr(fleet_module, "Server", _LaunchLog)
    monkeypatch.setattr(fleet_module, "compile_cache_warm", lambda: warm)
    args = _args("--replicas", "3", "--start", start, "--gpu-blocks", "1000", "--port", "9000")
    fleet = fleet_module.Fleet("pegaflow", args, "eng", tmp_path, "t")
    assert [f"{kind} {port - 9000}" for kind, port in _LaunchLog.events] == expected
    assert fleet.ready_s == [12.35] * 3
    cmd = fleet.servers[2].cmd
    if start != "one-by-one":
        assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(1000 * 2 << 20)
    else:
        assert "--kv-cache-memory-bytes" not in cmd
    assert cmd[cmd.index("--num-gpu-blocks-override") + 1] == "1000"


def test_compile_cache_warm_looks_in_vllms_cache_root(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    assert not fleet_module.compile_cache_warm()
    (tmp_path / "torch_compile_cache").mkdir()
    assert not fleet_module.compile_cache_warm()
    (tmp_path / "torch_compile_cache" / "0123abcd").mkdir()
    assert fleet_module.compile_cache_warm()


def _burst_args(*extra: str):
    from tests.tools.lib.test_burst import DOC_TOKENS, QUESTION_TOKENS
    return parse_args(["--users", "0", "--doc-requests", "0", "--replicas", "2", "--answer-tokens", "4",
                       "--burst-docs", "3", "--burst-doc-tokens", str(DOC_TOKENS),
                       "--burst-question-tokens", str(QUESTION_TOKENS), *extra])


def _burst_run(config: str, claims=None) -> dict:
    from tests.tools.lib.test_burst import BurstFleet
    fleet = BurstFleet(2, expected=3 * 2)
    fleet.ready_s = [1.0, 1.0]
    try:
        run = replica_workloads.run_workloads(config, _burst_args(), fleet, config, claims)
        assert [s.warmups for s in fleet.servers] == [1, 1]  # each replica warmed once, before the burst
        return run | {"engine": None}
    finally:
        fleet.close()


def test_workloads_burst_alone_sends_every_document_to_every_replica_and_counts_the_engines_claims():
    # 1. --users 0 --doc-requests 0: the burst alone, no chat figures.
    counted = iter([{"claims": 5, "claim_waits": 0}, {"claims": 8, "claim_waits": 3}])
    run = _burst_run("pegaflow", claims=lambda: next(counted))
    assert "chat" not in run and "docs" not in run and "restart" not in run
    # 2. Six requests, one per (document, replica); the fake replicas' shared cache had each
    #    document computed once: computed = unique = 3 x 64 + 6 x 8.
    figures = run["burst"]
    assert figures["requests"] == 6 and figures["errors"] == 0
    assert figures["prefill_tokens_computed"] == figures["unique_prompt_tokens"] == 240
    # 3. The engine's compute-once counters over the burst alone (read before and after it).
    assert figures["engine_claims"] == {"claims": 3, "claim_waits": 3}
    # 4. Its answers are the run's results, each at the replica it was sent to.
    assert sorted(r["key"] for r in run["requests"]) == sorted(f"b{d}r{r}" for d in range(3) for r in range(2))
    assert all(r["replica"] == int(r["key"][-1]) for r in run["requests"])


def test_headline_burst_rows_compare_with_none_and_survive_merge(tmp_path, capsys):
    # 1. none, pegaflow (the same answers) and a run with one burst answer changed.
    none, same = _burst_run("none"), _burst_run("pegaflow")
    wrong = json.loads(json.dumps(same)) | {"config": "pegaflow-no-compute-once"}
    wrong["burst"]["answers"][2]["tokens_sha256"] = "0" * 16
    table = headline([none, same, wrong])
    assert table["pegaflow"]["burst_identical_share"] == 1.0
    assert table["pegaflow-no-compute-once"]["burst_identical_share"] == pytest.approx(5 / 6)
    assert table["none"]["prefill_tokens_computed"] == 240 and table["none"]["unique_prompt_tokens"] == 240
    assert "later_rounds_wall_s" not in table["none"] and table["none"]["errors"] == 0
    # 2. Split over two calls: each call's --json, then --merge: the same rows, and the burst's table.
    paths = []
    for i, runs_of_call in enumerate(([none], [same, wrong])):
        paths.append(tmp_path / f"call{i}.json")
        bench_replicas.write_json(_burst_args("--json", str(paths[-1])), runs_of_call)
    merged = tmp_path / "merged.json"
    assert bench_replicas.main(["--merge", *map(str, paths), "--json", str(merged)]) == 0
    written = json.loads(merged.read_text())
    assert written["pegaflow-no-compute-once"]["burst_identical_share"] == pytest.approx(5 / 6)
    assert written["pegaflow"]["prefill_tokens_computed"] == 240 and len(written["runs"]) == 3
    out = capsys.readouterr().out
    assert "computed/unique" in out and "pegaflow-no-compute-once" in out


def test_parse_args_burst_needs_no_chat_but_restart_does():
    assert _burst_args().burst_docs == 3 and _burst_args().users == 0
    with pytest.raises(SystemExit):
        parse_args(["--users", "0", "--restart"])
    with pytest.raises(SystemExit):
        parse_args(["--burst-docs", "-1"])


def test_headline_compares_a_burst_only_run_with_the_none_run_of_the_burst(fleet):
    # A merge of a chat run of none, a burst-only run of none and a burst-only run of pegaflow:
    # each answer is compared with the none run that has it, not with the chat's (no match).
    chat_none = replica_workloads.run_workloads("none", _args(), fleet, "a") | {"engine": None}
    table = headline([chat_none, _burst_run("none"), _burst_run("pegaflow")])
    assert table["pegaflow"]["outputs_identical"] is True and table["pegaflow"]["identical_share"] == 1.0
    assert table["none"]["later_rounds_wall_s"] == chat_none["later_rounds_wall_s"]
    assert table["pegaflow"]["burst_identical_share"] == 1.0 and "later_rounds_wall_s" not in table["pegaflow"]
    # A chat run of pegaflow beside only a burst run of none: nothing to compare it with, so
    # no verdict (not "differs").
    chat_pegaflow = replica_workloads.run_workloads("pegaflow", _args(), fleet, "b") | {"engine": None}
    table = headline([_burst_run("none"), chat_pegaflow])
    assert "identical_share" not in table["pegaflow"] and "outputs_identical" not in table["pegaflow"]


def test_main_engine_variants_are_configurations_interleaved_under_repeat(monkeypatch, tmp_path):
    # Each variant is pegaflow under its own name, run where pegaflow stood, repeated A B A B.
    ran = []

    def run_config(config, args, log_dir, tag):
        ran.append(config)
        later = {"ttft_p50_ms": 50.0, "ttft_p99_ms": 90.0, "errors": 0}
        return {"config": config, "tag": tag, "later_rounds_wall_s": 1.0 + len(ran), "later_rounds": later,
                "time_to_ready_s": [1.0], "chat": {"served_share": 0.5, "moved_share": 0.4, "errors": 0},
                "results": [["r1u0", [1], ""]]}
    monkeypatch.setattr(bench_replicas, "run_config", run_config)
    monkeypatch.setattr(bench_replicas, "measured_on", lambda args: ("fake-gpu", args.model))
    out = tmp_path / "replicas.json"
    assert bench_replicas.main(["--configs", "none", "pegaflow", "--engine-variants", "default", "hold-saves",
                                "--repeat", "2", "--log-dir", str(tmp_path), "--json", str(out)]) == 0
    assert ran == ["none", "pegaflow", "pegaflow+hold-saves"] * 2
    data = json.loads(out.read_text())
    assert data["pegaflow+hold-saves"]["runs"] == 2
    assert data["pegaflow+hold-saves"]["later_rounds_wall_s_spread"] == [4.0, 7.0]
