"""What a bench's raw JSON keeps per request, so that a mark on a configuration ("outputs
differ", "logprobs differ") can be checked again from the file alone, without the run.

- ``tokens_sha256(tokens)``: a request's output token ids, hashed (16 hex digits of the SHA-256
  of their JSON list): equal hashes, equal tokens.
- ``ttft_requests(phase)``: bench_ttft, per request of a phase, for each pass it ran (``cold``,
  ``warm``, ``gpu_hit``): the tokens' hash, the prompt tokens vLLM did not compute (``served``:
  on a warm pass after the GPU cache was emptied, what the host cache served) and the first
  token's top-5 ``[token id, logprob]``.
- ``recheck_ttft(rows)``: each configuration's ``outputs_identical`` and ``logprobs_identical``
  worked out again from those requests alone, by bench_ttft's rules (``tools/lib/ttft_configs.py``).
- ``serving_requests(results)``: bench_serving and bench_replicas, per request: its key, its
  tokens' hash and vLLM's ``cached_tokens`` (its prompt tokens not computed, from the GPU cache
  or a connector).
"""

from __future__ import annotations

import hashlib
import json

PASSES = ("cold", "warm", "gpu_hit")


def tokens_sha256(tokens: list[int]) -> str:
    return hashlib.sha256(json.dumps([int(t) for t in tokens]).encode()).hexdigest()[:16]


def ttft_requests(phase: dict) -> list[dict]:
    """One record per request of ``phase`` (bench_ttft's measurements of one configuration)."""
    num_requests = max((len(phase.get(f"{p}_tokens") or []) for p in PASSES), default=0)
    records = []
    for i in range(num_requests):
        record = {}
        for name in PASSES:
            if i < len(phase.get(f"{name}_tokens") or []):
                record[f"{name}_tokens_sha256"] = tokens_sha256(phase[f"{name}_tokens"][i])
            if i < len(phase.get(f"{name}_cached_tokens") or []):
                record[f"{name}_served_tokens"] = phase[f"{name}_cached_tokens"][i]
            if i < len(phase.get(f"{name}_top5") or []):
                record[f"{name}_top5"] = phase[f"{name}_top5"][i]
        records.append(record)
    return records


def recheck_ttft(rows: dict[str, dict]) -> dict[str, dict]:
    """Per configuration with requests: ``outputs_identical`` (its cold and warm tokens equal
    ``none``'s cold ones) and ``logprobs_identical`` / ``logprobs_compared`` (its warm top-5
    against ``none``'s GPU hit's, over the requests whose served counts agree, where vLLM ran both
    under one CUDA graph mode; None, 0: nothing to compare)."""
    none = rows["none"]
    reference = [r["cold_tokens_sha256"] for r in none["requests"]]
    out = {}
    for config, row in rows.items():
        if "requests" not in row:
            continue
        mine = row["requests"]
        passes = ("gpu_hit",) if config == "none" else ("cold", "warm")
        identical = all(r.get(f"{p}_tokens_sha256") == ref for r, ref in zip(mine, reference) for p in passes)
        out[config] = {"outputs_identical": identical and len(mine) == len(reference),
                       **dict(zip(("logprobs_identical", "logprobs_compared"), _logprobs(row, none)))}
    return out


def _logprobs(row: dict, none: dict) -> tuple[bool | None, int]:
    if row is none or row.get("cudagraph_mode") != none.get("cudagraph_mode"):
        return None, 0
    pairs = [(w["warm_top5"], h["gpu_hit_top5"]) for w, h in zip(row["requests"], none["requests"])
             if w.get("warm_top5") and h.get("gpu_hit_top5") and "warm_served_tokens" in w
             and w["warm_served_tokens"] == h.get("gpu_hit_served_tokens")]
    if not pairs:
        return None, 0
    return all(w == h for w, h in pairs), len(pairs)


def serving_requests(results) -> list[dict]:
    """``results``: ``RequestResult``s (tools/serving_workload.py), in the order sent."""
    return [{"key": r.key, "tokens_sha256": tokens_sha256(r.tokens), "cached_tokens": r.cached_tokens}
            for r in results]
