"""bench_ttft's row per configuration: warm TTFT, served share, outputs against no connector's."""

from tools.ttft_configs import cacheable_tokens, config_rows, served_share


def test_ttft_configs_cacheable_tokens_are_full_blocks_short_of_the_last_token():
    # 10000 tokens: 624 full blocks of 16 before the last token; 16 tokens: none (the last is
    # computed); 17 tokens: one block.
    assert cacheable_tokens([[1] * 10000], 16) == 9984
    assert cacheable_tokens([[1] * 16, [1] * 17], 16) == 16
    assert served_share(0.0, 0) == 0.0


def _phase(warm_ms, hits, tokens, warm_tokens=None):
    return {"warm_ms": warm_ms, "warm_hit_tokens": hits, "cacheable_tokens": 200,
            "cold_tokens": tokens, "warm_tokens": warm_tokens or tokens}


def test_ttft_configs_rows_report_share_and_identity_per_configuration():
    # 1. none: its cold time stands as its warm one, nothing served; the rest from their phases.
    tokens = [[5], [6]]
    none = {"cold_ms": [300.0, 280.0, 290.0], "cold_tokens": tokens, "gpu_hit_tokens": tokens}
    peers = {"lmcache": _phase([80.0, 90.0], 62.0, tokens, [[5], [7]]),
             "pegaflow-rs": {"skipped": "ImportError: undefined symbol: x"},
             "lmcache-mp": {"failed": "its server exited (1)"}}
    rows = config_rows(_phase([40.0, 60.0], 200.0, tokens), _phase([70.0, 70.0], 100.0, tokens), none, peers)
    assert list(rows) == ["none", "pegaflow", "native", "lmcache", "pegaflow-rs", "lmcache-mp"]
    assert rows["none"] == {"ttft_warm_ms": 290.0, "ttft_warm_ms_p90": 300.0, "served_share": 0.0,
                            "outputs_identical": True}
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
    rows = config_rows(_phase([40.0], 200.0, [[5], [9]], tokens), None, none, {})
    assert rows["pegaflow"]["outputs_identical"] is False and "native" not in rows
