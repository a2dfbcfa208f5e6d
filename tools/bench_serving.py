"""Serving under load (GPU): ``vllm serve`` once per configuration, driven over its HTTP API.

    python -m tools.bench_serving --model tools/models/llama-3.1-8b-shape --json out.json

Configurations, each its own server process, one after another (``--repeat`` interleaves
them: A B C A B C): ``none`` (vLLM's prefix caching only), ``native`` (vLLM's CPU
offloading, ``--kv-offloading-size``), ``pegaflow`` (a fresh engine each time, the connector's defaults;
``pegaflow-auto``, ``pegaflow-async`` and ``pegaflow-layerwise`` under that load_mode).  vLLM's
default compilation (CUDA graphs on) unless ``--eager``.  The GPU KV cache is capped by
``--gpu-blocks`` so the working set does not fit.  Workloads (``tools/serving_workload.py``):

1. multi-round chat: ``--users`` users, each with a ``--context-tokens`` context, ``--rounds``
   rounds; a round's requests go out together (or at ``--arrival-rate`` per second), and
   the next round starts when all are answered;
2. shared prefix: ``--prefix-requests`` requests over ``--prefixes`` system prompts, at most
   ``--concurrency`` in flight.

Per configuration: wall time of the rounds after the first, TTFT p50/p90/p99 and TPOT of
those rounds, the shared-prefix throughput, tokens vLLM counted as external (host) hits,
and whether every answer equals the first ``none`` run's.  Dummy weights, token-id prompts.
``--trace`` adds, for pegaflow, the connector's timeline of the steps that load
(``tools/step_timeline.py``) per phase: how many such steps, their loads and blocks, and
when their last layer's pages were in and their forward done.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tools import peers, step_timeline
from tools.gpu import gpu_name
from tools.lib import processes
from tools.lib.evidence import serving_requests
from tools.serving_setup import (
    PEGAFLOW_CONFIGS,
    peer_leftovers,
    pegaflow_transfer_args,
    side_processes,
    vllm_settings,
)
from tools.serving_workload import (
    RequestResult,
    conversations,
    identical_share,
    later_rounds_cacheable,
    poisson_offsets,
    shared_prefix_prompts,
    summarize,
)
from tools.warm_pass import BY_SOURCE, SOURCES, empty_gpu_cache

ROOT = Path(__file__).resolve().parent.parent
SERVED_NAME = "bench"
START_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 600.0


def complete(port: int, prompt: list[int], max_tokens: int, key: str, host: str = "127.0.0.1",
             chunk_times: list[float] | None = None) -> RequestResult:
    """One streamed token-id completion; the first chunk carrying tokens is the first token.
    ``chunk_times`` gets the arrival time of every chunk that carries tokens (their gaps are
    the inter-token latencies)."""
    body = json.dumps({"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True, "stream": True, "return_token_ids": True,
                       "stream_options": {"include_usage": True}})
    started = time.monotonic()
    first = done = 0.0
    tokens: list[int] = []
    cached: int | None = None
    conn = http.client.HTTPConnection(host, port, timeout=REQUEST_TIMEOUT_S)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            return RequestResult(key, len(prompt), [], started, started, time.monotonic(),
                                 error=f"HTTP {response.status}: {response.read()[:200]!r}")
        for raw in response:
            line = raw.strip()
            if not line.startswith(b"data:") or (data := line[5:].strip()) == b"[DONE]":
                continue
            chunk = json.loads(data)
            ids = [t for choice in chunk.get("choices") or [] for t in choice.get("token_ids") or []]
            details = (chunk.get("usage") or {}).get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:  # the last chunk: usage
                cached = int(details["cached_tokens"])
            if ids and chunk_times is not None:
                chunk_times.append(time.monotonic())
            if ids and not first:
                first = chunk_times[-1] if chunk_times else time.monotonic()
            tokens += ids
        done = time.monotonic()
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as exc:
        return RequestResult(key, len(prompt), tokens, started, first or started, time.monotonic(),
                             error=f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()
    if not tokens:  # answered, but with no token: not a result to time
        return RequestResult(key, len(prompt), [], started, done, done, error="no token in the answer")
    return RequestResult(key, len(prompt), tokens, started, first, done, cached_tokens=cached)


def run_all(port: int, jobs: list[tuple[str, list[int], float]], max_tokens: int,
            concurrency: int) -> list[RequestResult]:
    """``jobs``: (key, prompt, send at seconds from now); at most ``concurrency`` in flight."""
    t0 = time.monotonic()

    def one(job):
        key, prompt, at = job
        time.sleep(max(0.0, t0 + at - time.monotonic()))
        return complete(port, prompt, max_tokens, key)

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        return list(pool.map(one, jobs))


def multi_round(port: int, args) -> list[list[RequestResult]]:
    users = conversations(args.users, args.context_tokens, args.question_tokens, seed=args.seed)
    rounds = []
    for r in range(args.rounds):
        prompts = [u.next_prompt() for u in users]
        offsets = poisson_offsets(len(users), args.arrival_rate, seed=args.seed + r)
        results = run_all(port, [(f"r{r}u{u.user}", p, at) for u, p, at in zip(users, prompts, offsets)],
                          args.answer_tokens, len(users))
        for user, prompt, result in zip(users, prompts, results):
            user.record(prompt, result.tokens)
        rounds.append(results)
    return rounds


def shared_prefix(port: int, args) -> list[RequestResult]:
    prompts = shared_prefix_prompts(args.prefixes, args.prefix_tokens, args.prefix_requests,
                                    args.question_tokens, seed=args.seed + 1000)
    offsets = poisson_offsets(len(prompts), args.arrival_rate, seed=args.seed + 2000)
    return run_all(port, [(f"p{i}", p, at) for i, (p, at) in enumerate(zip(prompts, offsets))],
                   args.answer_tokens, args.concurrency)


def _get(port: int, path: str, method: str = "GET") -> str:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read().decode()


HIT_COUNTERS = ("vllm:external_prefix_cache_hits_total", "vllm:prefix_cache_hits_total")  # host, own GPU


PEGAFLOW_SERIES = ("_total", "_seconds_sum", "_seconds_count")


def counters(port: int) -> dict[str, float]:
    """The server's counters a run reports (summed over their labels): vLLM's prefix-cache hits
    (external and its own GPU's), its prompt tokens by source where it has them (one key per
    source, ``vllm:prompt_tokens_by_source:SOURCE``) and every ``vllm:pegaflow_*`` counter
    (lookup deferrals, blocks loaded...) and latency histogram's sum and count."""
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(_get(port, "/metrics")):
        for sample in family.samples:
            name = sample.name
            if name in (BY_SOURCE, BY_SOURCE + "_total") and sample.labels.get("source") in SOURCES:
                name = f"{BY_SOURCE}:{sample.labels['source']}"
            elif not (name in HIT_COUNTERS or (name.startswith("vllm:pegaflow_") and name.endswith(PEGAFLOW_SERIES))):
                continue
            out[name] = out.get(name, 0.0) + sample.value
    return out


