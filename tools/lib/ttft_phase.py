"""bench_ttft's phase: one vLLM process (the offline ``LLM``, dummy weights, greedy) of one
configuration, timed: ``run_phase(args)`` returns its measurements (cold, warm, GPU-hit passes,
TPOT, disk reads), which ``tools/bench_ttft.py`` (its parent) turns into rows and figures.

This module imports nothing of this repo's ``pegaflow`` at import time: a pegaflow-rs phase runs
with PegaFlow's package of the same name first on its path (``tools/lib/peers.py``).
"""

from __future__ import annotations

import json
import time

from tools.lib import peers
from tools.lib.ttft_configs import cacheable_tokens
from tools.lib.warm_pass import by_source_delta, empty_gpu_cache, scrub_gpu_kv, tokens_by_source, top_logprobs


def random_prompts(seed: int, count: int, length: int, vocab: int) -> list[list[int]]:
    import random
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(count)]



def load_modes() -> tuple[str, ...]:
    from pegaflow.connector.config import LOAD_MODES
    return LOAD_MODES



def _llm(args, kind: str):
    from vllm import LLM
    common = dict(model=args.model, load_format="dummy", skip_tokenizer_init=True, enforce_eager=args.eager,
                  seed=0, max_model_len=args.prompt_tokens + args.decode_tokens + 64,
                  gpu_memory_utilization=args.gpu_memory_utilization, disable_log_stats=False)
    if args.no_async_scheduling:
        common["async_scheduling"] = False
    if kind in peers.PEERS:  # as the peer's plan says (tools/lib/peers.py)
        from vllm.config import KVTransferConfig
        return LLM(**common, kv_transfer_config=KVTransferConfig(**json.loads(args.kv_transfer_config)))
    from pegaflow.connector import kv_transfer_config
    if kind in ("pegaflow", "disk"):
        return LLM(**common, enable_prefix_caching=False, kv_transfer_config=kv_transfer_config(
            args.engine_name, disk_load_mode=args.disk_load_mode))
    if kind == "idle":  # the connector in vLLM's path, neither saving nor loading
        return LLM(**common, enable_prefix_caching=False, kv_transfer_config=kv_transfer_config(
            args.engine_name, enable_save=False, enable_load=False))
    if kind == "native":
        return LLM(**common, kv_offloading_size=args.native_offload_gib, kv_offloading_backend="native")
    return LLM(**common)

LAST_ENGINE_TTFT_MS: list[float] = []  # vLLM's own first-token latency of the last _time_each
LAST_STEP_MS: list[float] = []         # vLLM's scheduled -> first token of the last _time_each
LAST_QUEUE_MS: list[float] = []        # vLLM's queued -> scheduled of the last _time_each
LAST_CACHED_TOKENS: list[int] = []     # vLLM's num_cached_tokens of each request of the last _time_each
LAST_TOP5: list[list[list]] = []       # each request's first token: its top-5 [token id, logprob], by rank
TOP_LOGPROBS = 5


def _time_each(llm, prompts, max_tokens: int) -> tuple[list[float], list[list[int]]]:
    """Wall time of one generate() per prompt (ms), and the tokens.  vLLM's own timings of
    each request go to LAST_ENGINE_TTFT_MS (arrival to first token, excluding generate()'s
    input processing), LAST_QUEUE_MS and LAST_STEP_MS (engine-core timestamps), its prompt
    tokens vLLM did not compute to LAST_CACHED_TOKENS, the first token's top-5 logprobs to
    LAST_TOP5."""
    from vllm import SamplingParams, TokensPrompt
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False,
                            logprobs=TOP_LOGPROBS)
    times, tokens = [], []
    for timings in (LAST_ENGINE_TTFT_MS, LAST_STEP_MS, LAST_QUEUE_MS, LAST_CACHED_TOKENS, LAST_TOP5):
        timings.clear()
    for prompt in prompts:
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        times.append((time.perf_counter() - t0) * 1e3)
        tokens.append(list(out[0].outputs[0].token_ids))
        LAST_CACHED_TOKENS.append(out[0].num_cached_tokens)
        LAST_TOP5.append(top_logprobs(out[0].outputs[0].logprobs))
        metrics = out[0].metrics
        latency = getattr(metrics, "first_token_latency", None)
        if latency:
            LAST_ENGINE_TTFT_MS.append(latency * 1e3)
        queued, scheduled, first = (getattr(metrics, k, 0.0) for k in
                                    ("queued_ts", "scheduled_ts", "first_token_ts"))
        if queued and scheduled and first:
            LAST_QUEUE_MS.append((scheduled - queued) * 1e3)
            LAST_STEP_MS.append((first - scheduled) * 1e3)
    return times, tokens



def _time_batch(llm, prompts, max_tokens: int) -> float:
    from vllm import SamplingParams, TokensPrompt
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    t0 = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return (time.perf_counter() - t0) * 1e3



def _beside(llm, fresh: list[int], hit: list[int], args) -> dict:
    """A new request (computed, then ``decode_tokens`` decoded) sent together with a prompt
    whose prefix is to be read from disk: the new one's first-token latency and TPOT say
    whether the disk read held it up."""
    from vllm import SamplingParams, TokensPrompt
    decode = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    t0 = time.perf_counter()
    new, loaded = llm.generate([TokensPrompt(prompt_token_ids=fresh), TokensPrompt(prompt_token_ids=hit)],
                               [decode, one], use_tqdm=False)
    wall = (time.perf_counter() - t0) * 1e3
    return {"new_ttft_ms": new.metrics.first_token_latency * 1e3, "new_tpot_ms": _tpot_of(new),
            "hit_ttft_ms": loaded.metrics.first_token_latency * 1e3, "wall_ms": wall,
            "hit_tokens": list(loaded.outputs[0].token_ids)}



