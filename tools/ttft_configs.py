"""bench_ttft's row per configuration, beside speed: the share of cacheable prompt tokens
its host cache served on the warm pass, and whether its outputs equal no connector's.

A prompt's cacheable tokens are its full blocks short of its last token (vLLM computes at
least that one); the served tokens are vLLM's own count of prompt tokens read from outside
the GPU (``vllm:external_prefix_cache_hits``) during the warm pass.  ``none`` has no host
cache: its warm TTFT is its cold one (a recompute) and it serves nothing.  A configuration
that ran is ``outputs_identical`` only when its cold and its warm tokens both equal ``none``'s.
"""

from __future__ import annotations

import statistics


def cacheable_tokens(prompts: list[list[int]], block_size: int) -> int:
    return sum((len(prompt) - 1) // block_size * block_size for prompt in prompts)


def served_share(hit_tokens: float, cacheable: int) -> float:
    """Served over cacheable; 0.0 when nothing was cacheable (prompts shorter than a block)."""
    return hit_tokens / cacheable if cacheable else 0.0


def stats(values: list[float]) -> tuple[float, float]:
    """Median and p90 (the nearest rank)."""
    ordered = sorted(values)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]


def row(phase: dict, reference: list[list[int]]) -> dict:
    """One configuration's figures from its phase's measurements."""
    median, p90 = stats(phase["warm_ms"])
    return {"ttft_warm_ms": median, "ttft_warm_ms_p90": p90,
            "served_share": served_share(phase["warm_hit_tokens"], phase["cacheable_tokens"]),
            "outputs_identical": phase["cold_tokens"] == reference and phase["warm_tokens"] == reference}


def config_rows(peg: dict, native: dict | None, none: dict, peer_runs: dict[str, dict]) -> dict[str, dict]:
    """``none``, ``pegaflow``, ``native`` (unless None) and each peer, in that order; a peer
    that could not run keeps its ``skipped`` reason (or ``failed``: its error) instead of figures."""
    reference = none["cold_tokens"]
    cold, cold_p90 = stats(none["cold_ms"])
    rows = {"none": {"ttft_warm_ms": cold, "ttft_warm_ms_p90": cold_p90, "served_share": 0.0,
                     "outputs_identical": none["gpu_hit_tokens"] == reference}}
    rows["pegaflow"] = row(peg, reference)
    if native is not None:
        rows["native"] = row(native, reference)
    for config, run in peer_runs.items():
        rows[config] = dict(run) if "skipped" in run or "failed" in run else row(run, reference)
    return rows
