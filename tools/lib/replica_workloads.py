"""The workloads of N ``vllm serve`` replicas behind a router (``bench_replicas``, ``bench_peers``):
the multi-round chat with every turn routed, the shared documents and the rolling restart of
replica 0, each request's figures kept per replica.

- ``Chat``: the conversations, each turn routed (``tools/replica_router.py``);
- ``run_workloads(config, args, fleet, tag)``: the chat's ``--rounds`` rounds, then the shared
  documents (``--doc-requests``) and the restart (``--restart``) where asked; one run's record,
  the one ``bench_replicas`` writes per configuration and reads back with ``--merge``.  Round 0's
  prompt tokens served from a cache (``round0_hit_tokens``) say whether the fleet's caches were
  empty when it began (they must be: no turn of round 0 was ever computed before);
- ``warm_up(port, count, seed)``: a readiness check's short requests to one replica.
"""

from __future__ import annotations

from tools.lib import burst, processes
from tools.lib.evidence import serving_requests
from tools.lib.fleet import BLOCK_SIZE, Fleet, send_all
from tools.lib.vllm_serve import complete, hits_of
from tools.replica_router import Routed, Router, replica_figures
from tools.serving_workload import cacheable_tokens, conversations, shared_prefix_prompts, summarize


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


def run_workloads(config: str, args, fleet: Fleet, tag: str, claim_counters=None) -> dict:
    """Every workload the arguments ask for, in order; ``claim_counters``: the engine's
    compute-once counters now (pegaflow), read around the burst."""
    router = Router(args.router, args.replicas, seed=args.seed)
    out: dict = {"config": config, "tag": tag, "time_to_ready_s": list(fleet.ready_s)}
    chat, rounds, after = Chat(args, router), [], None
    if args.users:
        rounds, after = _chat(out, chat, fleet, args, tag)
    later = [x for rnd in rounds[1:] for x in rnd]
    docs: list[Routed] = []
    if args.doc_requests:
        out["docs_reset_wait_s"] = fleet.reset_prefix_caches()
        # (a reset changes no counter: the chat's last scrape serves)
        before = after if after is not None else fleet.counters()
        with processes.phase(None, f"{tag} shared documents"):
            docs = shared_docs(fleet, args, router)
        after = fleet.counters()
        out["docs"] = replica_figures(docs, _delta(after, before, "host_hit_tokens"), args.replicas) | \
            {"wall_s": summarize([x.result for x in docs])["wall_s"]}
    bursts: list[Routed] = []
    if args.burst_docs:
        out["burst"], bursts = _burst(fleet, args, tag, claim_counters)
    restart: list[Routed] = []
    if args.restart:
        out["restart"], restart = _restart(fleet, args, tag, chat, later)
    every = [x for rnd in rounds for x in rnd] + docs + bursts + restart
    out["results"] = [[x.result.key, x.result.tokens, x.result.error] for x in every]
    # per request: its tokens' hash, the prompt tokens vLLM did not compute, where it was routed
    out["requests"] = [record | {"replica": x.replica}
                       for record, x in zip(serving_requests([x.result for x in every]), every)]
    return out


def _chat(out: dict, chat: Chat, fleet: Fleet, args, tag: str) -> tuple[list[list[Routed]], dict]:
    """The multi-round chat; its figures into ``out`` (``round0_hit_tokens``: what round 0
    was served from any cache, nothing after an emptying); its rounds and the counters after."""
    fresh = fleet.counters()
    with processes.phase(None, f"{tag} chat round 0"):
        rounds: list[list[Routed]] = [chat.round(fleet, 0)]
    before = fleet.counters()
    round0_hits = {key: sum(_delta(before, fresh, key).values()) for key in ("gpu_hit_tokens", "host_hit_tokens")}
    for r in range(1, args.rounds):
        with processes.phase(None, f"{tag} chat round {r}"):
            rounds.append(chat.round(fleet, r))
    after = fleet.counters()
    later = [x for rnd in rounds[1:] for x in rnd]
    per_round = [summarize([x.result for x in rnd]) for rnd in rounds]
    started = [x.result.started_s for x in later]
    out.update({"later_window": [min(started, default=0.0), max((x.result.done_s for x in later), default=0.0)],
                "rounds": per_round,
                "later_rounds": summarize([x.result for x in later]),
                "later_rounds_wall_s": round(sum(r["wall_s"] for r in per_round[1:]), 4),
                "chat": replica_figures(later, _delta(after, before, "host_hit_tokens"), args.replicas),
                "chat_gpu_hit_tokens": sum(_delta(after, before, "gpu_hit_tokens").values()),
                "round0_hit_tokens": round0_hits,
                "chat_connector": _connector_delta(after, before)})
    return rounds, after


def _burst(fleet: Fleet, args, tag: str, claim_counters) -> tuple[dict, list[Routed]]:
    """The burst (tools/lib/burst.py): every replica warmed by one short request of its own
    first (a fresh vLLM's first requests pay one-time costs), then every document to every
    replica at once.  Its figures, with the connector's and the engine's counters over it."""
    for replica in range(args.replicas):
        warm_up(fleet.port(replica), 1, args.seed + 100 + replica)
    requests = burst.burst_requests(args.burst_docs, args.burst_doc_tokens, args.replicas,
                                    args.burst_question_tokens, seed=args.seed + 2000)
    before, engine_before = fleet.counters(), claim_counters() if claim_counters else None
    with processes.phase(None, f"{tag} burst"):
        results = burst.send_burst(fleet.port, requests, args.answer_tokens)
    after = fleet.counters()
    unique = burst.unique_prompt_tokens(args.burst_docs, args.burst_doc_tokens, args.replicas,
                                        args.burst_question_tokens)
    figures = burst.burst_figures(requests, results, args.replicas, unique)
    figures["connector"] = _connector_delta(after, before)
    if claim_counters:
        figures["engine_claims"] = {k: v - engine_before[k] for k, v in claim_counters().items()}
    return figures, [Routed(r, q.replica, 0, False) for q, r in zip(requests, results)]


def _restart(fleet: Fleet, args, tag: str, chat: Chat, later: list[Routed]) -> tuple[dict, list[Routed]]:
    """Replica 0 stopped and started again, warmed up, then one more chat round."""
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
    return {"time_to_ready_s": ready_s, "warmup_s": warmup,
            "first_round": replica_figures(mine, {0: _delta(after, before, "host_hit_tokens")[0]}, 1),
            "warm_rounds_ttft_p50_ms": ttft_p50(warm),
            "others_ttft_p50_ms": ttft_p50(others), "others_warm_ttft_p50_ms": ttft_p50(others_warm)}, restart


def ttft_p50(routed: list[Routed]) -> float | None:
    return summarize([x.result for x in routed])["ttft_p50_ms"] if routed else None