def by_source_of_counters(found: dict[str, float]) -> dict[str, int] | None:
    """``vllm:prompt_tokens_by_source`` per source, of a server's ``counters()`` (summed over
    engines); None when this vLLM has no such counter."""
    if not any(f"{BY_SOURCE}:{source}" in found for source in SOURCES):
        return None
    return {source: int(found.get(f"{BY_SOURCE}:{source}", 0.0)) for source in SOURCES}


def reset_gpu_cache(port: int) -> float:
    """Empty the server's GPU prefix cache: ``POST /reset_prefix_cache`` until it answers
    ``{"success": true}`` (it refuses while a connector's saves hold blocks; tools/warm_pass.py);
    the seconds that took."""
    return empty_gpu_cache(lambda: json.loads(_get(port, "/reset_prefix_cache", method="POST"))["success"])


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def hits_of(found: dict[str, float]) -> dict[str, float]:
    """Prefix-cache hits (tokens) in a server's ``counters()``: its GPU cache's and the
    external (host) ones.  From ``vllm:prompt_tokens_by_source`` where this vLLM has it (added
    once per request, at its first output; on the GPU it agreed with the connector's own
    count of tokens found to 0.2 %, docs/replicas.md's runs); else from the
    hit counters, which count a request again each time it is scheduled (an asynchronous
    load schedules it twice)."""
    if (by_source := by_source_of_counters(found)) is not None:
        return {"gpu_hit_tokens": float(by_source["local_cache_hit"]),
                "host_hit_tokens": float(by_source["external_kv_transfer"])}
    return {"gpu_hit_tokens": found.get("vllm:prefix_cache_hits_total", 0.0),
            "host_hit_tokens": found.get("vllm:external_prefix_cache_hits_total", 0.0)}


