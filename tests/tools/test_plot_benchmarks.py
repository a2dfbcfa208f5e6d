import json

import pytest

from tools import plot_benchmarks
from tools.plot_benchmarks import (
    DEFAULT_DIR,
    PLOTS,
    PlotDataError,
    chat_runs,
    replicas_ttft,
    serving_rounds,
    transfer_series,
    ttft_bars,
)

pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _serving():
    return {"gpu": "Test GPU", "runs": [
        {"config": "none", "rounds": [{"wall_s": 2.9}, {"wall_s": 2.8}, {"wall_s": 2.85}]},
        {"config": "native", "rounds": [{"wall_s": 2.9}, {"wall_s": 0.61}, {"wall_s": 0.66}]},
        {"config": "pegaflow-auto", "rounds": [{"wall_s": 3.0}, {"wall_s": 0.56}, {"wall_s": 0.64}]},
    ]}


def _ttft():
    return {"gpu": "Test GPU", "compilation": "eager", "gpu_hit_ms_median": 20.2, "gpu_hit_ms_p90": 25.4,
            "configs": {"none": {"ttft_warm_ms": 271.7, "outputs_identical": True},
                        "pegaflow": {"ttft_warm_ms": 44.0, "ttft_warm_ms_p90": 46.6, "outputs_identical": True},
                        "native": {"ttft_warm_ms": 71.7, "ttft_warm_ms_p90": 81.9, "outputs_identical": True},
                        "lmcache": {"ttft_warm_ms": 35.8, "ttft_warm_ms_p90": 37.7, "outputs_identical": False}}}


def _transfer():
    rows = [{"through": "direct", "path": path, "block": 16, "tokens": tokens, "dir": direction, "gbps": gbps}
            for path, gbps in (("kernel", 49.0), ("copy-engine", 52.0), ("staged", 53.5))
            for tokens in (1024, 10000) for direction in ("h2d", "d2h")]
    rows += [{"through": "direct", "path": "staged", "block": 64, "tokens": 1024, "dir": "h2d", "gbps": 1.0},
             {"through": "engine", "path": "auto", "block": 16, "tokens": 10000, "dir": "h2d", "gbps": 51.2},
             {"through": "engine", "path": "auto", "block": 16, "tokens": 10000, "dir": "d2h", "gbps": 51.1}]
    return {"gpu": "Test GPU", "date": "2026-11-30", "pinned_h2d_gbps": 55.2, "pinned_d2h_gbps": 55.1, "rows": rows}


def _replicas():
    return {"gpu": "Test GPU", "replicas": 2, "router": "round-robin",
            "pegaflow": {"ttft_p50_ms": 396.0}, "native": {"ttft_p50_ms": 579.0}, "none": {"ttft_p50_ms": 1504.0},
            "runs": [{"config": c, "rounds": [{"wall_s": 2.8}, {"wall_s": w}]}
                     for c, w in (("pegaflow", 0.8), ("native", 1.85), ("none", 2.44))]}


def _write_fixture(directory):
    for plot, result in zip(PLOTS, (_serving(), _ttft(), _transfer(), _replicas()), strict=True):
        (directory / plot.source).write_text(json.dumps(result))


def test_plot_benchmarks_reads_each_figure_from_its_json():
    # the serving rounds per configuration, in the order the servers ran, labelled for readers
    assert serving_rounds(_serving()) == {"no offload": [2.9, 2.8, 2.85], "vLLM native offload": [2.9, 0.61, 0.66],
                                          "pegaflow": [3.0, 0.56, 0.64]}
    # every system of the run, in its order, between no connector and the GPU hit; a system
    # whose outputs differed from no offload's is marked
    bars = ttft_bars(_ttft())
    assert [(bar.label, bar.median_ms, bar.p90_ms) for bar in bars] == [
        ("cold (recompute), no connector", 271.7, None), ("warm from pegaflow", 44.0, 46.6),
        ("warm from vLLM native offload", 71.7, 81.9), ("warm from LMCache, in-process (outputs wrong)", 35.8, 37.7),
        ("GPU prefix-cache hit (floor)", 20.2, 25.4)]
    # 64 KiB pages only, per path, and the engine's point; the limit is the run's own pinned copy
    # the replicas' later-round TTFT per configuration, labelled, in the order they ran
    assert replicas_ttft(_replicas()) == {"pegaflow": 396.0, "vLLM native offload": 579.0,
                                          "no offload": 1504.0}
    # a burst-only run merged into the file (no chat, no rounds, no TTFT row) is left out
    with_burst = _replicas()
    with_burst["runs"].append({"config": "pegaflow-no-compute-once", "burst": {"wall_s": 1.0}})
    with_burst["pegaflow-no-compute-once"] = {"burst_wall_s": 1.0}
    assert chat_runs(with_burst)["runs"] == _replicas()["runs"]
    assert replicas_ttft(chat_runs(with_burst)) == replicas_ttft(_replicas())
    series, limit = transfer_series(_transfer(), "d2h")
    assert limit == 55.1
    assert [(one.xs, one.ys) for one in series] == [((1024, 10000), (49.0, 49.0)), ((1024, 10000), (52.0, 52.0)),
                                                    ((1024, 10000), (53.5, 53.5)), ((10000,), (51.1,))]


