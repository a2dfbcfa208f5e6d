"""tools.bench_peers over fake replicas and fake caches (no GPU): one fleet per configuration
serves the chat's repeats, the restart, the warm TTFT and the serving workload; every cache is
emptied between repeats the configuration's own way; the files it writes merge into the
benches' tables and the peers table."""

from __future__ import annotations

import contextlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import pegaflow.stats.engine_stats
from tools import bench_peers, bench_replicas, bench_serving, peers_table
from tools.lib import cache_reset, peers
from tools.lib.serving_setup import ENGINE_STATS, Sides
from tools.lib.warm_pass import BY_SOURCE

MODEL = str(Path(__file__).resolve().parents[2] / "tools/models/llama-tiny")
BLOCK = 16


class _Caches:
    """A configuration's caches as the fake replicas see them: each replica's GPU prefix cache and
    the host cache (one shared by the replicas, one per replica for native, none for none)."""

    def __init__(self, config: str, replicas: int):
        self.config = config
        self.gpu = [set() for _ in range(replicas)]
        private = config in ("native", "lmcache")  # a cache in each vLLM process
        self.host = [set() for _ in range(replicas)] if private else [set()] * replicas
        self.cleared = []  # how each emptying came (engine restart, server clear...)
        self.refuses_external = False  # a connector whose reset_cache fails (pegaflow's engine refusing)

    def serve(self, replica: int, prompt: list[int]) -> tuple[int, int]:
        """GPU-hit and host-hit tokens of ``prompt``; its blocks then kept in both caches."""
        blocks = [tuple(prompt[:BLOCK * (i + 1)]) for i in range((len(prompt) - 1) // BLOCK)]
        gpu = next((i for i, b in enumerate(blocks) if b not in self.gpu[replica]), len(blocks))
        host = next((i for i, b in enumerate(blocks[gpu:]) if b not in self.host[replica] or
                     self.config == "none"), len(blocks) - gpu)
        self.gpu[replica].update(blocks)
        if self.config != "none":
            self.host[replica].update(blocks)
        return gpu * BLOCK, host * BLOCK

    def clear_host(self, how: str, replicas=None) -> None:
        for r in replicas if replicas is not None else range(len(self.host)):
            self.host[r].clear()
        self.cleared.append(how)


def _answer(prompt: list[int], max_tokens: int) -> tuple[list[int], dict]:
    seed = sum(prompt) % 997
    return [seed + i for i in range(max_tokens)], {f"token_id:{seed + k}": -0.25 * (k + 1) for k in range(5)}


class _Replica(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, body, kind: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        counts = self.server.by_source
        self._send("".join(f'{BY_SOURCE}_total{{source="{s}"}} {v}.0\n' for s, v in counts.items()).encode(),
                   "text/plain")

    def do_POST(self):
        srv, caches = self.server, self.server.caches
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        if self.path.startswith("/reset_prefix_cache"):
            caches.gpu[srv.replica].clear()
            if self.path.endswith("reset_external=true"):
                if caches.refuses_external:  # vLLM: the GPU's reset, but the connector's failed
                    return self._send({"success": False})
                caches.clear_host("reset_external", [srv.replica])
            return self._send({"success": True})
        if self.path == "/collective_rpc":
            srv.rpcs.append(body["method"])
            return self._send({"results": ["4096" if body["method"] == "bench_scrub_kv_cache" else "FULL"]})
        prompt = body["prompt"]
        gpu, host = caches.serve(srv.replica, prompt)
        for source, n in (("local_cache_hit", gpu), ("external_kv_transfer", host),
                          ("local_compute", len(prompt) - gpu - host)):
            srv.by_source[source] += n
        tokens, top = _answer(prompt, body["max_tokens"])
        usage = {"prompt_tokens_details": {"cached_tokens": gpu + host}}
        if not body.get("stream"):
            return self._send({"choices": [{"token_ids": tokens, "logprobs": {"top_logprobs": [top]}}],
                               "usage": usage})
        chunks = [{"choices": [{"token_ids": tokens}]}, {"choices": [], "usage": usage}]
        self._send("".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n",
                   "text/event-stream")


def _http(handler, **attrs) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    for name, value in attrs.items():
        setattr(server, name, value)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class _Fleet:
    """bench_peers's ``Fleet``: fake replicas over one configuration's ``_Caches``."""

    made: list[_Fleet] = []

    def __init__(self, config, args, engine_name, log_dir, tag, plan=None, extra_args=()):
        self.args, self.extra_args, self.caches = args, extra_args, _FAKES.caches[config]
        self.servers = [self._serve(r) for r in range(args.replicas)]
        self.ready_s, self.restarts, self.closed = [1.0] * args.replicas, 0, False
        _Fleet.made.append(self)

    def _serve(self, replica: int) -> ThreadingHTTPServer:
        return _http(_Replica, replica=replica, caches=self.caches, rpcs=[],
                     by_source={"local_compute": 0, "local_cache_hit": 0, "external_kv_transfer": 0})

    def port(self, replica: int) -> int:
        return self.servers[replica].server_address[1]

    def counters(self):
        from tools.lib.vllm_serve import counters
        return {r: counters(self.port(r)) for r in range(len(self.servers))}

    def stop(self, replica: int) -> None:
        self.servers[replica].shutdown()
        self.caches.gpu[replica].clear()
        if self.caches.config == "native":  # its CPU cache is in the process
            self.caches.host[replica].clear()

    def start(self, replica: int) -> float:
        self.servers[replica] = self._serve(replica)
        self.restarts += 1
        return 2.0

    def close(self) -> None:
        self.closed = True
        for server in self.servers:
            server.shutdown()


class _Clear(BaseHTTPRequestHandler):
    """A peer server's "drop every block" route (lmcache-mp's /cache/clear, pegaflow-rs's
    /cache/memory/cleanup); ``kept``: blocks it says stayed referenced."""

    def log_message(self, *args):
        pass

    def do_POST(self):
        self.server.caches.clear_host(self.path)
        data = json.dumps({"status": "ok", "still_referenced_blocks": self.server.kept}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class _Fakes:
    caches: dict[str, _Caches] = {}
    kept = 0
    refuses_external = False  # pegaflow's replicas answer reset_external with success false


_FAKES = _Fakes()


@contextlib.contextmanager
def _side_processes(config, name, engine_args, host_gib, log_dir, tag, *, peer_pool_bytes,
                    engine_start_timeout_s, num_vllms=1):
    caches = _FAKES.caches[config] = _Caches(config, 2)
    if config == "pegaflow":
        caches.refuses_external = _FAKES.refuses_external
        yield Sides(name, True, None, lambda: caches.clear_host("engine restart") or 1.5)
        return
    if config == "lmcache":  # in vLLM's process: no server, nothing that empties it
        yield Sides(name, False, peers.Plan(config, {}, {}, None))
        return
    if config in peers.PEERS:
        server = _http(_Clear, caches=caches, kept=_FAKES.kept)
        route = "/cache/clear" if config == "lmcache-mp" else "/cache/memory/cleanup"
        plan = peers.Plan(config, {}, {}, None, clear_url=f"http://127.0.0.1:{server.server_address[1]}{route}")
        try:
            yield Sides(name, False, plan)
        finally:
            server.shutdown()
        return
    yield Sides(name, False, None)


@pytest.fixture
def fakes(monkeypatch):
    _FAKES.caches, _FAKES.kept, _FAKES.refuses_external, _Fleet.made = {}, 0, False, []
    monkeypatch.setattr(bench_peers, "Fleet", _Fleet)
    monkeypatch.setattr(bench_peers, "side_processes", _side_processes)
    monkeypatch.setattr(peers, "unavailable", lambda config: None)
    monkeypatch.setattr(pegaflow.stats.engine_stats, "read_stats", lambda name: dict.fromkeys(ENGINE_STATS, 0))
    return _FAKES


def _run(tmp_path: Path, *configs: str, extra: tuple[str, ...] = ()) -> Path:
    out = tmp_path / "out"
    argv = ["--configs", *configs, "--model", MODEL, "--out-dir", str(out), "--log-dir", str(tmp_path / "logs"),
            "--users", "4", "--rounds", "3", "--context-tokens", "200", "--question-tokens", "8",
            "--answer-tokens", "4", "--ttft-prompts", "3", "--ttft-prompt-tokens", "100", "--serving-users", "3",
            "--prefixes", "2", "--prefix-tokens", "64", "--prefix-requests", "4", "--concurrency", "2", *extra]
    assert bench_peers.main(argv) == 0
    return out


def test_bench_peers_repeats_in_one_fleet_each_start_from_empty_caches(fakes, tmp_path):
    out = _run(tmp_path, "none", "native", "pegaflow", "lmcache-mp", "pegaflow-rs", extra=("--restart",))
    # 1. One fleet per configuration, each replica given the scrub's worker extension, all closed.
    assert len(_Fleet.made) == 5 and all(f.closed for f in _Fleet.made)
    assert all(f.extra_args == ("--worker-extension-cls", "tools.lib.scrub_extension.BenchWorker")
               for f in _Fleet.made)
    for config in ("none", "native", "pegaflow", "lmcache-mp", "pegaflow-rs"):
        runs = json.loads((out / f"{config}.replicas.json").read_text())["runs"]
        # 2. Three repeats of the same chat, only the last one followed by the restart round.
        assert [r["repeat"] for r in runs] == [0, 1, 2]
        assert ["restart" in r for r in runs] == [False, False, True]
        # 3. Each repeat's round 0 was served nothing from any cache: emptied between repeats.
        assert all(r["round0_hit_tokens"] == {"gpu_hit_tokens": 0, "host_hit_tokens": 0} for r in runs), config
        assert runs[0]["reset_before"]["how"] == runs[2]["reset_before"]["how"]
        assert runs[1]["reset_before"]["how"].startswith(
            {"none": "POST /reset_prefix_cache on", "native": "POST /reset_prefix_cache?reset_external",
             "pegaflow": "GPU prefix caches reset, then POST /reset_prefix_cache?reset_external",
             "lmcache-mp": "GPU prefix caches reset, then POST "
             "/cache/clear", "pegaflow-rs": "GPU prefix caches reset, then POST /cache/memory"}[config])
    # 4. The later rounds of a shared cache are served from it; each emptying came its own way:
    #    one before the TTFT (not pegaflow's engine: its pool keeps the serving's blocks) and one
    #    before each of the three repeats (pegaflow's: reset_external on both replicas, no restart).
    later = json.loads((out / "pegaflow.replicas.json").read_text())["runs"][1]
    assert later["chat"]["served_share"] > 0
    assert later["reset_before"]["engine_reset"] == [True, True] and "engine_restart_s" not in later["reset_before"]
    assert fakes.caches["pegaflow"].cleared == ["reset_external"] * 6
    assert fakes.caches["lmcache-mp"].cleared == ["/cache/clear"] * 4
    assert fakes.caches["pegaflow-rs"].cleared == ["/cache/memory/cleanup"] * 4
    assert fakes.caches["native"].cleared == ["reset_external"] * 8  # two replicas, four emptyings


def test_bench_peers_files_merge_into_the_benches_tables(fakes, tmp_path, capsys):
    out = _run(tmp_path, "none", "pegaflow", "lmcache-mp", extra=("--restart",))
    # 1. The replicas' repeats: one row per configuration, the median of three and their spread.
    assert bench_replicas.main(["--merge", *map(str, sorted(out.glob("*.replicas.json"))),
                                "--json", str(tmp_path / "replicas.json")]) == 0
    replicas = json.loads((tmp_path / "replicas.json").read_text())
    assert replicas["pegaflow"]["runs"] == 3 and len(replicas["pegaflow"]["later_rounds_wall_s_spread"]) == 2
    assert replicas["pegaflow"]["outputs_identical"] is True
    assert "restart_first_round_ttft_p50_ms" in replicas["pegaflow"]
    # 2. The serving runs: bench_serving's rows (the fake GPU cache holds everything: no host share).
    assert bench_serving.main(["--merge", *map(str, sorted(out.glob("*.serving.json"))),
                               "--json", str(tmp_path / "serving.json")]) == 0
    serving = json.loads((tmp_path / "serving.json").read_text())
    assert serving["pegaflow"]["outputs_identical"] is True and serving["lmcache-mp"]["runs"] == 1
    # Each merged file reports its runs' own workload (the serving's users, not the chat's).
    assert serving["args"]["users"] == 3 and replicas["args"]["users"] == 4 and replicas["replicas"] == 2
    assert json.loads((out / "pegaflow.serving.json").read_text())["runs"][0]["rounds"][0]["requests"] == 3
    # 3. The TTFT phases: bench_ttft's rows; pegaflow's warm pass served from its cache after the
    #    scrub, its first-token top 5 equal to none's GPU hit's.
    assert bench_peers.main(["--merge-ttft", *map(str, sorted(out.glob("*.ttft.json"))),
                             "--json", str(tmp_path / "ttft.json")]) == 0
    ttft = json.loads((tmp_path / "ttft.json").read_text())
    row = ttft["configs"]["pegaflow"]
    assert row["served_share"] == 1.0 and row["outputs_identical"] is True
    assert row["logprobs_identical"] is True and row["logprobs_compared"] == 3 and row["scrubbed_kv_bytes"] == 4096
    phase = json.loads((out / "pegaflow.ttft.json").read_text())["phase"]
    assert phase["warm_by_source"]["local_cache_hit"] == 0
    # 4. Then the peers table of all three, as docs/benchmarks.md's plan runs it.
    capsys.readouterr()
    assert peers_table.main(["--ttft", str(tmp_path / "ttft.json"), "--serving", str(tmp_path / "serving.json"),
                             "--replicas", str(tmp_path / "replicas.json"), "--date", "2026-12-07"]) == 0
    assert "| replicas, later rounds |" in capsys.readouterr().out


def test_bench_peers_a_server_that_keeps_blocks_is_asked_again_and_its_answer_kept(fakes, tmp_path, monkeypatch,
                                                                                   capsys):
    monkeypatch.setattr(cache_reset, "CLEAR_RETRY_S", 0.3)
    monkeypatch.setattr(cache_reset, "CLEAR_POLL_S", 0.1)
    fakes.kept = 3  # pegaflow-rs says 3 blocks stayed referenced after each cleanup
    out = _run(tmp_path, "pegaflow-rs", extra=("--repeat", "2"))
    runs = json.loads((out / "pegaflow-rs.replicas.json").read_text())["runs"]
    answer = runs[1]["reset_before"]["server_answer"]
    assert answer["still_referenced_blocks"] == 3 and answer["tries"] >= 2
    assert "still holds 3 referenced blocks" in capsys.readouterr().err


def test_bench_peers_pegaflow_reset_that_fails_falls_back_to_an_engine_restart(fakes, tmp_path, capsys):
    # 1. pegaflow's replicas answer reset_external with success false (the engine refused).
    fakes.refuses_external = True
    out = _run(tmp_path, "pegaflow", extra=("--repeat", "2"))
    runs = json.loads((out / "pegaflow.replicas.json").read_text())["runs"]
    # 2. Each emptying restarted the engine instead, and the record says why; round 0 still
    #    found every cache empty.
    assert fakes.caches["pegaflow"].cleared == ["engine restart"] * 2
    assert all(r["reset_before"]["engine_reset"] == [False, False] and r["reset_before"]["engine_restart_s"] > 0
               and r["reset_before"]["how"] == cache_reset.RESTARTED for r in runs)
    assert all(r["round0_hit_tokens"] == {"gpu_hit_tokens": 0, "host_hit_tokens": 0} for r in runs)
    assert "reset_external failed on replicas [0, 1]: restarting the engine" in capsys.readouterr().err


def test_bench_peers_a_peer_failing_leaves_its_error_and_the_next_configuration_runs(fakes, tmp_path, monkeypatch):
    def broken(config, *args, **kwargs):
        raise ConnectionRefusedError("no server")
    monkeypatch.setattr(bench_peers, "side_processes", lambda config, *a, **k: (broken if config == "lmcache-mp"
                                                                               else _side_processes)(config, *a, **k))
    out = _run(tmp_path, "lmcache-mp", "none", "pegaflow", extra=("--repeat", "1"))
    assert "no server" in json.loads((out / "lmcache-mp.failed.json").read_text())["failed"]
    assert [r["repeat"] for r in json.loads((out / "none.replicas.json").read_text())["runs"]] == [0]
    # Its file merges with the others': each bench's row for it says why, with no figure.
    failed = str(out / "lmcache-mp.failed.json")
    for bench, kind in ((bench_replicas, "replicas"), (bench_serving, "serving")):
        merged = tmp_path / f"{kind}.json"
        assert bench.main(["--merge", *map(str, sorted(out.glob(f"*.{kind}.json"))), failed,
                           "--json", str(merged)]) == 0
        row = json.loads(merged.read_text())["lmcache-mp"]
        assert "no server" in row["failed"] and "later_rounds_wall_s" not in row
    assert bench_peers.main(["--merge-ttft", *map(str, sorted(out.glob("*.ttft.json"))), failed,
                             "--json", str(tmp_path / "ttft.json")]) == 0
    assert "no server" in json.loads((tmp_path / "ttft.json").read_text())["configs"]["lmcache-mp"]["failed"]


def test_bench_peers_refuses_repeats_where_a_cache_cannot_be_emptied():
    with pytest.raises(SystemExit):
        bench_peers.parse_args(["--configs", "pegaflow", "lmcache", "--out-dir", "x"])
    assert bench_peers.parse_args(["--configs", "lmcache", "--repeat", "1", "--out-dir", "x"]).repeat == 1


def test_bench_peers_in_process_lmcache_runs_once_its_gpu_caches_reset_only(fakes, tmp_path):
    out = _run(tmp_path, "lmcache", extra=("--repeat", "1"))
    (run,) = json.loads((out / "lmcache.replicas.json").read_text())["runs"]
    assert run["reset_before"]["how"].startswith("GPU prefix caches reset only")
    assert "server_answer" not in run["reset_before"] and "engine_restart_s" not in run["reset_before"]
