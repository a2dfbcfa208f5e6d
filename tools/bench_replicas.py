"""Many replicas, one cache (GPU): N ``vllm serve`` processes behind a router, per configuration.

    python -m tools.bench_replicas --replicas 2 --model tools/models/llama-3.1-8b-shape \\
        --configs none native pegaflow --json docs/benchmarks/replicas.json

Each configuration runs in its own processes, one after another (``--repeat`` interleaves them):
``none`` (vLLM's prefix caching only), ``native`` (each replica its own ``--kv-offloading-size``:
``--host-gib`` split evenly), ``pegaflow`` (one engine with a ``--host-gib`` pool, every replica
attached to it; ``--engine-variants default hold-saves`` runs it once per engine variant instead,
``tools/lib/engine_variants.py``), and the peers of ``tools/lib/peers.py`` (``lmcache``: a private cache per replica,
split like native's; ``lmcache-mp`` and ``pegaflow-rs``: one server with the whole budget).
The replicas share one GPU (each ``--gpu-memory-utilization``, its GPU KV cache capped by
``--gpu-blocks`` so the working set does not fit) and start together (``--start``: ``Fleet``).  A router
inside the bench (``tools/replica_router.py``) spreads requests with no session affinity
(``--router round-robin|random``; ``affinity`` keeps each user on one replica).  vLLM's default
compilation (CUDA graphs on) unless ``--eager``.

Workloads, in this order:

1. multi-round chat: ``--users`` users (0: no chat), each with a ``--context-tokens`` context,
   ``--rounds`` rounds, every turn routed (``tools/serving_workload.py``'s conversations);
2. shared documents (``--doc-requests`` > 0): many users asking about ``--docs`` long documents,
   at most ``--concurrency`` in flight, each request routed (after every replica's GPU prefix
   cache is reset);
3. burst (``--burst-docs`` N > 0; compute once, docs/replicas.md): N new documents of
   ``--burst-doc-tokens``, each sent at the same moment to every replica with a question of its
   own, no router (``tools/lib/burst.py``): the burst's wall time, TTFT p50/p99, the prompt tokens
   the replicas computed (``prefill_tokens_computed``, from each answer's ``cached_tokens``)
   against ``unique_prompt_tokens``, each answer's hash against ``none``'s; for pegaflow the
   engine's compute-once counters over it (``pegaflow-no-compute-once``: the engine's
   ``--no-compute-once`` and the connector's ``compute_once: false``);
4. rolling restart (``--restart``): replica 0 is stopped and started again, as an upgrade does,
   sent ``--restart-warmup`` short requests as a readiness check does, and one more chat round
   follows.  Its time to ready and its requests' TTFT in that round are measured beside its
   warm rounds' (the chat's later rounds).

Per configuration: the wall time of the later rounds (the rounds after the first), their TTFT
p50/p99, the share of their cacheable prompt tokens served from host memory (vLLM's external
hits over the full blocks of what some replica computed before), per replica too, the share of
turns that moved to another replica, each replica's time to ready, the restart figures, and
whether every answer equals the first ``none`` run's; for pegaflow also each replica's
connector counters over the chat (lookup timeouts and deferrals, latency sums), the engine's
command latencies and any pegaflow WARNING of the replicas' logs.  Dummy weights, token-id prompts.
``--trace`` adds, for pegaflow, each replica's step timeline of the steps that load during the
later rounds (``tools/step_timeline.py``): where a loaded request's time goes, per replica.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from tools.lib import burst, peers, processes
from tools.lib.fleet import Fleet
from tools.lib.replica_workloads import Chat, run_workloads  # noqa: F401  (tests/e2e import Chat from here)
from tools.lib.runs import (
    add_chat_args,
    add_run_args,
    collect_runs,
    headline_rows,
    measured_on,
    print_failures,
    recorded_args,
)
from tools.lib.serving_setup import PEGAFLOW_CONFIGS, side_processes
from tools.replica_router import ROUTERS

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("none", "native", "pegaflow")
SPLIT_PEERS = ("lmcache",)  # peers whose cache lives in each vLLM process: the host budget split


def run_config(config: str, args, log_dir: Path, tag: str) -> dict:
    name = f"replicas{os.getpid()}"
    split = args.replicas if config in SPLIT_PEERS else 1  # LMCache in vLLM's process: a private cache each
    with side_processes(config, name, args.engine_arg, args.host_gib, log_dir, tag,
                        peer_pool_bytes=(args.host_gib << 30) // split, engine_start_timeout_s=600,
                        num_vllms=1 if split > 1 else args.replicas) as sides:
        fleet = Fleet(config, args, name, log_dir, tag, sides.plan)
        claims = (lambda: burst.claim_counters(sides.engine_name)) if sides.has_engine else None
        try:
            result = run_workloads(config, args, fleet, tag, claims) | {"engine": sides.engine_stats()}
        finally:
            fleet.close()
        # every replica's process is gone: its trace is whole (each process's clock is the host's)
        return result | {"step_timeline": fleet.step_timelines(tuple(result.get("later_window", (0.0, 0.0)))),
                         "warnings": fleet.warnings()}


def headline(runs: list[dict]) -> dict:
    """Per configuration, the median over repeats (and the spread) of each figure; outputs
    identical: every answer equals the first ``none`` run's (``burst_identical_share``: the
    burst's answers alone)."""
    table = headline_rows(runs, _figures, lambda mine: sum(r.get(part, {}).get("errors", 0) for r in mine
                                                           for part in ("chat", "docs", "burst")))
    burst.mark_identical(table, runs)
    return table


