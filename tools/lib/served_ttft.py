"""bench_ttft's warm-TTFT measurement taken through a ``vllm serve`` (``bench_peers``): one server
of a configuration's fleet, its prompts one at a time, each a ``POST /v1/completions`` of one
token with the top-5 logprobs (token ids, no tokenizer: ``return_tokens_as_token_ids``); the
TTFT is the request's wall time, as bench_ttft's is one ``LLM.generate``'s.

- ``none``: each prompt sent twice in a row, cold (a recompute) then a GPU prefix-cache hit of the
  same step (twice in a row: a fleet replica's GPU cache does not hold all the prompts at once);
- every other configuration: the cold pass over all prompts, then vLLM's GPU prefix cache emptied
  (``POST /reset_prefix_cache``, retried while saves hold blocks) and its whole KV cache
  overwritten (``tools/lib/scrub_extension.py``), then the warm pass: what vLLM did not compute
  of it came from the configuration's host cache, and a page it left out changes the logprobs.

``measure`` returns the phase record bench_ttft's phases make (``cold_ms``, ``warm_tokens``,
``warm_top5``, ``warm_cached_tokens``, ``warm_by_source``...), so that ``tools/lib/ttft_configs.py``
turns a set of them into rows exactly as it does bench_ttft's.
"""

from __future__ import annotations

import http.client
import json
import time

from tools.lib.ttft_configs import cacheable_tokens
from tools.lib.vllm_serve import REQUEST_TIMEOUT_S, SERVED_NAME, by_source_of_counters, counters, reset_gpu_cache
from tools.lib.warm_pass import SCRUB_VALUE, by_source_delta

TOP_LOGPROBS = 5
BLOCK_SIZE = 16


def _post(port: int, path: str, body: dict) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        data = response.read()
    finally:
        conn.close()
    if response.status != 200:
        raise RuntimeError(f"POST {path} on :{port}: HTTP {response.status}: {data[:300]!r}")
    return json.loads(data)


def worker_call(port: int, method: str, *args: str) -> list:
    """Each worker's answer to ``method`` of ``tools/lib/scrub_extension.py``."""
    return _post(port, "/collective_rpc", {"method": method, "args": list(args)})["results"]


def top5(logprobs: dict | None) -> list[list]:
    """The first token's candidates, ``[[token id, logprob], ...]`` best first (ties by id), from
    an answer's ``logprobs``; [] without them."""
    first = (logprobs or {}).get("top_logprobs") or [{}]
    ranked = sorted(((int(token.removeprefix("token_id:")), float(lp)) for token, lp in first[0].items()),
                    key=lambda item: (-item[1], item[0]))
    return [[token, lp] for token, lp in ranked]


def ask(port: int, prompt: list[int]) -> tuple[float, list[int], list[list], int | None]:
    """One prompt, one token: the wall time (ms), the tokens, the first token's top 5 and the
    prompt tokens vLLM did not compute."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "ignore_eos": True,
            "logprobs": TOP_LOGPROBS, "return_tokens_as_token_ids": True, "return_token_ids": True}
    started = time.perf_counter()
    answer = _post(port, "/v1/completions", body)
    ms = (time.perf_counter() - started) * 1e3
    choice = answer["choices"][0]
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    return ms, list(choice.get("token_ids") or []), top5(choice.get("logprobs")), details.get("cached_tokens")


def _pass(result: dict, name: str, port: int, prompts: list[list[int]]) -> None:
    answers = [ask(port, prompt) for prompt in prompts]
    for i, key in enumerate(("ms", "tokens", "top5", "cached_tokens")):
        result.setdefault(f"{name}_{key}", []).extend(a[i] for a in answers)


def measure(port: int, config: str, prompts: list[list[int]]) -> dict:
    """``config``'s phase on the server at ``port`` (see the module's docstring)."""
    result = {"cudagraph_mode": worker_call(port, "bench_cudagraph_mode")[0],
              "cacheable_tokens": cacheable_tokens(prompts, BLOCK_SIZE)}
    if config == "none":
        for prompt in prompts:
            _pass(result, "cold", port, [prompt])
            _pass(result, "gpu_hit", port, [prompt])
        return result
    _pass(result, "cold", port, prompts)
    result["reset_wait_s"] = reset_gpu_cache(port)
    result["scrubbed_kv_bytes"] = sum(int(b) for b in worker_call(port, "bench_scrub_kv_cache", str(SCRUB_VALUE)))
    before = by_source_of_counters(counters(port))
    _pass(result, "warm", port, prompts)
    result["warm_by_source"] = by_source_delta(by_source_of_counters(counters(port)), before)
    return result
