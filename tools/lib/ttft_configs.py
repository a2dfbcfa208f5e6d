"""bench_ttft's row per configuration, beside speed: the share of cacheable prompt tokens
its host cache served on the warm pass, and whether its outputs equal no connector's.

A prompt's cacheable tokens are its full blocks short of its last token (vLLM computes at
least that one).  The warm pass runs on an emptied GPU prefix cache (``tools/lib/warm_pass.py``),
so the prompt tokens vLLM did not compute in it (``RequestOutput.num_cached_tokens``, summed)
are the ones served from outside the GPU, whatever the connector.  A warm pass that vLLM
counted any GPU prefix-cache hit in (or whose hits it could not split by source) is
``invalid``: that row has its reason and no figures.  For pegaflow the engine's own count of
the blocks it loaded in the pass gives ``engine_served_share`` beside it, a cross-check.
``none`` has no host cache: its warm TTFT is its cold one (a recompute) and it serves nothing.
A configuration that ran is ``outputs_identical`` only when its cold and its warm tokens both
equal ``none``'s.  ``logprobs_identical`` is stricter: each warm request's first-token top-5
logprobs equal those of ``none``'s GPU prefix-cache hit of the same prompt, the same step
(vLLM computed the same number of tokens over the same cached KV bytes, so the figures agree
bit for bit).  A request whose cached-token count differs from the hit's is not compared;
``logprobs_compared`` says how many were, None where nothing could be (also where vLLM ran the
two phases under different CUDA graph modes: a connector can make it piecewise only, and
attention then splits its work otherwise).  The warm pass ran on a
scrubbed GPU cache (``tools/lib/warm_pass.py``): a page a connector left out changes the logprobs.
Every row that ran (``none``'s and ``invalid`` ones too) keeps ``requests``: per request, each
pass's tokens hash, served tokens and first-token top-5 (``tools/lib/evidence.py``, whose
``recheck_ttft`` works both marks out again from them), and ``cudagraph_mode``.
"""

from __future__ import annotations

import statistics

from tools.lib.evidence import ttft_requests
from tools.lib.warm_pass import invalid_reason

NO_FIGURES = ("skipped", "failed", "invalid")


def cacheable_tokens(prompts: list[list[int]], block_size: int) -> int:
    return sum((len(prompt) - 1) // block_size * block_size for prompt in prompts)


def served_share(hit_tokens: float, cacheable: int) -> float:
    """Served over cacheable; 0.0 when nothing was cacheable (prompts shorter than a block)."""
    return hit_tokens / cacheable if cacheable else 0.0


def stats(values: list[float]) -> tuple[float, float]:
    """Median and p90 (the nearest rank)."""
    ordered = sorted(values)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]


def logprobs_match(phase: dict, none: dict) -> tuple[bool | None, int]:
    """Whether the warm pass's top-5 logprobs equal ``none``'s GPU hit's, over the requests
    whose cached-token counts agree, and how many those were (None, 0: nothing to compare)."""
    warm, hit = phase.get("warm_top5"), none.get("gpu_hit_top5")
    warm_cached, hit_cached = phase.get("warm_cached_tokens"), none.get("gpu_hit_cached_tokens")
    if not warm or not hit or warm_cached is None or hit_cached is None:
        return None, 0
    if phase.get("cudagraph_mode") != none.get("cudagraph_mode"):  # attention splits its work otherwise
        return None, 0
    pairs = [(w, h) for w, h, wc, hc in zip(warm, hit, warm_cached, hit_cached) if wc == hc and w and h]
    if not pairs:
        return None, 0
    return all(w == h for w, h in pairs), len(pairs)


def row(phase: dict, reference: list[list[int]], none: dict) -> dict:
    """One configuration's figures from its phase's measurements; ``skipped``, ``failed`` (kept
    from the phase) or ``invalid`` (its warm pass hit vLLM's GPU prefix cache) instead."""
    if any(key in phase for key in NO_FIGURES):
        return {key: phase[key] for key in NO_FIGURES if key in phase}
    cached = phase["warm_cached_tokens"]
    reason = invalid_reason(phase.get("warm_by_source"))
    if reason is None and None in cached:
        reason = "vLLM gave no num_cached_tokens for a warm request: what it served is unknown"
    if reason is not None:
        return {"invalid": reason, **evidence(phase)}
    median, p90 = stats(phase["warm_ms"])
    out = {"ttft_warm_ms": median, "ttft_warm_ms_p90": p90,
           "served_share": served_share(sum(cached), phase["cacheable_tokens"]),
           "outputs_identical": phase["cold_tokens"] == reference and phase["warm_tokens"] == reference,
           "reset_wait_s": phase["reset_wait_s"]}
    if "scrubbed_kv_bytes" in phase:
        out["scrubbed_kv_bytes"] = phase["scrubbed_kv_bytes"]
    out["logprobs_identical"], out["logprobs_compared"] = logprobs_match(phase, none)
    return out | evidence(phase)


def evidence(phase: dict) -> dict:
    """What a row keeps per request (``tools/lib/evidence.py``), and the CUDA graph mode vLLM ran
    the phase under, so that its marks can be checked again from the JSON alone."""
    return {"cudagraph_mode": phase.get("cudagraph_mode"), "requests": ttft_requests(phase)}


def config_rows(peg: dict, native: dict | None, none: dict, peer_runs: dict[str, dict]) -> dict[str, dict]:
    """``none``, ``pegaflow``, ``native`` (unless None) and each peer, in that order; a
    configuration that could not run keeps its ``skipped`` reason (or ``failed``: its error), one
    whose warm pass hit the GPU is ``invalid``: no figures."""
    reference = none["cold_tokens"]
    cold, cold_p90 = stats(none["cold_ms"])
    rows = {"none": {"ttft_warm_ms": cold, "ttft_warm_ms_p90": cold_p90, "served_share": 0.0,
                     "outputs_identical": none["gpu_hit_tokens"] == reference, **evidence(none)}}
    rows["pegaflow"] = row(peg, reference, none)
    if "warm_engine_loaded_tokens" in peg and "served_share" in rows["pegaflow"]:
        rows["pegaflow"]["engine_served_share"] = served_share(peg["warm_engine_loaded_tokens"],
                                                               peg["cacheable_tokens"])
    if native is not None:
        rows["native"] = row(native, reference, none)
    for config, run in peer_runs.items():
        rows[config] = row(run, reference, none)
    return rows