def _figures(mine: list[dict]) -> dict[str, list]:
    chats = [r for r in mine if "chat" in r]
    return {"later_rounds_wall_s": [r["later_rounds_wall_s"] for r in chats],
            "ttft_p50_ms": [r["later_rounds"]["ttft_p50_ms"] for r in chats],
            "ttft_p99_ms": [r["later_rounds"]["ttft_p99_ms"] for r in chats],
            "served_share": [r["chat"]["served_share"] or 0.0 for r in chats],
            "moved_share": [r["chat"]["moved_share"] or 0.0 for r in chats],
            "cached_share": [c for r in chats if (c := r["chat"].get("cached_share")) is not None],
            "time_to_ready_s": [statistics.median(r["time_to_ready_s"]) for r in mine],
            "docs_wall_s": [r["docs"]["wall_s"] for r in mine if "docs" in r],
            "docs_served_share": [r["docs"]["served_share"] or 0.0 for r in mine if "docs" in r],
            "restart_time_to_ready_s": [r["restart"]["time_to_ready_s"] for r in mine if "restart" in r],
            "restart_first_round_ttft_p50_ms": [r["restart"]["first_round"]["ttft_p50_ms"]
                                                for r in mine if "restart" in r],
            "restart_warm_ttft_p50_ms": [r["restart"]["warm_rounds_ttft_p50_ms"]
                                         for r in mine if "restart" in r],
            **burst.headline_figures(mine)}


COLUMNS = (("later rounds s", "later_rounds_wall_s", "{:.2f}"), ("TTFT p50", "ttft_p50_ms", "{:.0f}"),
           ("TTFT p99", "ttft_p99_ms", "{:.0f}"), ("host served", "served_share", "{:.3f}"),
           ("cached", "cached_share", "{:.3f}"),
           ("moved", "moved_share", "{:.2f}"), ("docs s", "docs_wall_s", "{:.2f}"),
           ("ready s", "time_to_ready_s", "{:.1f}"), ("restart ready s", "restart_time_to_ready_s", "{:.1f}"),
           ("restart TTFT", "restart_first_round_ttft_p50_ms", "{:.0f}"),
           ("warm TTFT", "restart_warm_ttft_p50_ms", "{:.0f}"), ("identical", "identical_share", "{:.3f}"))


def print_table(table: dict) -> None:
    """The chat's, documents' and restart's table; then the burst's, where one ran."""
    bursts = {config: row for config, row in table.items() if "burst_wall_s" in row}
    chats = {config: row for config, row in table.items()
             if "later_rounds_wall_s" in row or not bursts and "failed" not in row}
    for columns, rows in ((COLUMNS, chats), (burst.COLUMNS, bursts)):
        if not rows:
            continue
        w = max([26, *map(len, rows)])  # (an engine variant's name is long)
        print(f"{'config':<{w}}" + "".join(f"{title:>16}" for title, _, _ in columns))
        for config, row in rows.items():
            cells = [fmt.format(row[key]) if key in row else "-" for _, key, fmt in columns]
            print(f"{config:<{w}}" + "".join(f"{c:>16}" for c in cells))
    for config, row in table.items():
        if "failed" in row:
            print(f"{config} failed: {row['failed']}")
    print_failures(table)