def hit_counters(port: int) -> dict[str, float]:
    """``hits_of`` a server's counters now."""
    return hits_of(counters(port))


def external_hit_tokens(port: int) -> float:
    return hit_counters(port)["host_hit_tokens"]


def server_command(config: str, args, engine_name: str, peer_args: list[str] | None = None) -> list[str]:
    """``peer_args``: a peer's ``--kv-transfer-config`` (``tools/peers.py``'s ``Plan.serve_args``)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(Path(args.model).resolve()),
           "--load-format", "dummy",
           "--skip-tokenizer-init", "--served-model-name", SERVED_NAME, "--port", str(args.port),
           "--enable-prompt-tokens-details",  # each answer's usage says how many prompt tokens were cached
           "--seed", "0", "--max-model-len", str(args.max_model_len),
           "--gpu-memory-utilization", str(args.gpu_memory_utilization),
           "--num-gpu-blocks-override", str(args.gpu_blocks)]
    if args.eager:
        cmd.append("--enforce-eager")
    if config == "native":
        cmd += ["--kv-offloading-size", str(args.host_gib), "--kv-offloading-backend", "native"]
    elif config in PEGAFLOW_CONFIGS:
        cmd += pegaflow_transfer_args(engine_name, **PEGAFLOW_CONFIGS[config])
    return cmd + list(peer_args or ())


class Server:
    """A ``vllm serve`` process, up once /health answers; its log in ``log_path``.  ``extra_env``
    may set PYTHONPATH whole (a peer's package ahead of this repo's) and ``cwd`` move it out of
    the repository (``tools/peers.py`` says why)."""

    def __init__(self, cmd: list[str], port: int, log_path: Path, extra_env: dict | None = None,
                 cwd: Path | None = None, wait: bool = True, leftovers=None):
        env = dict(os.environ, PYTHONHASHSEED="0", VLLM_SERVER_DEV_MODE="1", PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        env.update(extra_env or {})
        self.port, self.log_path, self.log = port, log_path, open(log_path, "w")
        self.launched = time.monotonic()
        # its own process group, stopped whole (its engine core too) however the bench ends
        self.proc = processes.start(cmd, label=f"vllm serve :{port}", stop_signal=signal.SIGINT,
                                    stop_timeout_s=60.0, leftovers=leftovers, cwd=cwd or ROOT, env=env,
                                    stdout=self.log, stderr=subprocess.STDOUT)
        if wait:
            self.wait_ready()

    def wait_ready(self) -> float:
        """Waits for /health to answer; the seconds from launch (stopped and raised if it exits
        or is not up within ``START_TIMEOUT_S``)."""
        deadline = self.launched + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({self.proc.returncode}); see {self.log_path}")
            try:
                _get(self.port, "/health")
                return time.monotonic() - self.launched
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"vllm serve not up after {START_TIMEOUT_S:.0f}s; see {self.log_path}")
                time.sleep(0.5)

    def stop(self) -> None:
        processes.stop(self.proc)
        self.log.close()


def run_config(config: str, args, log_dir: Path, tag: str) -> dict:
    name = f"bench{os.getpid()}"
    trace_path, extra_env = log_dir / f"{tag}.trace.log", {}
    tracing = config in PEGAFLOW_CONFIGS and args.trace
    if tracing:  # the connector's step timeline, into its own file
        logging_path = log_dir / f"{tag}.logging.json"
        logging_path.write_text(json.dumps(step_timeline.logging_config(trace_path)))
        extra_env["VLLM_LOGGING_CONFIG_PATH"] = str(logging_path)
    with side_processes(config, name, args.engine_arg, args.host_gib, log_dir, tag,
                        peer_pool_bytes=args.host_gib << 30, engine_start_timeout_s=300) as sides:
        peer_args, peer_env, cwd = vllm_settings(sides.plan)  # a peer's server (if it has one) is up
        extra_env.update(peer_env)
        with processes.phase("bench_serving", f"{tag} vllm serve start"):
            server = Server(server_command(config, args, name, peer_args), args.port, log_dir / f"{tag}.log",
                            extra_env, cwd, leftovers=peer_leftovers(sides.plan))
        try:
            counts0 = counters(args.port)
            with processes.phase("bench_serving", f"{tag} multi_round"):
                rounds = multi_round(args.port, args)
            counts1 = counters(args.port)
            reset_wait_s = reset_gpu_cache(args.port)
            with processes.phase("bench_serving", f"{tag} shared_prefix"):
                prefix = shared_prefix(args.port, args) if args.prefix_requests else []
            counts2 = counters(args.port)
        finally:
            server.stop()
        engine_stats = sides.engine_stats()
    later = [r for rnd in rounds[1:] for r in rnd]
    phases = {"multi_round": _delta(counts1, counts0), "shared_prefix": _delta(counts2, counts1)}
    timeline = None
    if tracing:  # the steps that loaded, by phase (every process's monotonic clock is the host's)
        lines = trace_path.read_text().splitlines() if trace_path.exists() else []
        steps = step_timeline.parse(lines)
        schedule = step_timeline.parse_schedule(lines)
        timeline = {"later_rounds": step_timeline.summarize(steps, *_window(later)),
                    "shared_prefix": step_timeline.summarize(steps, *_window(prefix)),
                    "first_admission_ms": [step_timeline.first_admission_ms(schedule, _window(rnd)[0])
                                           if rnd else None for rnd in rounds[1:]]}
    per_round = [summarize(rnd) for rnd in rounds]
    return {"config": config, "tag": tag, "rounds": per_round,
            "later_rounds": summarize(later),
            "later_rounds_wall_s": round(sum(r["wall_s"] for r in per_round[1:]), 4),
            "shared_prefix": summarize(prefix) if prefix else None,
            "host_hit_tokens": {phase: hits_of(d)["host_hit_tokens"] for phase, d in phases.items()},
            "cacheable_tokens": {"multi_round": later_rounds_cacheable(
                args.users, args.context_tokens, args.question_tokens, args.seed,
                [[r.tokens for r in rnd] for rnd in rounds])},
            "reset_wait_s": reset_wait_s,
            "counters": phases,
            "engine": engine_stats,
            "step_timeline": timeline,
            "results": [[r.key, r.tokens, r.error] for rnd in rounds for r in rnd] +
                       [[r.key, r.tokens, r.error] for r in prefix],
            # per request: its tokens' hash and the prompt tokens vLLM did not compute
            "requests": serving_requests([r for rnd in rounds for r in rnd] + prefix),
            # sent, first token, done (monotonic s, the clock of the step timeline's lines)
            "timings": [[r.key, round(r.started_s, 6), round(r.first_token_s, 6), round(r.done_s, 6)]
                        for rnd in rounds for r in rnd]}


def run_or_fail(config: str, args, log_dir: Path, tag: str) -> dict:
    """``run_config``; a peer that fails at run time (its server, its ``vllm serve``, a GPU cache
    that never empties) is a run that says so, and the bench goes on with the next configuration."""
    from pegaflow.platform.errors import PeerError
    if config not in peers.PEERS:
        return run_config(config, args, log_dir, tag)
    try:
        return run_config(config, args, log_dir, tag)
    except (PeerError, RuntimeError) as exc:  # Server's and warm_pass's errors are RuntimeErrors
        print(f"bench_serving: {config} failed: {exc}", file=sys.stderr, flush=True)
        return {"config": config, "tag": tag, "failed": str(exc)}


def available_configs(configs: list[str]) -> list[str]:
    """``configs`` less the peers whose packages cannot be imported here (one line each)."""
    kept = []
    for config in configs:
        reason = peers.unavailable(config) if config in peers.PEERS else None
        if reason is None:
            kept.append(config)
        else:
            print(peers.skip_line(config, reason), file=sys.stderr, flush=True)
    return kept


def _window(results: list[RequestResult]) -> tuple[float, float]:
    """From the first request's start to the last one's end (nothing: an empty window)."""
    if not results:
        return 0.0, 0.0
    return min(r.started_s for r in results), max(r.done_s for r in results)


def _as_results(run: dict) -> list[RequestResult]:
    return [RequestResult(key, 0, tokens, 0.0, 0.0, 0.0, error) for key, tokens, error in run["results"]]


def served_share(run: dict) -> float | None:
    """The later rounds' prompt tokens served from host memory over those a complete cache
    would serve (round 1 has nothing to serve); None for a run without the counts."""
    cacheable = (run.get("cacheable_tokens") or {}).get("multi_round")
    if not cacheable:
        return None
    return run["host_hit_tokens"]["multi_round"] / cacheable


def headline(runs: list[dict]) -> dict:
    """Per configuration, the median over repeats (and the spread) of its figures; outputs
    identical: every answer equals the first ``none`` run's."""
    def figures(mine: list[dict]) -> dict[str, list]:
        return {"later_rounds_wall_s": [r["later_rounds_wall_s"] for r in mine],
                "ttft_p50_ms": [r["later_rounds"]["ttft_p50_ms"] for r in mine],
                "ttft_p99_ms": [r["later_rounds"]["ttft_p99_ms"] for r in mine],
                "throughput_rps": [r["shared_prefix"]["throughput_rps"] for r in mine if r["shared_prefix"]],
                "served_share": [share for r in mine if (share := served_share(r)) is not None]}

    def errors(mine: list[dict]) -> int:
        return sum(r["later_rounds"]["errors"] + (r["shared_prefix"] or {}).get("errors", 0) for r in mine)

    table = headline_rows([r for r in runs if "failed" not in r], figures, errors)
    for run in runs:  # a configuration none of whose runs finished: why, instead of figures
        if "failed" in run and run["config"] not in table:
            table[run["config"]] = {"failed": run["failed"], "errors": 0}
    return table


