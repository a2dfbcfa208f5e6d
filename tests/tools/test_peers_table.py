"""tools/peers_table.py: every system on every workload from the benches' JSON."""

import json

from tools.lib.tables import build, markdown
from tools.peers_table import main


def _inputs():
    ttft = {"gpu": "NVIDIA H200", "configs": {
        "none": {"ttft_warm_ms": 480.0, "served_share": 0.0, "outputs_identical": True},
        "native": {"ttft_warm_ms": 90.0, "served_share": 1.0, "outputs_identical": True},
        "lmcache": {"ttft_warm_ms": 40.0, "served_share": 0.97, "outputs_identical": False},
        "pegaflow-rs": {"skipped": "ImportError: undefined symbol: x"},
        "pegaflow": {"ttft_warm_ms": 48.0, "served_share": 1.0, "outputs_identical": True}}}
    serving = {"gpu": "NVIDIA H200", "model": "m", "args": {"later_rounds_wall_s": 1}, "runs": [],
               "none": {"later_rounds_wall_s": 9.0, "throughput_rps": 2.0, "outputs_identical": True},
               "pegaflow": {"later_rounds_wall_s": 6.0, "throughput_rps": 5.0, "outputs_identical": True},
               "pegaflow-rs": {"later_rounds_wall_s": 7.5, "throughput_rps": 4.0, "outputs_identical": True}}
    return {"ttft": ttft, "serving": serving}


def test_peers_table_cells_and_pegaflow_against_the_fastest_other():
    table = build(_inputs(), "2026-12-06")
    assert table["gpu"] == "NVIDIA H200" and table["date"] == "2026-12-06"
    # 1. Cells per configuration and workload; a skipped peer keeps its reason.
    assert table["configs"]["pegaflow"]["warm_ttft_10k"] == {"ttft_warm_ms": 48.0, "outputs_identical": True,
                                                             "served_share": 1.0}
    assert table["configs"]["pegaflow-rs"]["warm_ttft_10k"] == {"skipped": "ImportError: undefined symbol: x"}
    assert table["configs"]["pegaflow-rs"]["multi_round"]["later_rounds_wall_s"] == 7.5
    assert "replicas" not in table["versus"] and "args" not in table["configs"]
    # 2. TTFT: lmcache is faster (40 ms) but wrong: the mark is native's 90 ms, pegaflow ahead.
    assert table["versus"]["warm_ttft_10k"] == {"best_other": "native", "pegaflow_over_best": 48.0 / 90.0,
                                                "pegaflow_ahead": True, "left_out_wrong": ["lmcache"]}
    # 3. Wall time: pegaflow-rs is the fastest other (7.5 s); pegaflow 6.0 s, ahead.
    assert table["versus"]["multi_round"] == {"best_other": "pegaflow-rs", "pegaflow_over_best": 0.8,
                                              "pegaflow_ahead": True, "left_out_wrong": []}
    # 4. Throughput: higher is better; none is left out of the comparison.
    assert table["versus"]["shared_prefix"] == {"best_other": "pegaflow-rs", "pegaflow_over_best": 1.25,
                                                "pegaflow_ahead": True, "left_out_wrong": []}


def test_peers_table_markdown_marks_wrong_and_skipped(tmp_path, capsys):
    # 1. Through the command line, as a user runs it; the JSON written is build()'s.
    paths = {}
    for bench, data in _inputs().items():
        paths[bench] = tmp_path / f"{bench}.json"
        paths[bench].write_text(json.dumps(data))
    out = tmp_path / "peers.json"
    assert main(["--ttft", str(paths["ttft"]), "--serving", str(paths["serving"]), "--out", str(out),
                 "--date", "2026-12-06"]) == 0
    assert json.loads(out.read_text()) == build(_inputs(), "2026-12-06")
    text = capsys.readouterr().out
    assert text == markdown(build(_inputs(), "2026-12-06")) + "\n"
    # 2. The header names the card and the date; columns in a fixed order; a wrong peer is marked.
    lines = text.splitlines()
    assert lines[0] == "NVIDIA H200, 2026-12-06"
    assert lines[2] == ("| workload | none | native | lmcache | pegaflow-rs | pegaflow | "
                        "pegaflow vs fastest correct other |")
    ttft_row = next(line for line in lines if line.startswith("| warm 10k-token TTFT"))
    assert "40 ms (97% served) **wrong outputs**" in ttft_row and "| skipped |" in ttft_row
    assert ttft_row.endswith("| 0.53x native's (ahead; left out, measured wrong: lmcache) |")
    wall_row = next(line for line in lines if line.startswith("| multi-round"))
    assert wall_row == ("| multi-round serving, later rounds | 9 s | not run | not run | 7.5 s | 6 s "
                        "| 0.80x pegaflow-rs's (ahead) |")


