"""A warm pass that measures a host cache, not vLLM's GPU prefix cache.

Before a warm pass vLLM's GPU prefix cache must be empty.  vLLM refuses to reset it while any
block is still held: ``reset_prefix_cache()`` then returns False (the offline ``LLM``) or
``{"success": false}`` (``vllm serve``'s ``POST /reset_prefix_cache``).  A connector whose saves
run after a request has finished holds its blocks until they are saved, so the first try right
after a pass can fail; ``empty_gpu_cache`` tries again until it succeeds, within a deadline.

After the pass, two of vLLM's per-request counts say where its prompt tokens came from:

- ``RequestOutput.num_cached_tokens``: the prompt tokens vLLM did not compute, from its GPU
  prefix cache or from a connector, for any connector;
- ``vllm:prompt_tokens_by_source{source=...}``: the same split by source (``local_cache_hit``:
  the GPU prefix cache; ``external_kv_transfer``: a connector; ``local_compute``).  vLLM adds to
  it from each request's first output, so, unlike ``vllm:external_prefix_cache_hits`` (which the
  offline ``LLM`` drops for every engine step that returned no token, e.g. the step that starts
  an asynchronous load), it misses no request.

A warm pass with any GPU prefix-cache hit measured vLLM's own cache: its configuration is
``invalid``.  With none, the cached tokens are those the host cache served.

Emptying the prefix cache forgets the blocks' hashes, not their bytes: the warm request may be
given the very blocks that still hold its prompt's KV from the cold pass, and a connector that
skipped part of a load would then still answer right.  ``scrub_gpu_kv`` overwrites vLLM's whole
GPU KV cache before the warm pass, so every byte the warm request reads was loaded by its
connector (or computed), and a load that left any page out changes the answer.  It runs a
function in vLLM's workers (``LLM.collective_rpc``), which vLLM's engine process accepts only
with ``SCRUB_ENV`` set (pickled calls): the bench's own processes only.  The answer compared is
the first token's top-5 logprobs as well as its id (``top_logprobs``).

This module imports nothing of this repo's ``pegaflow``: a pegaflow-rs phase runs with PegaFlow's
package of that name first on its path (``tools/lib/peers.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

SCRUB_VALUE = 0.5  # finite: padded rows that read a block of it stay harmless
SCRUB_ENV = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # lets LLM.collective_rpc send a function
RESET_TIMEOUT_S = 300.0  # a whole pass's saves finishing after it (8 x 1.3 GB take seconds)
RESET_POLL_S = 0.2
BY_SOURCE = "vllm:prompt_tokens_by_source"
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


class GpuCacheNotEmptyError(RuntimeError):
    """vLLM kept refusing to empty its GPU prefix cache until the deadline.  (Not under
    ``PegaflowError``: the phase that raises it may not import this repo's ``pegaflow``; the
    bench turns it into a configuration's ``failed`` row.)"""


def empty_gpu_cache(reset: Callable[[], bool], timeout_s: float = RESET_TIMEOUT_S,
                    poll_s: float = RESET_POLL_S, clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep) -> float:
    """Call ``reset`` until it returns True; the seconds that took.  Raises
    ``GpuCacheNotEmptyError`` once ``timeout_s`` have passed with every try refused."""
    started = clock()
    tries = 0
    while True:
        tries += 1
        if reset():
            return clock() - started
        waited = clock() - started
        if waited >= timeout_s:
            raise GpuCacheNotEmptyError(
                f"vLLM refused to reset its GPU prefix cache {tries} times in {waited:.0f} s (blocks "
                "still held, e.g. by a connector's saves that never finished): a warm pass now "
                "would hit the GPU, not the host cache")
        sleep(poll_s)


def tokens_by_source(metrics: Iterable) -> dict[str, int] | None:
    """vLLM's ``vllm:prompt_tokens_by_source`` per source, summed over engines (``metrics``:
    ``LLM.get_metrics()``); None when this vLLM has no such counter."""
    counts = {source: 0 for source in SOURCES}
    found = False
    for metric in metrics:
        if metric.name == BY_SOURCE and metric.labels.get("source") in counts:
            counts[metric.labels["source"]] += int(metric.value)
            found = True
    return counts if found else None


def by_source_delta(after: dict[str, int] | None, before: dict[str, int] | None) -> dict[str, int] | None:
    if after is None or before is None:
        return None
    return {source: after[source] - before[source] for source in SOURCES}


def invalid_reason(by_source: dict[str, int] | None) -> str | None:
    """Why a warm pass with this split (``by_source_delta`` over it) measured no host cache,
    or None when it did not hit vLLM's GPU prefix cache."""
    if by_source is None:
        return (f"this vLLM reports no {BY_SOURCE}: GPU prefix-cache hits in the warm pass "
                "cannot be ruled out")
    if by_source["local_cache_hit"]:
        return (f"{by_source['local_cache_hit']} prompt tokens of the warm pass were vLLM GPU "
                "prefix-cache hits, not loads from the host cache")
    return None


def kv_tensors(caches) -> list:
    """The tensors of a model runner's ``kv_caches`` (a list, a dict by layer name, or nested)."""
    if isinstance(caches, dict):
        caches = list(caches.values())
    if isinstance(caches, (list, tuple)):
        return [t for item in caches for t in kv_tensors(item)]
    return [] if caches is None else [caches]


def fill_kv(worker, value: float = SCRUB_VALUE) -> int:
    """In a vLLM worker: every KV cache tensor of its model runner set to ``value``, the GPU
    waited for; the bytes written."""
    tensors = kv_tensors(getattr(worker.model_runner, "kv_caches", None))
    if not tensors:
        raise RuntimeError("this vLLM worker's model runner has no kv_caches to scrub")
    written = 0
    for tensor in tensors:
        tensor.fill_(value)
        written += tensor.numel() * tensor.element_size()
    if tensors[0].is_cuda:
        import torch
        torch.cuda.synchronize(tensors[0].device)
    return written


def scrub_gpu_kv(llm, value: float = SCRUB_VALUE) -> int:
    """Overwrite vLLM's whole GPU KV cache (call it once ``empty_gpu_cache`` succeeded: no block
    is held then); the bytes written over all workers."""
    return sum(llm.collective_rpc(fill_kv, args=(value,)))


def top_logprobs(logprobs) -> list[list]:
    """A completion's first token's candidates, ``[[token id, logprob], ...]`` by rank, from
    vLLM's ``CompletionOutput.logprobs`` (a dict per generated token); [] without logprobs."""
    if not logprobs:
        return []
    first = logprobs[0]
    ranked = sorted(first.items(), key=lambda item: (item[1].rank if item[1].rank is not None else 0, item[0]))
    return [[int(token), float(lp.logprob)] for token, lp in ranked]