def test_plot_benchmarks_fixture_writes_every_plot_as_png(tmp_path, capsys):
    _write_fixture(tmp_path)
    assert plot_benchmarks.main(["--dir", str(tmp_path)]) == 0
    for plot in PLOTS:
        image = (tmp_path / f"{plot.name}.png").read_bytes()
        assert image.startswith(PNG_MAGIC) and len(image) > 10_000
    assert capsys.readouterr().out.count("wrote ") == len(PLOTS)


def test_plot_benchmarks_svg_format_writes_svg(tmp_path):
    _write_fixture(tmp_path)
    assert plot_benchmarks.main(["--dir", str(tmp_path), "--format", "svg"]) == 0
    assert b"<svg" in (tmp_path / "ttft.svg").read_bytes()


def test_plot_benchmarks_missing_file_is_one_line_and_others_drawn(tmp_path, capsys):
    _write_fixture(tmp_path)
    (tmp_path / PLOTS[0].source).unlink()
    assert plot_benchmarks.main(["--dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if line.startswith("skip ")] == \
        [f"skip {PLOTS[0].name}: {tmp_path / PLOTS[0].source} not found"]
    assert not (tmp_path / f"{PLOTS[0].name}.png").exists()
    assert all((tmp_path / f"{plot.name}.png").exists() for plot in PLOTS[1:])


def test_plot_benchmarks_file_without_its_fields_is_skipped_saying_which(tmp_path, capsys):
    _write_fixture(tmp_path)
    (tmp_path / "ttft_peers.json").write_text(json.dumps({"gpu": "Test GPU"}))
    assert plot_benchmarks.main(["--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "skip ttft: ttft_peers.json: no 'configs'" in out
    assert not (tmp_path / "ttft.png").exists() and (tmp_path / "transfer.png").exists()


def test_plot_benchmarks_committed_results_hold_what_the_plots_read():
    # docs/benchmarks.md embeds plots drawn from these files: each must still be readable
    for plot, read in zip(PLOTS, (serving_rounds, ttft_bars, lambda r: transfer_series(r, "h2d"))):
        with open(DEFAULT_DIR / plot.source) as source:
            assert read(json.load(source))


def test_plot_benchmarks_empty_runs_is_a_plot_data_error():
    with pytest.raises(PlotDataError, match="no runs"):
        serving_rounds({"runs": []})


def test_plot_benchmarks_draw_from_the_runs_of_readmes_why_table():
    # README's figures come from these runs (tests/test_readme_figures.py): its TTFT and
    # replicas rows name the plots' files, and its serving rows (peers.json) are the serving
    # plot's run, config by config.
    readme = (DEFAULT_DIR.parent.parent / "README.md").read_text()
    sources = {plot.name: plot.source for plot in PLOTS}
    assert f"`{sources['ttft']}`" in readme and f"`{sources['replicas']}`" in readme
    peers = json.loads((DEFAULT_DIR / "peers.json").read_text())["configs"]
    serving = json.loads((DEFAULT_DIR / sources["serving_rounds"]).read_text())
    for config in serving["args"]["configs"]:
        assert serving[config]["later_rounds_wall_s"] == peers[config]["multi_round"]["later_rounds_wall_s"]
    ttft = json.loads((DEFAULT_DIR / sources["ttft"]).read_text())
    for config, run in ttft["configs"].items():
        assert run["ttft_warm_ms"] == peers[config]["warm_ttft_10k"]["ttft_warm_ms"]


def test_plot_benchmarks_every_plot_names_the_card_and_starts_bars_at_zero(tmp_path):
    # Each figure says which GPU measured it; every value axis of bars and of the transfer
    # rates starts at zero (a cut axis magnifies the gaps).
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    _write_fixture(tmp_path)
    for plot, result in zip(PLOTS, (_serving(), _ttft(), _transfer(), _replicas()), strict=True):
        figure = plot.draw(result, plot_benchmarks._axes_of)
        texts = [figure.get_suptitle()] + [ax.get_title() for ax in figure.axes]
        assert any("Test GPU" in text for text in texts), plot.name
        for ax in figure.axes:
            horizontal = plot.name == "ttft" or (plot.name == "replicas" and ax is figure.axes[1])
            low = ax.get_xlim()[0] if horizontal else ax.get_ylim()[0]
            assert low == 0, (plot.name, ax.get_title())
        plt.close(figure)
    without_card = dict(_ttft())
    del without_card["gpu"]
    with pytest.raises(PlotDataError, match="gpu"):
        plot_benchmarks.draw_ttft(without_card, plot_benchmarks._axes_of)
