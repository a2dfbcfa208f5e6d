"""The serving workloads on one ``vllm serve`` (``bench_serving``, ``bench_peers``) and the record
of one run of them, the one ``bench_serving`` writes per configuration and reads back with
``--merge``.

- ``measure(port, args, tag)``: the multi-round chat (``--users`` users, ``--rounds`` rounds, a
  round's requests together or at ``--arrival-rate``), then vLLM's GPU prefix cache emptied and
  the shared-prefix requests (``--prefix-requests``, 0: none); the server's counters around each;
- ``record(config, tag, args, measured, engine_stats, timeline)``: one run's figures and evidence
  (per request, its tokens' hash and the prompt tokens vLLM did not compute).
"""

from __future__ import annotations

from dataclasses import dataclass

from tools.lib import processes
from tools.lib.evidence import serving_requests
from tools.lib.vllm_serve import counters, hits_of, reset_gpu_cache, run_all
from tools.serving_workload import (
    RequestResult,
    conversations,
    later_rounds_cacheable,
    poisson_offsets,
    shared_prefix_prompts,
    summarize,
)


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


@dataclass(frozen=True, slots=True)
class Measured:
    """What one server answered, and its counters' growth over each workload."""

    rounds: list[list[RequestResult]]
    prefix: list[RequestResult]
    counters: dict[str, dict[str, float]]  # workload -> counter -> growth
    reset_wait_s: float


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def measure(port: int, args, tag: str, bench: str | None = None) -> Measured:
    counts0 = counters(port)
    with processes.phase(bench, f"{tag} multi_round"):
        rounds = multi_round(port, args)
    counts1 = counters(port)
    reset_wait_s = reset_gpu_cache(port)
    with processes.phase(bench, f"{tag} shared_prefix"):
        prefix = shared_prefix(port, args) if args.prefix_requests else []
    counts2 = counters(port)
    return Measured(rounds, prefix, {"multi_round": _delta(counts1, counts0),
                                     "shared_prefix": _delta(counts2, counts1)}, reset_wait_s)


def record(config: str, tag: str, args, measured: Measured, engine_stats: dict | None,
           timeline: dict | None) -> dict:
    rounds, prefix, phases = measured.rounds, measured.prefix, measured.counters
    later = [r for rnd in rounds[1:] for r in rnd]
    per_round = [summarize(rnd) for rnd in rounds]
    return {"config": config, "tag": tag, "rounds": per_round,
            "later_rounds": summarize(later),
            "later_rounds_wall_s": round(sum(r["wall_s"] for r in per_round[1:]), 4),
            "shared_prefix": summarize(prefix) if prefix else None,
            "host_hit_tokens": {phase: hits_of(d)["host_hit_tokens"] for phase, d in phases.items()},
            "cacheable_tokens": {"multi_round": later_rounds_cacheable(
                args.users, args.context_tokens, args.question_tokens, args.seed,
                [[r.tokens for r in rnd] for rnd in rounds])},
            "reset_wait_s": measured.reset_wait_s,
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