def headline_rows(runs: list[dict], figures_of, errors_of) -> dict:
    """One row per configuration (in the order they first ran): the median of each of
    ``figures_of(its runs)`` and their spread, its failed requests (``errors_of``), and
    whether every answer equals the first ``none`` run's."""
    reference = next((_as_results(r) for r in runs if r["config"] == "none"), None)
    out = {}
    for config in dict.fromkeys(r["config"] for r in runs):
        mine = [r for r in runs if r["config"] == config]
        figures = figures_of(mine)
        row = {k: statistics.median(v) for k, v in figures.items() if v}
        row.update({f"{k}_spread": [min(v), max(v)] for k, v in figures.items() if v})
        # Failed requests are left out of the timings: say how many, so a faster row that
        # dropped requests is seen for what it is.
        row["errors"] = errors_of(mine)
        row["runs"] = len(mine)
        if reference is not None:
            shares = [identical_share(_as_results(r), reference) for r in mine]
            row["identical_share"] = min(shares)
            row["outputs_identical"] = all(s == 1.0 for s in shares)
        out[config] = row
    return out


def add_chat_args(p: argparse.ArgumentParser, users: int) -> None:
    """The multi-round chat's arguments, and how its servers run (shared with bench_replicas)."""
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--eager", action="store_true", help="--enforce-eager (default: CUDA graphs)")
    p.add_argument("--users", type=int, default=users)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--context-tokens", type=int, default=8000)
    p.add_argument("--question-tokens", type=int, default=64)
    p.add_argument("--answer-tokens", type=int, default=16)


