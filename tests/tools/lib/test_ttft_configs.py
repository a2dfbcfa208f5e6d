"""bench_ttft's row per configuration: warm TTFT, served share, outputs against no connector's."""

from tools.lib.ttft_configs import cacheable_tokens, config_rows, served_share


def test_ttft_configs_cacheable_tokens_are_full_blocks_short_of_the_last_token():
    # 10000 tokens: 624 full blocks of 16 before the last token; 16 tokens: none (the last is
    # computed); 17 tokens: one block.
    assert cacheable_tokens([[1] * 10000], 16) == 9984
    assert cacheable_tokens([[1] * 16, [1] * 17], 16) == 16
    assert served_share(0.0, 0) == 0.0


def _phase(warm_ms, hits, tokens, warm_tokens=None):
    """A warm pass of two requests on an emptied GPU cache; ``hits``: the tokens not computed."""
    return {"warm_ms": warm_ms, "warm_cached_tokens": [hits // 2, hits - hits // 2], "cacheable_tokens": 200,
            "cold_tokens": tokens, "warm_tokens": warm_tokens or tokens, "reset_wait_s": 0.0,
            "warm_by_source": {"local_compute": 400 - hits, "local_cache_hit": 0, "external_kv_transfer": hits}}


def test_ttft_configs_rows_report_share_and_identity_per_configuration():
    # 1. none: its cold time stands as its warm one, nothing served; the rest from their phases.
    tokens = [[5], [6]]
    none = {"cold_ms": [300.0, 280.0, 290.0], "cold_tokens": tokens, "gpu_hit_tokens": tokens}
    peers = {"lmcache": _phase([80.0, 90.0], 62, tokens, [[5], [7]]),
             "pegaflow-rs": {"skipped": "ImportError: undefined symbol: x"},
             "lmcache-mp": {"failed": "its server exited (1)"}}
    rows = config_rows(_phase([40.0, 60.0], 200, tokens), _phase([70.0, 70.0], 100, tokens), none, peers)
    assert list(rows) == ["none", "pegaflow", "native", "lmcache", "pegaflow-rs", "lmcache-mp"]
    assert {k: v for k, v in rows["none"].items() if k not in ("requests", "cudagraph_mode")} == {
        "ttft_warm_ms": 290.0, "ttft_warm_ms_p90": 300.0, "served_share": 0.0, "outputs_identical": True}
    assert rows["pegaflow"]["ttft_warm_ms"] == 50.0 and rows["pegaflow"]["served_share"] == 1.0
    assert rows["native"]["served_share"] == 0.5
    # 2. A peer with one wrong warm token is reported wrong, whatever its speed; the others are not.
    assert rows["lmcache"]["outputs_identical"] is False and rows["lmcache"]["served_share"] == 0.31
    assert rows["pegaflow"]["outputs_identical"] is True and rows["native"]["outputs_identical"] is True
    # 3. A skipped peer keeps its reason and no figures.
    assert rows["pegaflow-rs"] == {"skipped": "ImportError: undefined symbol: x"}
    assert rows["lmcache-mp"] == {"failed": "its server exited (1)"}


def test_ttft_configs_wrong_cold_tokens_are_wrong_too():
    tokens = [[5], [6]]
    none = {"cold_ms": [300.0], "cold_tokens": tokens, "gpu_hit_tokens": tokens}
    rows = config_rows(_phase([40.0], 200, [[5], [9]], tokens), None, none, {})
    assert rows["pegaflow"]["outputs_identical"] is False and "native" not in rows


def test_ttft_configs_served_share_is_the_cached_tokens_of_the_warm_requests():
    # The run that showed it: vLLM's external-hit counter said 0 for pegaflow's warm pass (the
    # offline LLM drops the counts of engine steps that return no token), while each of the 8
    # requests had 9984 of its 10000 prompt tokens served.  The share comes from the requests.
    tokens = [[5]] * 8
    none = {"cold_ms": [268.0], "cold_tokens": tokens, "gpu_hit_tokens": tokens}
    peg = {"warm_ms": [38.9] * 8, "warm_cached_tokens": [9984] * 8, "cacheable_tokens": 8 * 9984,
           "cold_tokens": tokens, "warm_tokens": tokens, "reset_wait_s": 0.4, "external_hit_tokens": 0.0,
           "warm_by_source": {"local_compute": 128, "local_cache_hit": 0, "external_kv_transfer": 79872},
           "warm_engine_loaded_tokens": 79872 - 16}
    rows = config_rows(peg, None, none, {})
    assert rows["pegaflow"]["served_share"] == 1.0 and rows["pegaflow"]["reset_wait_s"] == 0.4
    # The engine's own count of what it loaded stands beside it (one block short here).
    assert rows["pegaflow"]["engine_served_share"] == (79872 - 16) / 79872


def test_ttft_configs_a_warm_pass_that_hit_the_gpu_is_invalid_with_no_figures():
    # 1. pegaflow-rs in the run that showed it: the reset refused, every warm request a GPU hit
    #    of 624 blocks (9984 tokens) and 15 tokens from its own cache.  Fast, outputs right: invalid.
    tokens = [[5]] * 8
    none = {"cold_ms": [268.0], "cold_tokens": tokens, "gpu_hit_tokens": tokens}
    peg = _phase([40.0], 200, tokens)
    gpu_hit = {"warm_ms": [18.1] * 8, "warm_cached_tokens": [9999] * 8, "cacheable_tokens": 8 * 9984,
               "cold_tokens": tokens, "warm_tokens": tokens, "reset_wait_s": 0.0,
               "warm_by_source": {"local_compute": 8, "local_cache_hit": 79872, "external_kv_transfer": 120}}
    rows = config_rows(peg, dict(gpu_hit), none, {"pegaflow-rs": gpu_hit})
    for config in ("native", "pegaflow-rs"):  # (its requests kept: what it served, per request)
        assert list(rows[config]) == ["invalid", "cudagraph_mode", "requests"]
        assert "79872 prompt tokens" in rows[config]["invalid"]
        assert [r["warm_served_tokens"] for r in rows[config]["requests"]] == [9999] * 8
    # 2. A vLLM that does not split its hits by source: no figure either.
    unsplit = dict(gpu_hit, warm_by_source=None)
    assert "cannot be ruled out" in config_rows(peg, None, none, {"lmcache": unsplit})["lmcache"]["invalid"]
    # 3. A phase that failed (its reset never succeeded) keeps its error.
    failed = {"failed": "vLLM refused to reset its GPU prefix cache 1500 times in 300 s"}
    assert config_rows(peg, failed, none, {})["native"] == failed


def test_ttft_configs_logprobs_compared_with_the_gpu_hit_where_the_same_tokens_were_cached():
    from tools.lib.ttft_configs import logprobs_match
    none = {"gpu_hit_top5": [[[5, -0.25], [6, -1.5]], [[8, -0.5]]], "gpu_hit_cached_tokens": [48, 48]}
    same = {"warm_top5": [[[5, -0.25], [6, -1.5]], [[8, -0.5]]], "warm_cached_tokens": [48, 48]}
    assert logprobs_match(same, none) == (True, 2)
    # One logprob off in the last place: not identical.
    off = {**same, "warm_top5": [[[5, -0.25], [6, -1.5000001]], [[8, -0.5]]]}
    assert logprobs_match(off, none) == (False, 2)
    # A request that had a different number of tokens cached computed a different step: left out.
    other = {**off, "warm_cached_tokens": [32, 48]}
    assert logprobs_match(other, none) == (True, 1)
    # Nothing comparable (an older run without logprobs): None.
    assert logprobs_match({"warm_cached_tokens": [48]}, none) == (None, 0)
    # Nor a phase vLLM ran under another CUDA graph mode than none's.
    none_full = {**none, "cudagraph_mode": "FULL_AND_PIECEWISE"}
    assert logprobs_match({**same, "cudagraph_mode": "PIECEWISE"}, none_full) == (None, 0)
    assert logprobs_match({**same, "cudagraph_mode": "FULL_AND_PIECEWISE"}, none_full) == (True, 2)


def test_ttft_configs_rows_keep_per_request_evidence_that_rechecks_to_the_same_marks():
    # 1. Two requests; lmcache's second warm token and its first request's top-5 differ from
    #    none's GPU hit; pegaflow's match; native cached one block more than the hit (not compared).
    from tools.lib.evidence import recheck_ttft, tokens_sha256
    tokens, top5 = [[5], [6]], [[[5, -0.25], [9, -2.0]], [[6, -0.5], [7, -1.0]]]
    none = {"cold_ms": [300.0], "cold_tokens": tokens, "gpu_hit_tokens": tokens, "gpu_hit_top5": top5,
            "gpu_hit_cached_tokens": [96, 96], "cudagraph_mode": "FULL"}

    def phase(warm_tokens, warm_top5, cached):
        return dict(_phase([40.0, 40.0], sum(cached), tokens, warm_tokens), warm_top5=warm_top5,
                    warm_cached_tokens=cached, cudagraph_mode="FULL")
    peg = phase(tokens, top5, [96, 96])
    lmcache = phase([[5], [7]], [[[5, -0.3], [9, -2.0]], top5[1]], [96, 96])
    native = phase(tokens, top5, [112, 112])
    rows = config_rows(peg, native, none, {"lmcache": lmcache})
    # 2. The JSON keeps, per request: each pass's tokens hash, served tokens and top-5.
    first = rows["lmcache"]["requests"][0]
    assert first["cold_tokens_sha256"] == tokens_sha256([5]) and first["warm_served_tokens"] == 96
    assert first["warm_top5"] == [[5, -0.3], [9, -2.0]] and rows["none"]["requests"][1]["gpu_hit_top5"] == top5[1]
    # 3. The marks, worked out again from the requests alone (through JSON), are the rows' own.
    import json
    again = recheck_ttft(json.loads(json.dumps(rows)))
    for config in ("pegaflow", "native", "lmcache"):
        assert again[config] == {k: rows[config][k] for k in ("outputs_identical", "logprobs_identical",
                                                              "logprobs_compared")}
    assert again["lmcache"] == {"outputs_identical": False, "logprobs_identical": False, "logprobs_compared": 2}
    assert again["native"]["logprobs_identical"] is None and again["pegaflow"]["logprobs_identical"] is True
    assert again["none"]["outputs_identical"] is True