def write_json(args, runs: list[dict]) -> None:
    gpu, model = measured_on(args)
    table, recorded = headline(runs), recorded_args(args)
    Path(args.json).write_text(json.dumps({"gpu": gpu, "model": model, "replicas": recorded["replicas"],
                                           "router": recorded["router"], "args": recorded, **table, "runs": runs},
                                          indent=1))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "tools/models/llama-3.1-8b-shape"))
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--router", choices=ROUTERS, default="round-robin")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS),
                   choices=list(dict.fromkeys([*CONFIGS, *PEGAFLOW_CONFIGS, *peers.PEERS])),
                   help="lmcache (a private cache per replica, split like native's), lmcache-mp (LMCache's "
                        "server shared by every replica), pegaflow-rs (one PegaFlow server): tools/lib/peers.py; "
                        "a peer whose packages are missing is skipped with one line")
    # 32 users x 8 000 tokens (about 270 000 tokens by round 4): twice what two replicas' GPU
    # caches of --gpu-blocks 4 000 (64 000 tokens each) hold
    add_chat_args(p, users=32)
    p.add_argument("--docs", type=int, default=4, help="shared documents")
    p.add_argument("--doc-tokens", type=int, default=6000)
    p.add_argument("--doc-requests", type=int, default=32, help="0: no shared-documents workload")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--burst-docs", type=int, default=0, metavar="N",
                   help="then the burst: N new documents, each sent at once to every replica with a "
                        "question of its own (0: no burst)")
    p.add_argument("--burst-doc-tokens", type=int, default=8000, help="each burst document's tokens")
    p.add_argument("--burst-question-tokens", type=int, default=64, help="each burst request's own question")
    p.add_argument("--restart", action="store_true", help="then restart replica 0 and run one more round")
    p.add_argument("--restart-warmup", type=int, default=1, metavar="N",
                   help="short requests sent to the restarted replica before its round (a readiness "
                        "check's warm-up; 0: none)")
    p.add_argument("--gpu-blocks", type=int, default=4000, help="each replica's GPU KV cache, in blocks")
    p.add_argument("--host-gib", type=int, default=64, help="the host cache, in all (native: split evenly)")
    p.add_argument("--max-model-len", type=int, default=16384)
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="each replica's share of the GPU (default: 0.85 / replicas)")
    p.add_argument("--port", type=int, default=8011, help="replica i listens on port + i")
    p.add_argument("--start", choices=("together", "at-once", "one-by-one"), default="together",
                   help="launch the replicas at once (each its KV cache given, no memory profile of the "
                        "others; replica 0 first, alone, while vLLM's compile cache is empty; at-once: "
                        "not even then) or each after the previous one is up")
    p.add_argument("--trace", action="store_true",
                   help="pegaflow: each replica's step timeline of the steps that load in the later rounds")
    add_run_args(p, "/tmp/bench_replicas")
    args = p.parse_args(argv)
    if args.replicas < 1:
        p.error(f"--replicas must be at least 1, not {args.replicas}")
    if args.restart and not args.users:
        p.error("--restart runs one more chat round: it needs --users")
    if min(args.burst_docs, args.burst_doc_tokens, args.burst_question_tokens) < 0:
        p.error("--burst-docs, --burst-doc-tokens and --burst-question-tokens cannot be negative")
    if args.gpu_memory_utilization is None:
        args.gpu_memory_utilization = round(0.85 / args.replicas, 3)
    return args


def _progress(run: dict) -> dict:
    """The line printed after each configuration's run."""
    line = {k: run[k] for k in ("tag", "later_rounds_wall_s", "time_to_ready_s") if k in run}
    if "chat" in run:
        line |= {"ttft_p50_ms": run["later_rounds"]["ttft_p50_ms"], "served_share": run["chat"]["served_share"]}
    if "burst" in run:
        line |= {f"burst_{k}": run["burst"][k] for k in ("wall_s", "ttft_p99_ms", "prefill_tokens_computed")}
    return line


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    processes.handle_signals()  # SIGTERM / timeout: every engine, server and vLLM stopped
    runs = collect_runs(args, run_config, write_json, _progress)
    table = headline(runs)
    print_table(table)
    if args.json:
        write_json(args, runs)
    return 1 if any(row["errors"] for row in table.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