def test_peers_table_an_invalid_configuration_is_never_the_mark_to_beat():
    # pegaflow-rs's warm pass hit vLLM's GPU cache (18 ms): its cell keeps the reason, no
    # figure, and pegaflow is compared with the fastest valid other (native).
    inputs = _inputs()
    inputs["ttft"]["configs"]["pegaflow-rs"] = {"invalid": "79872 prompt tokens of the warm pass were GPU hits"}
    table = build({"ttft": inputs["ttft"]}, "2026-12-06")
    assert table["configs"]["pegaflow-rs"]["warm_ttft_10k"] == {
        "invalid": "79872 prompt tokens of the warm pass were GPU hits"}
    assert table["versus"]["warm_ttft_10k"]["best_other"] == "native"
    assert "| invalid |" in markdown(table)


def test_peers_table_logprobs_that_differ_from_the_gpu_hit_make_a_peer_wrong():
    # bench_ttft on a scrubbed GPU cache: native's tokens equal none's, but its first token's
    # top-5 logprobs differ from the GPU hit's: a KV byte it served was not the computed one.
    inputs = _inputs()
    inputs["ttft"]["configs"]["native"]["logprobs_identical"] = False
    inputs["ttft"]["configs"]["pegaflow"]["logprobs_identical"] = True
    table = build(inputs, "2026-12-06")
    assert table["configs"]["native"]["warm_ttft_10k"]["logprobs_identical"] is False
    assert table["versus"]["warm_ttft_10k"] is None  # lmcache and native both wrong: no mark left
    row = next(line for line in markdown(table).splitlines() if line.startswith("| warm 10k-token TTFT"))
    assert "90 ms (100% served) **logprobs differ**" in row
    # The same row with native's logprobs equal: native is the mark again.
    inputs["ttft"]["configs"]["native"]["logprobs_identical"] = True
    assert build(inputs, "2026-12-06")["versus"]["warm_ttft_10k"]["best_other"] == "native"


def test_peers_table_serving_share_is_the_multi_round_chats_only():
    inputs = _inputs()
    inputs["serving"]["pegaflow"]["served_share"] = 1.0
    table = build(inputs, "2026-12-06")
    assert table["configs"]["pegaflow"]["multi_round"]["served_share"] == 1.0
    assert "served_share" not in table["configs"]["pegaflow"]["shared_prefix"]


def test_peers_table_a_peer_wrong_on_one_workload_is_never_the_mark_on_another():
    # lmcache's warm pass (scrubbed GPU cache) gave wrong outputs; its serving run's outputs
    # matched (stale GPU pages can hide a wrong byte) and it was the fastest there: it is
    # marked wrong on serving too, and pegaflow is compared with pegaflow-rs.
    inputs = _inputs()
    inputs["serving"]["lmcache"] = {"later_rounds_wall_s": 5.0, "throughput_rps": 6.0, "outputs_identical": True}
    table = build(inputs, "2026-12-06")
    assert table["wrong"] == {"lmcache": ["warm_ttft_10k"]}
    assert table["versus"]["multi_round"]["best_other"] == "pegaflow-rs"
    assert table["versus"]["shared_prefix"]["best_other"] == "pegaflow-rs"
    # Its serving cell says what serving measured (tokens identical), not the TTFT's mark.
    row = next(line for line in markdown(table).splitlines() if line.startswith("| multi-round"))
    assert "| 5 s | " in row and row.endswith("left out, measured wrong: lmcache) |")
    assert table["marks"]["lmcache"]["on"]["multi_round"] == "tokens identical"
    assert table["marks"]["lmcache"]["on"]["warm_ttft_10k"] == "wrong: output tokens differ from no offload's"
    # Without its wrong TTFT, lmcache is the mark (5.0 s against pegaflow's 6.0: behind).
    inputs["ttft"]["configs"]["lmcache"]["outputs_identical"] = True
    assert build(inputs, "2026-12-06")["versus"]["multi_round"] == {
        "best_other": "lmcache", "pegaflow_over_best": 1.2, "pegaflow_ahead": False, "left_out_wrong": []}


