"""tools.serving_workload: the serving bench's workloads and summaries."""

from __future__ import annotations

import math

import pytest

from tools.serving_workload import (
    Conversation,
    RequestResult,
    conversations,
    identical_share,
    percentile,
    poisson_offsets,
    shared_prefix_prompts,
    summarize,
)


def test_conversation_each_round_extends_the_last_prompt_and_answer():
    # 1. Round 0: the context and a question.
    user = Conversation(user=3, context_tokens=100, question_tokens=8, seed=1)
    first = user.next_prompt()
    assert len(first) == 108 and first[:100] == user.history
    # 2. The answer joins the history; round 1's prompt starts with all of round 0.
    user.record(first, [7, 8, 9])
    second = user.next_prompt()
    assert second[:111] == first + [7, 8, 9] and len(second) == 119 and user.rounds_done == 1
    # 3. A prompt that does not extend the history is a bug in the driver.
    with pytest.raises(ValueError):
        user.record([1, 2, 3], [])


def test_conversations_differ_between_users_and_repeat_per_seed():
    a, b = conversations(2, 50, 4, seed=5)
    assert a.history != b.history
    assert [c.history for c in conversations(2, 50, 4, seed=5)] == [a.history, b.history]
    assert conversations(1, 50, 4, seed=6)[0].history != a.history


def test_shared_prefix_prompts_share_their_system_prompt():
    prompts = shared_prefix_prompts(num_prefixes=2, prefix_tokens=30, num_requests=5, suffix_tokens=4)
    assert len(prompts) == 5 and all(len(p) == 34 for p in prompts)
    assert prompts[0][:30] == prompts[2][:30] == prompts[4][:30] != prompts[1][:30] == prompts[3][:30]
    assert len({tuple(p) for p in prompts}) == 5  # suffixes differ


def test_poisson_offsets_all_at_once_or_at_the_rate():
    assert poisson_offsets(4, math.inf) == [0.0] * 4
    offsets = poisson_offsets(2000, 100.0, seed=1)
    assert offsets == sorted(offsets) and offsets[0] == 0.0
    assert 15 < offsets[-1] < 25  # 2000 arrivals at 100/s: about 20 s


def test_percentile_interpolates_between_ranks():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0 and math.isnan(percentile([], 50))
    assert percentile(list(range(101)), 90) == 90


def _result(key, started, first, done, tokens, error=""):
    return RequestResult(key, 10, tokens, started, first, done, error)


def test_summarize_ttft_tpot_wall_and_throughput():
    results = [_result("a", 0.0, 0.1, 0.5, [1, 2, 3, 4, 5]),   # TTFT 100 ms, TPOT 100 ms
               _result("b", 0.0, 0.3, 0.3, [1]),               # one token: no TPOT
               _result("c", 0.2, 0.4, 1.0, [1, 2, 3, 4]),      # TTFT 200 ms, TPOT 200 ms
               _result("d", 0.0, 0.0, 9.0, [], error="HTTP 500")]  # not counted
    s = summarize(results)
    assert s["requests"] == 4 and s["errors"] == 1 and s["wall_s"] == 1.0 and s["throughput_rps"] == 3.0
    assert s["ttft_p50_ms"] == 200.0 and s["tpot_p50_ms"] == 150.0


def test_identical_share_matches_answers_by_key():
    ref = [_result("a", 0, 0, 0, [1, 2]), _result("b", 0, 0, 0, [3])]
    assert identical_share([_result("b", 0, 0, 0, [3]), _result("a", 0, 0, 0, [1, 2])], ref) == 1.0
    assert identical_share([_result("a", 0, 0, 0, [1, 9]), _result("b", 0, 0, 0, [3])], ref) == 0.5


def test_later_rounds_cacheable_counts_the_full_blocks_the_server_computed_before():
    from tools.serving_workload import later_rounds_cacheable
    # One user, a 40-token context and 4-token questions: round 1's prompt is 44 tokens and its
    # 3-token answer leaves 44 + 2 computed (the last answer token is never fed back); round 2's
    # prompt is 51 tokens: min(46, 50) // 16 * 16 = 32 cacheable. Round 1 counts nothing.
    assert later_rounds_cacheable(1, 40, 4, 0, [[[7, 8, 9]], [[1, 2, 3]]]) == 32
    # A third round: 51 + 2 = 53 computed, a 58-token prompt: 48 more.
    assert later_rounds_cacheable(1, 40, 4, 0, [[[7, 8, 9]], [[1, 2, 3]], [[4, 5, 6]]]) == 32 + 48
    # Two users count apiece; one round alone has nothing cacheable.
    assert later_rounds_cacheable(2, 40, 4, 0, [[[7, 8, 9]] * 2, [[1, 2, 3]] * 2]) == 64
    assert later_rounds_cacheable(2, 40, 4, 0, [[[7, 8, 9]] * 2]) == 0