def add_run_args(p: argparse.ArgumentParser, log_dir: str) -> None:
    """The seed, where logs go, the engine's flags and the JSON in and out (shared with bench_replicas)."""
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=log_dir)
    p.add_argument("--engine-arg", action="append", default=[], metavar="FLAG",
                   help="a flag for pegaflow's engine, e.g. --engine-arg=--copy-backend=staged (repeatable)")
    p.add_argument("--json", metavar="PATH", help="write every figure here (rewritten after every configuration)")
    p.add_argument("--merge", nargs="+", default=[], metavar="JSON",
                   help="run nothing: one table of the runs in these --json files (a run split over calls)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0].replace("``", ""))
    p.add_argument("--model", default=str(ROOT / "tools/models/llama-3.1-8b-shape"))
    p.add_argument("--configs", nargs="+", default=["none", "native", "pegaflow"],
                   choices=["none", "native", *PEGAFLOW_CONFIGS, *peers.PEERS],
                   help="pegaflow: the connector's defaults (load_mode auto); pegaflow-auto / -async / "
                        "-layerwise: under that load_mode; lmcache, lmcache-mp, pegaflow-rs: the peers "
                        "(tools/peers.py), skipped with one line where their packages are missing")
    add_chat_args(p, users=12)
    p.add_argument("--arrival-rate", type=float, default=float("inf"),
                   help="requests per second within a round (default: a round's all at once)")
    p.add_argument("--prefixes", type=int, default=16,
                   help="system prompts (16 x 4000 tokens: more than the default GPU cache holds)")
    p.add_argument("--prefix-tokens", type=int, default=4000)
    p.add_argument("--prefix-requests", type=int, default=64, help="0: no shared-prefix workload")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--gpu-blocks", type=int, default=2500, help="vLLM's GPU KV cache, in blocks")
    p.add_argument("--host-gib", type=int, default=32, help="host cache of native and pegaflow")
    p.add_argument("--max-model-len", type=int, default=16384)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--trace", action="store_true",
                   help="pegaflow's step timeline of the steps that load, per phase (adds CUDA events)")
    add_run_args(p, "/tmp/bench_serving")
    args = p.parse_args(argv)
    processes.handle_signals()  # SIGTERM / timeout: every engine, server and vLLM stopped
    runs = collect_runs(args, run_or_fail, write_json,
                        lambda run: {k: run[k] for k in ("tag", "failed", "later_rounds_wall_s", "later_rounds",
                                                         "host_hit_tokens") if k in run})
    table = headline(runs)
    print_table(table)
    if args.json:
        write_json(args, runs)
    return 1 if any(row["errors"] for row in table.values()) else 0


