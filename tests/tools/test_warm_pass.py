"""tools.warm_pass: the GPU prefix cache emptied before a warm pass, and the pass's prompt
tokens split by source, on a fake clock and fake vLLM metrics."""

from types import SimpleNamespace

import pytest

from tools.warm_pass import (
    GpuCacheNotEmptyError,
    by_source_delta,
    empty_gpu_cache,
    invalid_reason,
    tokens_by_source,
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
