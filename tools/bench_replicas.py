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

1. multi-round chat: ``--users`` users, each with a ``--context-tokens`` context, ``--rounds``
   rounds, every turn routed (``tools/serving_workload.py``'s conversations);
2. shared documents (``--doc-requests`` > 0): many users asking about ``--docs`` long documents,
   at most ``--concurrency`` in flight, each request routed (after every replica's GPU prefix
   cache is reset);
3. rolling restart (``--restart``): replica 0 is stopped and started again, as an upgrade does,
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

from tools.lib import peers, processes
from tools.lib.evidence import serving_requests
from tools.lib.fleet import BLOCK_SIZE, Fleet, send_all
from tools.lib.runs import add_chat_args, add_run_args, collect_runs, headline_rows, measured_on, print_failures
from tools.lib.serving_setup import PEGAFLOW_CONFIGS, side_processes
from tools.lib.vllm_serve import complete, hits_of
from tools.replica_router import ROUTERS, Routed, Router, replica_figures
from tools.serving_workload import cacheable_tokens, conversations, shared_prefix_prompts, summarize

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("none", "native", "pegaflow")
SPLIT_PEERS = ("lmcache",)  # peers whose cache lives in each vLLM process: the host budget split


class Chat:
    """The multi-round chat, each turn routed; remembers where each user's last turn went."""

    def __init__(self, args, router: Router):
        self.args, self.router = args, router
        self.users = conversations(args.users, args.context_tokens, args.question_tokens, seed=args.seed)
        self.last_replica: dict[int, int] = {}
        self.computed: dict[int, int] = {}  # tokens of the history some replica has computed

    def round(self, fleet: Fleet, index: int) -> list[Routed]:
        prompts = [u.next_prompt() for u in self.users]
        replicas = self.router.route([u.user for u in self.users])
        jobs = [(f"r{index}u{u.user}", p, rep) for u, p, rep in zip(self.users, prompts, replicas)]
        results = send_all(fleet, jobs, self.args.answer_tokens, len(jobs))
        routed = []
        for user, prompt, replica, result in zip(self.users, prompts, replicas, results):
            moved = user.user in self.last_replica and self.last_replica[user.user] != replica
            routed.append(Routed(result, replica, cacheable_tokens(len(prompt), self.computed.get(user.user, 0),
                                                                   BLOCK_SIZE), moved))
            user.record(prompt, result.tokens)
            # The answer's last token was never fed back, so its KV was never computed.
            self.computed[user.user] = len(prompt) + max(0, len(result.tokens) - 1)
            self.last_replica[user.user] = replica
        return routed


def shared_docs(fleet: Fleet, args, router: Router) -> list[Routed]:
    prompts = shared_prefix_prompts(args.docs, args.doc_tokens, args.doc_requests, args.question_tokens,
                                    seed=args.seed + 1000)
    replicas = router.route([i % args.docs for i in range(len(prompts))])
    jobs = [(f"d{i}", p, rep) for i, (p, rep) in enumerate(zip(prompts, replicas))]
    results = send_all(fleet, jobs, args.answer_tokens, args.concurrency)
    seen: set[int] = set()
    routed = []
    for i, (result, replica) in enumerate(zip(results, replicas)):
        doc = i % args.docs
        # A document's first request computes it; every later one could be served.
        computed = args.doc_tokens if doc in seen else 0
        seen.add(doc)
        routed.append(Routed(result, replica, cacheable_tokens(len(prompts[i]), computed, BLOCK_SIZE), False))
    return routed


def warm_up(port: int, count: int, seed: int) -> list[float]:
    """``count`` short requests (256 new tokens each, 2 answer tokens) to a replica just
    started, as a rolling upgrade's readiness check sends before the balancer routes to it:
    vLLM's first requests pay one-time costs that are no cache's.  Each one's seconds."""
    prompts = shared_prefix_prompts(count, 256, count, 0, seed=seed + 7000) if count else []
    seconds = []
    for i, prompt in enumerate(prompts):
        result = complete(port, prompt, 2, f"warmup{i}")
        if result.error:
            raise RuntimeError(f"the restarted replica's warm-up request failed: {result.error}")
        seconds.append(round(result.done_s - result.started_s, 3))
    return seconds


def _delta(after: dict[int, dict[str, float]], before: dict[int, dict[str, float]], key: str) -> dict[int, float]:
    """Per replica, how much ``hits_of``'s ``key`` grew between two ``Fleet.counters``."""
    return {r: hits_of(after[r])[key] - hits_of(before[r])[key] for r in after}


def _connector_delta(after: dict[int, dict[str, float]], before: dict[int, dict[str, float]]) -> dict:
    """Per replica, how much each ``vllm:pegaflow_*`` series grew (lookup timeouts, latency sums...)."""
    return {r: {k: round(v - before[r].get(k, 0.0), 6) for k, v in mine.items() if k.startswith("vllm:pegaflow_")}
            for r, mine in after.items()}


def run_config(config: str, args, log_dir: Path, tag: str) -> dict:
    name = f"replicas{os.getpid()}"
    split = args.replicas if config in SPLIT_PEERS else 1  # LMCache in vLLM's process: a private cache each
    with side_processes(config, name, args.engine_arg, args.host_gib, log_dir, tag,
                        peer_pool_bytes=(args.host_gib << 30) // split, engine_start_timeout_s=600,
                        num_vllms=1 if split > 1 else args.replicas) as sides:
        fleet = Fleet(config, args, name, log_dir, tag, sides.plan)
        try:
            result = _workloads(config, args, fleet, tag) | {"engine": sides.engine_stats()}
        finally:
            fleet.close()
        # every replica's process is gone: its trace is whole (each process's clock is the host's)
        return result | {"step_timeline": fleet.step_timelines(tuple(result["later_window"])),
                         "warnings": fleet.warnings()}


def _workloads(config: str, args, fleet: Fleet, tag: str) -> dict:
    router = Router(args.router, args.replicas, seed=args.seed)
    chat = Chat(args, router)
    with processes.phase(None, f"{tag} chat round 0"):
        rounds: list[list[Routed]] = [chat.round(fleet, 0)]
    before = fleet.counters()
    for r in range(1, args.rounds):
        with processes.phase(None, f"{tag} chat round {r}"):
            rounds.append(chat.round(fleet, r))
    after = fleet.counters()
    later = [x for rnd in rounds[1:] for x in rnd]
    per_round = [summarize([x.result for x in rnd]) for rnd in rounds]
    started = [x.result.started_s for x in later]
    out = {"config": config, "tag": tag, "time_to_ready_s": list(fleet.ready_s),
           "later_window": [min(started, default=0.0), max((x.result.done_s for x in later), default=0.0)],
           "rounds": per_round,
           "later_rounds": summarize([x.result for x in later]),
           "later_rounds_wall_s": round(sum(r["wall_s"] for r in per_round[1:]), 4),
           "chat": replica_figures(later, _delta(after, before, "host_hit_tokens"), args.replicas),
           "chat_gpu_hit_tokens": sum(_delta(after, before, "gpu_hit_tokens").values()),
           "chat_connector": _connector_delta(after, before)}
    docs: list[Routed] = []
    if args.doc_requests:
        out["docs_reset_wait_s"] = fleet.reset_prefix_caches()
        before = after  # (a reset changes no counter: the chat's last scrape serves)
        with processes.phase(None, f"{tag} shared documents"):
            docs = shared_docs(fleet, args, router)
        after = fleet.counters()
        out["docs"] = replica_figures(docs, _delta(after, before, "host_hit_tokens"), args.replicas) | \
            {"wall_s": summarize([x.result for x in docs])["wall_s"]}
    restart: list[Routed] = []
    if args.restart:
        fleet.stop(0)
        ready_s = fleet.start(0)
        warmup = warm_up(fleet.port(0), args.restart_warmup, args.seed)
        before = fleet.counters()
        with processes.phase(None, f"{tag} restart round"):
            restart = chat.round(fleet, args.rounds)
        after = fleet.counters()
        mine = [x for x in restart if x.replica == 0]
        warm = [x for x in later if x.replica == 0]
        # The replicas that kept running, in the same round and in their warm rounds: whether
        # the round was slower for everyone (the load on the host) or for the restarted one.
        others = [x for x in restart if x.replica != 0]
        others_warm = [x for x in later if x.replica != 0]
        out["restart"] = {"time_to_ready_s": ready_s, "warmup_s": warmup,
                          "first_round": replica_figures(mine, {0: _delta(after, before, "host_hit_tokens")[0]}, 1),
                          "warm_rounds_ttft_p50_ms": _ttft_p50(warm),
                          "others_ttft_p50_ms": _ttft_p50(others), "others_warm_ttft_p50_ms": _ttft_p50(others_warm)}
    every = [x for rnd in rounds for x in rnd] + docs + restart
    out["results"] = [[x.result.key, x.result.tokens, x.result.error] for x in every]
    # per request: its tokens' hash, the prompt tokens vLLM did not compute, where it was routed
    out["requests"] = [record | {"replica": x.replica}
                       for record, x in zip(serving_requests([x.result for x in every]), every)]
    return out


def _ttft_p50(routed: list[Routed]) -> float | None:
    return summarize([x.result for x in routed])["ttft_p50_ms"] if routed else None


def headline(runs: list[dict]) -> dict:
    """Per configuration, the median over repeats (and the spread) of each figure; outputs
    identical: every answer equals the first ``none`` run's."""
    return headline_rows(runs, _figures, lambda mine: sum(r["chat"]["errors"] + r.get("docs", {}).get("errors", 0)
                                                          for r in mine))


def _figures(mine: list[dict]) -> dict[str, list]:
    return {"later_rounds_wall_s": [r["later_rounds_wall_s"] for r in mine],
               "ttft_p50_ms": [r["later_rounds"]["ttft_p50_ms"] for r in mine],
               "ttft_p99_ms": [r["later_rounds"]["ttft_p99_ms"] for r in mine],
               "served_share": [r["chat"]["served_share"] or 0.0 for r in mine],
               "moved_share": [r["chat"]["moved_share"] or 0.0 for r in mine],
               "cached_share": [c for r in mine if (c := r["chat"].get("cached_share")) is not None],
               "time_to_ready_s": [statistics.median(r["time_to_ready_s"]) for r in mine],
               "docs_wall_s": [r["docs"]["wall_s"] for r in mine if "docs" in r],
               "docs_served_share": [r["docs"]["served_share"] or 0.0 for r in mine if "docs" in r],
               "restart_time_to_ready_s": [r["restart"]["time_to_ready_s"] for r in mine if "restart" in r],
               "restart_first_round_ttft_p50_ms": [r["restart"]["first_round"]["ttft_p50_ms"]
                                                   for r in mine if "restart" in r],
               "restart_warm_ttft_p50_ms": [r["restart"]["warm_rounds_ttft_p50_ms"]
                                            for r in mine if "restart" in r]}


COLUMNS = (("later rounds s", "later_rounds_wall_s", "{:.2f}"), ("TTFT p50", "ttft_p50_ms", "{:.0f}"),
           ("TTFT p99", "ttft_p99_ms", "{:.0f}"), ("host served", "served_share", "{:.3f}"),
           ("cached", "cached_share", "{:.3f}"),
           ("moved", "moved_share", "{:.2f}"), ("docs s", "docs_wall_s", "{:.2f}"),
           ("ready s", "time_to_ready_s", "{:.1f}"), ("restart ready s", "restart_time_to_ready_s", "{:.1f}"),
           ("restart TTFT", "restart_first_round_ttft_p50_ms", "{:.0f}"),
           ("warm TTFT", "restart_warm_ttft_p50_ms", "{:.0f}"), ("identical", "identical_share", "{:.3f}"))


def print_table(table: dict) -> None:
    w = max([12, *map(len, table)])  # (an engine variant's name is long)
    print(f"{'config':<{w}}" + "".join(f"{title:>16}" for title, _, _ in COLUMNS))
    for config, row in table.items():
        cells = [fmt.format(row[key]) if key in row else "-" for _, key, fmt in COLUMNS]
        print(f"{config:<{w}}" + "".join(f"{c:>16}" for c in cells))
    print_failures(table)


def write_json(args, runs: list[dict]) -> None:
    gpu, model = measured_on(args)
    table = headline(runs)
    Path(args.json).write_text(json.dumps({"gpu": gpu, "model": model, "replicas": args.replicas,
                                           "router": args.router, "args": vars(args), **table, "runs": runs},
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
    p.add_argument("--start", choices=("together", "one-by-one"), default="together",
                   help="launch the replicas at once (each its KV cache given, no memory profile of the "
                        "others) or each after the previous one is up")
    p.add_argument("--trace", action="store_true",
                   help="pegaflow: each replica's step timeline of the steps that load in the later rounds")
    add_run_args(p, "/tmp/bench_replicas")
    args = p.parse_args(argv)
    if args.replicas < 1:
        p.error(f"--replicas must be at least 1, not {args.replicas}")
    if args.gpu_memory_utilization is None:
        args.gpu_memory_utilization = round(0.85 / args.replicas, 3)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    processes.handle_signals()  # SIGTERM / timeout: every engine, server and vLLM stopped
    runs = collect_runs(args, run_config, write_json,
                        lambda run: {k: run[k] for k in ("tag", "later_rounds_wall_s", "time_to_ready_s")} |
                        {"ttft_p50_ms": run["later_rounds"]["ttft_p50_ms"],
                         "served_share": run["chat"]["served_share"]})
    table = headline(runs)
    print_table(table)
    if args.json:
        write_json(args, runs)
    return 1 if any(row["errors"] for row in table.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
