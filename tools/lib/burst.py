"""The burst workload of ``bench_replicas`` (compute once, docs/replicas.md): ``N`` distinct long
documents, each sent at the same moment to every replica with a question of its own.

- ``burst_requests(...)``: request (d, r) is document d and a question, sent straight to replica
  r (no router: every replica gets every document);
- ``send_burst(port_of, requests, max_tokens)``: one thread per request, all released from one
  barrier, so that every replica sees every document before any of them has saved it;
- ``burst_figures(requests, results)``: the burst's wall time (first request sent to last answer
  in), TTFT p50/p99, ``prefill_tokens_computed`` (the sum over requests of prompt tokens less
  vLLM's ``cached_tokens``: what the replicas computed, in all and per replica) against
  ``unique_prompt_tokens`` (each document once and every question: what computing each new
  token once would cost), and each answer's hash;
- ``identical_share(run, reference)``: the share of a run's burst answers equal to a reference
  run's (``none``), matched by request;
- ``headline_figures(runs)``, ``mark_identical(table, runs)``, ``COLUMNS``: the burst's part of
  the bench's rows (``burst_wall_s``, ``prefill_tokens_computed``, ``unique_prompt_tokens``...)
  and of its table;
- ``claim_counters(engine_name)``: pegaflow's engine's compute-once counters now.
"""

from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass

from tools.lib.evidence import tokens_sha256
from tools.lib.vllm_serve import complete
from tools.serving_workload import RequestResult, shared_prefix_prompts, summarize

CLAIM_STATS = ("claims", "claim_blocks", "claim_waits", "claim_wait_blocks", "claim_tokens_saved",
               "claim_wait_ns", "claim_declines", "claim_timeouts", "claims_dropped")
BARRIER_TIMEOUT_S = 60.0  # every sender thread reaches the barrier long before this


@dataclass(frozen=True, slots=True)
class BurstRequest:
    key: str  # "b{doc}r{replica}"
    doc: int
    replica: int
    prompt: list[int]


def burst_requests(num_docs: int, doc_tokens: int, num_replicas: int, question_tokens: int,
                   seed: int) -> list[BurstRequest]:
    """Every document to every replica, each request with its own question (document-major)."""
    prompts = shared_prefix_prompts(num_docs, doc_tokens, num_docs * num_replicas, question_tokens, seed=seed)
    return [BurstRequest(f"b{i % num_docs}r{i // num_docs}", i % num_docs, i // num_docs, prompt)
            for i, prompt in enumerate(prompts)]


def unique_prompt_tokens(num_docs: int, doc_tokens: int, num_replicas: int, question_tokens: int) -> int:
    """Each document once, and every request's question."""
    return num_docs * doc_tokens + num_docs * num_replicas * question_tokens


def send_burst(port_of, requests: list[BurstRequest], max_tokens: int) -> list[RequestResult]:
    """Sends every request at once (one thread each, released together from a barrier) to its
    replica's port (``port_of(replica)``); the results in the order of ``requests``."""
    if not requests:
        return []
    barrier = threading.Barrier(len(requests), timeout=BARRIER_TIMEOUT_S)

    def one(request: BurstRequest) -> RequestResult:
        port = port_of(request.replica)
        barrier.wait()
        return complete(port, request.prompt, max_tokens, request.key)

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(requests)) as pool:
        return list(pool.map(one, requests))


def burst_figures(requests: list[BurstRequest], results: list[RequestResult], num_replicas: int,
                  unique_tokens: int) -> dict:
    """The burst's figures (the module's docstring); ``prefill_tokens_computed`` is None when a
    request failed or its answer did not say how many of its prompt tokens were cached."""
    summary = summarize(results)
    computed = [None if r.error or r.cached_tokens is None else r.prompt_tokens - r.cached_tokens for r in results]
    known = None not in computed
    per_replica = [sum(c for c, q in zip(computed, requests) if q.replica == replica) if known else None
                   for replica in range(num_replicas)]
    total = sum(computed) if known else None
    return {"requests": len(results), "errors": summary["errors"], "wall_s": summary["wall_s"],
            "ttft_p50_ms": summary["ttft_p50_ms"], "ttft_p99_ms": summary["ttft_p99_ms"],
            "prefill_tokens_computed": total, "unique_prompt_tokens": unique_tokens,
            "computed_per_unique": round(total / unique_tokens, 4) if known and unique_tokens else None,
            "per_replica_computed": per_replica,
            "answers": [{"key": r.key, "replica": q.replica, "tokens_sha256": tokens_sha256(r.tokens),
                         "cached_tokens": r.cached_tokens, "error": r.error} for q, r in zip(requests, results)]}


def identical_share(burst: dict, reference: dict) -> float | None:
    """The share of ``burst``'s answers (matched by key) whose hash equals ``reference``'s;
    None when none matched."""
    hashes = {a["key"]: a["tokens_sha256"] for a in reference["answers"] if not a["error"]}
    matched = [a for a in burst["answers"] if a["key"] in hashes]
    if not matched:
        return None
    return sum(not a["error"] and a["tokens_sha256"] == hashes[a["key"]] for a in matched) / len(matched)


def claim_counters(engine_name: str) -> dict[str, int]:
    """pegaflow's engine ``engine_name``'s compute-once counters now."""
    from pegaflow.stats.engine_stats import read_stats  # here: it imports this repo's pegaflow
    stats = read_stats(engine_name)
    return {k: int(stats[k]) for k in CLAIM_STATS}


# a headline row's figure: the burst's figure it is the median of
FIGURES = {"burst_wall_s": "wall_s", "burst_ttft_p50_ms": "ttft_p50_ms", "burst_ttft_p99_ms": "ttft_p99_ms",
           "prefill_tokens_computed": "prefill_tokens_computed", "unique_prompt_tokens": "unique_prompt_tokens",
           "computed_per_unique": "computed_per_unique"}
COLUMNS = (("burst s", "burst_wall_s", "{:.2f}"), ("TTFT p50", "burst_ttft_p50_ms", "{:.0f}"),
           ("TTFT p99", "burst_ttft_p99_ms", "{:.0f}"), ("computed", "prefill_tokens_computed", "{:.0f}"),
           ("unique", "unique_prompt_tokens", "{:.0f}"), ("computed/unique", "computed_per_unique", "{:.3f}"),
           ("identical", "burst_identical_share", "{:.3f}"))


def headline_figures(runs: list[dict]) -> dict[str, list]:
    """Of one configuration's runs, each burst figure's values (those the runs have)."""
    return {name: [r["burst"][key] for r in runs if r.get("burst", {}).get(key) is not None]
            for name, key in FIGURES.items()}


def mark_identical(table: dict[str, dict], runs: list[dict]) -> None:
    """Gives each configuration's row whose runs ran the burst ``burst_identical_share``: the
    least share, over its runs, of burst answers equal to the first ``none`` run's."""
    reference = next((r["burst"] for r in runs if r["config"] == "none" and "burst" in r), None)
    if reference is None:
        return
    for config, row in table.items():
        shares = [identical_share(r["burst"], reference) for r in runs if r["config"] == config and "burst" in r]
        if shares and None not in shares:
            row["burst_identical_share"] = min(shares)