def _tpot_ms(llm, prompts, args) -> list[float]:
    """Per-output-token time of each request (ms): vLLM's own first -> last token
    timestamps over ``decode_tokens`` tokens, so the prefill is not in it."""
    from vllm import SamplingParams, TokensPrompt
    params = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True,
                            detokenize=False)
    return [_tpot_of(llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)[0])
            for p in prompts]



def _tpot_of(out) -> float:
    """One request's time per output token (ms), from vLLM's first and last token times."""
    metrics, generated = out.metrics, len(out.outputs[0].token_ids)
    if generated < 2 or not metrics.last_token_ts:
        raise RuntimeError(f"no decode timing from vLLM ({generated} tokens, metrics {metrics})")
    return (metrics.last_token_ts - metrics.first_token_ts) * 1e3 / (generated - 1)



def _external_hits(llm) -> float:
    for metric in llm.get_metrics():
        if metric.name == "vllm:external_prefix_cache_hits":
            return float(getattr(metric, "value", 0))
    return 0.0



def _timed(result: dict, name: str, timings: tuple[list[float], list[list[int]]]) -> None:
    """``name``_ms, ``name``_tokens and vLLM's own timings of one _time_each."""
    result[f"{name}_ms"], result[f"{name}_tokens"] = timings
    result[f"{name}_engine_ms"] = list(LAST_ENGINE_TTFT_MS)
    result[f"{name}_queue_ms"] = list(LAST_QUEUE_MS)
    result[f"{name}_step_ms"] = list(LAST_STEP_MS)
    result[f"{name}_top5"] = list(LAST_TOP5)
    result[f"{name}_cached_tokens"] = list(LAST_CACHED_TOKENS)



def _timed_warm(result: dict, llm, prompts: list[list[int]]) -> None:
    """The warm pass, on a GPU prefix cache emptied first (tools/lib/warm_pass.py): per request the
    prompt tokens vLLM did not compute, and vLLM's split of the pass's prompt tokens by source."""
    result["reset_wait_s"] = empty_gpu_cache(llm.reset_prefix_cache)
    result["scrubbed_kv_bytes"] = scrub_gpu_kv(llm)
    before = tokens_by_source(llm.get_metrics())
    _timed(result, "warm", _time_each(llm, prompts, 1))
    result["warm_by_source"] = by_source_delta(tokens_by_source(llm.get_metrics()), before)



def run_phase(args) -> dict:
    """One vLLM process: what ``--phase`` names; returns its measurements."""
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    prompts = random_prompts(1, args.num_prompts, args.prompt_tokens, vocab)
    decode_prompts = random_prompts(2, args.decode_prompts, args.prompt_tokens // 10, vocab)
    llm = _llm(args, args.phase)
    _time_each(llm, random_prompts(3, 1, 512, vocab), 1)  # warm-up: kernels, allocator
    # (a connector may make vLLM run piecewise CUDA graphs only: attention then splits its work
    # otherwise, and logprobs are compared only between phases of the same mode)
    result = {"cudagraph_mode": str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode)}
    if args.tpot_only:
        result["tpot_ms"] = _tpot_ms(llm, decode_prompts, args)
        return result
    if args.phase == "disk":  # a new engine whose pool is empty and whose disk holds the prompts
        *alone, last = prompts
        _timed(result, "disk", _time_each(llm, alone, 1))
        # Its own seed per mode: the engine of an earlier mode wrote its new request to disk.
        seed = 5 + load_modes().index(args.disk_load_mode)
        result["beside"] = _beside(llm, random_prompts(seed, 1, args.prompt_tokens // 10, vocab)[0], last, args)
        result["disk_tokens"].append(result["beside"].pop("hit_tokens"))
        _timed(result, "pool", _time_each(llm, prompts, 1))  # read back into its pool by then
        return result
    _timed(result, "cold", _time_each(llm, prompts, 1))
    result["cacheable_tokens"] = cacheable_tokens(prompts, llm.llm_engine.vllm_config.cache_config.block_size)
    if args.phase == "pegaflow":  # the engine's own count of what it loaded, as a cross-check
        from pegaflow.stats.engine_stats import read_stats
        loaded = read_stats(args.engine_name)["blocks_loaded"]
        _timed_warm(result, llm, prompts)
        result["warm_engine_loaded_tokens"] = ((read_stats(args.engine_name)["blocks_loaded"] - loaded)
                                               * llm.llm_engine.vllm_config.cache_config.block_size)
        result["warm_batch_ms"] = _time_batch(llm, prompts, 1)
        result["external_hit_tokens"] = _external_hits(llm)
        result["tpot_ms"] = _tpot_ms(llm, decode_prompts, args)
    elif args.phase == "native" or args.phase in peers.PEERS:
        _timed_warm(result, llm, prompts)  # the GPU's copy gone, the host cache's kept
        if args.phase == "native":
            _timed(result, "gpu_hit", _time_each(llm, prompts, 1))  # with the offloading connector
    else:
        _timed(result, "gpu_hit", _time_each(llm, prompts, 1))  # vLLM's prefix cache alone
        result["tpot_ms"] = _tpot_ms(llm, decode_prompts, args)
        result["cold_batch_ms"] = _time_batch(llm, random_prompts(4, args.num_prompts, args.prompt_tokens, vocab), 1)
    return result

