"""tools.lib.warm_pass: the GPU prefix cache emptied before a warm pass, and the pass's prompt
tokens split by source, on a fake clock and fake vLLM metrics."""

from types import SimpleNamespace

import pytest

from tools.lib.warm_pass import (
    SCRUB_VALUE,
    GpuCacheNotEmptyError,
    by_source_delta,
    empty_gpu_cache,
    fill_kv,
    invalid_reason,
    scrub_gpu_kv,
    tokens_by_source,
    top_logprobs,
)


class _Clock:
    """A clock that moves only when slept on."""

    def __init__(self):
        self.now = 100.0
        self.sleeps = []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


def test_empty_gpu_cache_tries_again_until_vllm_resets():
    # 1. vLLM refuses twice (blocks still held by saves in flight), then resets.
    clock, answers = _Clock(), iter([False, False, True])
    waited = empty_gpu_cache(lambda: next(answers), timeout_s=60, poll_s=0.5, clock=clock, sleep=clock.sleep)
    # 2. Three tries, two waits between them; the time it took is returned.
    assert clock.sleeps == [0.5, 0.5] and waited == 1.0


def test_empty_gpu_cache_a_reset_that_never_succeeds_is_a_clear_error():
    # 1. vLLM refuses every time: after the deadline (not before), one error that says why.
    clock, tries = _Clock(), []

    def reset():
        tries.append(clock.now)
        return False
    with pytest.raises(GpuCacheNotEmptyError, match="refused to reset its GPU prefix cache 11 times in 10 s"):
        empty_gpu_cache(reset, timeout_s=10, poll_s=1, clock=clock, sleep=clock.sleep)
    # 2. It kept trying right up to the deadline.
    assert len(tries) == 11 and tries[-1] - tries[0] == 10


def test_empty_gpu_cache_a_first_success_does_not_wait():
    clock = _Clock()
    assert empty_gpu_cache(lambda: True, clock=clock, sleep=clock.sleep) == 0.0 and clock.sleeps == []


def _metric(name, source, value, engine="0"):
    return SimpleNamespace(name=name, labels={"engine": engine, "source": source}, value=value)


def test_tokens_by_source_sums_engines_and_ignores_other_counters():
    metrics = [_metric("vllm:prompt_tokens_by_source", "local_cache_hit", 16, "0"),
               _metric("vllm:prompt_tokens_by_source", "local_cache_hit", 32, "1"),
               _metric("vllm:prompt_tokens_by_source", "external_kv_transfer", 9984),
               _metric("vllm:prompt_tokens_by_source", "local_compute", 16),
               _metric("vllm:prefix_cache_hits", "local_cache_hit", 5000)]
    assert tokens_by_source(metrics) == {"local_compute": 16, "local_cache_hit": 48, "external_kv_transfer": 9984}
    # A vLLM without the counter: None, not zeros (which would read as "no GPU hit").
    assert tokens_by_source([_metric("vllm:prefix_cache_hits", "x", 1)]) is None


def test_invalid_reason_any_gpu_hit_or_no_split_makes_the_pass_invalid():
    before = {"local_compute": 100, "local_cache_hit": 9984, "external_kv_transfer": 0}
    hit = {"local_compute": 228, "local_cache_hit": 89856, "external_kv_transfer": 120}
    # 1. The pass's own hits count, not those before it.
    assert by_source_delta(hit, before) == {"local_compute": 128, "local_cache_hit": 79872,
                                            "external_kv_transfer": 120}
    assert "79872 prompt tokens of the warm pass were vLLM GPU prefix-cache hits" in invalid_reason(
        by_source_delta(hit, before))
    # 2. One GPU-hit token is enough.
    assert invalid_reason({"local_compute": 16, "local_cache_hit": 1, "external_kv_transfer": 9984})
    # 3. No split from vLLM: a GPU hit cannot be ruled out.
    assert "cannot be ruled out" in invalid_reason(by_source_delta(None, before))
    # 4. All from the host cache: valid.
    assert invalid_reason({"local_compute": 16, "local_cache_hit": 0, "external_kv_transfer": 9984}) is None


def _worker(caches):
    return SimpleNamespace(model_runner=SimpleNamespace(kv_caches=caches))


def test_fill_kv_overwrites_every_kv_tensor_and_counts_its_bytes():
    import torch
    caches = {"layer.0": torch.zeros(2, 3, dtype=torch.bfloat16), "layer.1": [torch.zeros(5), torch.zeros(1)]}
    assert fill_kv(_worker(caches)) == 2 * 3 * 2 + 5 * 4 + 1 * 4
    assert all((t == SCRUB_VALUE).all() for t in (caches["layer.0"], *caches["layer.1"]))
    with pytest.raises(RuntimeError, match="no kv_caches"):
        fill_kv(_worker([]))


class _KVLLM:
    """A GPU KV cache of 4 blocks of 2 values and a connector that loads them: the answer is
    the blocks the request reads, as they are when it runs."""

    def __init__(self):
        import torch
        self.kv = torch.zeros(4, 2)
        self.worker = _worker([self.kv])

    def collective_rpc(self, method, args=()):
        return [method(self.worker, *args)]

    def run(self, saved, load_blocks):
        for block in load_blocks:  # the connector's load, into the blocks vLLM gave again
            self.kv[block] = saved[block]
        return self.kv.clone()


def test_scrub_makes_a_load_that_left_a_block_out_change_the_answer():
    # The cold pass left the prompt's KV in blocks 0-3; emptying the prefix cache keeps those
    # bytes, and vLLM hands the same blocks to the warm request.
    import torch
    llm = _KVLLM()
    saved = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    llm.kv.copy_(saved)
    right = saved.clone()
    # 1. Unscrubbed: a connector that loads only blocks 0-2 still gives the right answer.
    assert torch.equal(llm.run(saved, [0, 1, 2]), right)
    # 2. Scrubbed first: the block it left out reads as the scrub value, the answer changes...
    assert scrub_gpu_kv(llm) == 32
    assert not torch.equal(llm.run(saved, [0, 1, 2]), right)
    # 3. ... and a load of every block is right again.
    scrub_gpu_kv(llm)
    assert torch.equal(llm.run(saved, [0, 1, 2, 3]), right)


def test_top_logprobs_are_the_first_tokens_candidates_by_rank():
    lp = SimpleNamespace
    first = {7: lp(logprob=-0.1, rank=1), 3: lp(logprob=-2.5, rank=3), 9: lp(logprob=-1.0, rank=2)}
    assert top_logprobs([first, {1: lp(logprob=0.0, rank=1)}]) == [[7, -0.1], [9, -1.0], [3, -2.5]]
    assert top_logprobs(None) == [] and top_logprobs([]) == []
