"""bench_decode's arithmetic, on made-up phase results (the phases themselves need a GPU)."""

from tools.bench_decode import headline, summarize


def _run(kind, tpot_bs1, tpot_bs32, mode="FULL_AND_PIECEWISE"):
    return (kind, 0, {"cudagraph_mode": mode,
                      "tpot_ms": {"bs1_ctx1024": tpot_bs1, "bs32_ctx1024": tpot_bs32,
                                  "bs1_ctx8192": [7.0]}})


def test_bench_decode_ratios_pool_every_repeat_and_keep_each_repeats_median():
    # 1. Two rounds of the three phases; round two of "saving" is slower.
    runs = [_run("none", [5.0, 5.0], [6.0]), _run("idle", [5.0, 5.2], [6.0]),
            _run("saving", [5.0, 5.1], [6.3]), _run("none", [5.0, 5.0], [6.0]),
            _run("idle", [5.0, 5.0], [6.0]), _run("saving", [5.5, 5.5], [6.3])]
    summary = summarize(runs, "graphs")
    # 2. The cell's figure is the median over every request of both rounds; the spread
    #    is each round's own median.
    assert summary["saving_bs1_ctx1024_ms"] == 5.3
    assert summary["saving_bs1_ctx1024_repeat_medians_ms"] == [5.05, 5.5]
    assert abs(summary["saving_vs_none_bs1_ctx1024"] - 5.3 / 5.0) < 1e-12
    assert abs(summary["idle_vs_none_bs32_ctx1024"] - 1.0) < 1e-12
    # 3. The flat names docs/benchmarks.md quotes; the shortest context also without its
    #    context, and vLLM's cudagraph mode beside them.
    flat = headline({"graphs": summary})
    assert flat["graphs_saving_vs_none_bs32"] == flat["graphs_saving_vs_none_bs32_ctx1024"] == 6.3 / 6.0
    assert flat["graphs_saving_vs_none_bs1_ctx8192"] == 1.0
    assert flat["cudagraph_mode_pegaflow"] == ["FULL_AND_PIECEWISE"]