def collect_runs(args, run_config, write_json, progress) -> list[dict]:
    """The runs of ``--merge``'s files, or else every configuration ``--repeat`` times,
    interleaved (A B C A B C; a config named twice: its run-to-run agreement), a line of
    ``progress(run)`` after each and the JSON rewritten, so a run cut short keeps what it measured."""
    runs = [run for path in args.merge for run in json.loads(Path(path).read_text())["runs"]]
    if args.merge:
        return runs
    args.configs = available_configs(args.configs)
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    for rep in range(args.repeat):
        for i, config in enumerate(args.configs):
            runs.append(run_config(config, args, log_dir, f"{config}{rep}-{i}"))
            print(json.dumps(progress(runs[-1])), flush=True)
            if args.json:
                write_json(args, runs)
    return runs


def print_table(table: dict) -> None:
    print(f"{'config':<14} {'later rounds s':>15} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'prefix rps':>11} "
          f"{'identical':>9}")
    for config, row in table.items():
        if "failed" in row:
            print(f"{config:<14} failed: {row['failed']}")
            continue
        print(f"{config:<14} {row['later_rounds_wall_s']:>15.3f} {row['ttft_p50_ms']:>12.1f} "
              f"{row['ttft_p99_ms']:>12.1f} {row.get('throughput_rps', float('nan')):>11.2f} "
              f"{row.get('identical_share', float('nan')):>9.3f}")
    print_failures(table)


def print_failures(table: dict) -> None:
    """One line on stderr naming the configurations some of whose requests failed."""
    if any(row["errors"] for row in table.values()):
        print("requests failed: " + ", ".join(f"{c} {row['errors']}" for c, row in table.items()
                                              if row["errors"]), file=sys.stderr)


def measured_on(args) -> tuple[str, str]:
    """The GPU and model of a run; merged runs keep those they were measured with."""
    if args.merge:
        first = json.loads(Path(args.merge[0]).read_text())
        return first["gpu"], first["model"]
    return gpu_name(), args.model


def write_json(args, runs: list[dict]) -> None:
    """Every figure and every run."""
    gpu, model = measured_on(args)
    Path(args.json).write_text(json.dumps({"gpu": gpu, "model": model,
                                           "args": vars(args) | {"arrival_rate": str(args.arrival_rate)},
                                           **headline(runs), "runs": runs}, indent=1))

if __name__ == "__main__":
    sys.exit(main())
