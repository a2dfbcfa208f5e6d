"""Serving under load (GPU): ``vllm serve`` once per configuration, driven over its HTTP API.

    python -m tools.bench_serving --model tools/models/llama-3.1-8b-shape --json out.json

Configurations, each its own server process, one after another (``--repeat`` interleaves
them: A B C A B C): ``none`` (vLLM's prefix caching only), ``native`` (vLLM's CPU
offloading, ``--kv-offloading-size``), ``pegaflow`` (a fresh engine each time, the connector's defaults;
``pegaflow-auto``, ``pegaflow-async`` and ``pegaflow-layerwise`` under that load_mode;
``--engine-variants default hold-saves`` runs ``pegaflow`` once per engine variant instead,
``tools/lib/engine_variants.py``).  vLLM's
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
import json
import os
import sys
from pathlib import Path

from tools import step_timeline
from tools.lib import peers, processes
from tools.lib.runs import (
    add_chat_args,
    add_run_args,
    collect_runs,
    headline_rows,
    measured_on,
    print_failures,
    recorded_args,
)
from tools.lib.serving_run import measure, record
from tools.lib.serving_setup import (
    PEGAFLOW_CONFIGS,
    is_pegaflow,
    peer_leftovers,
    side_processes,
    vllm_settings,
)
from tools.lib.vllm_serve import (  # noqa: F401  (tests/e2e import external_hit_tokens and run_all from here)
    Server,
    external_hit_tokens,
    run_all,
    server_command,
)
from tools.serving_workload import RequestResult

ROOT = Path(__file__).resolve().parent.parent


def run_config(config: str, args, log_dir: Path, tag: str) -> dict:
    name = f"bench{os.getpid()}"
    trace_path, extra_env = log_dir / f"{tag}.trace.log", {}
    tracing = is_pegaflow(config) and args.trace
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
            measured = measure(args.port, args, tag, "bench_serving")
        finally:
            server.stop()
        engine_stats = sides.engine_stats()
    timeline = None
    if tracing:  # the steps that loaded, by phase (every process's monotonic clock is the host's)
        rounds, prefix = measured.rounds, measured.prefix
        later = [r for rnd in rounds[1:] for r in rnd]
        lines = trace_path.read_text().splitlines() if trace_path.exists() else []
        steps = step_timeline.parse(lines)
        schedule = step_timeline.parse_schedule(lines)
        timeline = {"later_rounds": step_timeline.summarize(steps, *_window(later)),
                    "shared_prefix": step_timeline.summarize(steps, *_window(prefix)),
                    "first_admission_ms": [step_timeline.first_admission_ms(schedule, _window(rnd)[0])
                                           if rnd else None for rnd in rounds[1:]]}
    return record(config, tag, args, measured, engine_stats, timeline)


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


def _window(results: list[RequestResult]) -> tuple[float, float]:
    """From the first request's start to the last one's end (nothing: an empty window)."""
    if not results:
        return 0.0, 0.0
    return min(r.started_s for r in results), max(r.done_s for r in results)


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

    return headline_rows(runs, figures, errors)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0].replace("``", ""))
    p.add_argument("--model", default=str(ROOT / "tools/models/llama-3.1-8b-shape"))
    p.add_argument("--configs", nargs="+", default=["none", "native", "pegaflow"],
                   choices=["none", "native", *PEGAFLOW_CONFIGS, *peers.PEERS],
                   help="pegaflow: the connector's defaults (load_mode auto); pegaflow-auto / -async / "
                        "-layerwise: under that load_mode; lmcache, lmcache-mp, pegaflow-rs: the peers "
                        "(tools/lib/peers.py), skipped with one line where their packages are missing")
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


def print_table(table: dict) -> None:
    w = max([14, *map(len, table)])  # (an engine variant's name is long)
    print(f"{'config':<{w}} {'later rounds s':>15} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'prefix rps':>11} "
          f"{'identical':>9}")
    for config, row in table.items():
        if "failed" in row:
            print(f"{config:<{w}} failed: {row['failed']}")
            continue
        print(f"{config:<{w}} {row['later_rounds_wall_s']:>15.3f} {row['ttft_p50_ms']:>12.1f} "
              f"{row['ttft_p99_ms']:>12.1f} {row.get('throughput_rps', float('nan')):>11.2f} "
              f"{row.get('identical_share', float('nan')):>9.3f}")
    print_failures(table)


def write_json(args, runs: list[dict]) -> None:
    """Every figure and every run."""
    gpu, model = measured_on(args)
    Path(args.json).write_text(json.dumps({"gpu": gpu, "model": model,
                                           "args": recorded_args(args),
                                           **headline(runs), "runs": runs}, indent=1))

if __name__ == "__main__":
    sys.exit(main())