def test_peers_table_pegaflows_own_variants_are_columns_not_marks():
    # pegaflow-hold is pegaflow with an engine flag: its own column, never the system to beat.
    inputs = _inputs()
    inputs["serving"]["pegaflow-hold"] = {"later_rounds_wall_s": 5.5, "throughput_rps": 5.5, "outputs_identical": True}
    table = build(inputs, "2026-12-06")
    assert table["configs"]["pegaflow-hold"]["multi_round"]["later_rounds_wall_s"] == 5.5
    assert table["versus"]["multi_round"]["best_other"] == "pegaflow-rs"
    assert markdown(table).splitlines()[2].endswith("| pegaflow | pegaflow-hold | pegaflow vs fastest correct other |")
    # An engine variant's configuration (--engine-variants hold-saves) is one too, however fast.
    inputs["serving"]["pegaflow+hold-saves"] = {"later_rounds_wall_s": 0.5, "throughput_rps": 50.0,
                                                "outputs_identical": True}
    assert build(inputs, "2026-12-06")["versus"]["multi_round"]["best_other"] == "pegaflow-rs"


def test_peers_table_marks_each_mode_on_each_workload_from_its_own_evidence_only():
    # 1. LMCache in-process wrong on the scrubbed TTFT (its logprobs), tokens identical on
    #    serving; LMCache multi-process right on the TTFT and absent from serving; PegaFlow
    #    skipped on the TTFT.
    inputs = _inputs()
    inputs["ttft"]["configs"]["lmcache"].update(outputs_identical=True, logprobs_identical=False,
                                                logprobs_compared=8)
    inputs["ttft"]["configs"]["lmcache-mp"] = {"ttft_warm_ms": 45.0, "served_share": 1.0, "outputs_identical": True,
                                               "logprobs_identical": True, "logprobs_compared": 8}
    inputs["serving"]["lmcache"] = {"later_rounds_wall_s": 5.0, "throughput_rps": 6.0, "outputs_identical": True}
    table = build(inputs, "2026-12-06")
    marks = table["marks"]
    # 2. Each mark names the release and the mode, and says only what its workload measured.
    assert marks["lmcache"]["who"] == "LMCache 0.5.3, in-process LMCacheConnectorV1"
    assert marks["lmcache"]["known_issue"] == "LMCache#4463"
    assert marks["lmcache"]["on"] == {
        "warm_ttft_10k": "wrong: first-token logprobs differ from the GPU prefix-cache hit's, 8 requests compared",
        "multi_round": "tokens identical", "shared_prefix": "tokens identical"}
    # 3. Nothing inferred across modes: the multi-process mode is right where it ran, not run elsewhere.
    assert marks["lmcache-mp"]["who"] == "LMCache 0.5.3, multi-process LMCacheMPConnector + lmcache server"
    assert marks["lmcache-mp"]["on"] == {
        "warm_ttft_10k": "right: tokens and first-token logprobs equal, 8 requests compared",
        "multi_round": "not run", "shared_prefix": "not run"}
    assert "known_issue" not in marks["lmcache-mp"] and table["wrong"] == {"lmcache": ["warm_ttft_10k"]}
    assert marks["pegaflow-rs"]["on"]["warm_ttft_10k"] == "not run (skipped: ImportError: undefined symbol: x)"
    # 4. lmcache-mp is a mark to beat where it ran right: TTFT against its 45 ms, not native's 90.
    assert table["versus"]["warm_ttft_10k"]["best_other"] == "lmcache-mp"
    text = markdown(table)
    assert ("- LMCache 0.5.3, in-process LMCacheConnectorV1 (LMCache#4463): warm 10k-token TTFT: wrong: "
            "first-token logprobs differ") in text
    assert "| not run |" in next(line for line in text.splitlines() if line.startswith("| multi-round"))


def test_peers_table_a_peer_that_failed_is_not_run_in_its_cell_and_says_why_in_its_marks():
    # A peer whose server did not start is "not run" on every workload (never "wrong", never a
    # figure); its marks keep the bench's reason.
    inputs = _inputs()
    inputs["ttft"]["configs"]["lmcache-mp"] = {"failed": "its server exited (3)"}
    table = build({"ttft": inputs["ttft"]}, "2026-12-07")
    assert table["marks"]["lmcache-mp"]["on"]["warm_ttft_10k"] == "not run (failed: its server exited (3))"
    assert "lmcache-mp" not in table["wrong"]
    row = next(line for line in markdown(table).splitlines() if line.startswith("| warm 10k-token TTFT"))
    assert "| not run |" in row and "failed" not in row
