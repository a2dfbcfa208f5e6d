"""tools.step_timeline: the logging config routes the connector's step timeline into its own
file, the parser reads the lines ``StepTrace`` writes, and the summary splits them by time."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time

from pegaflow.connector.trace import StepTrace
from tools import step_timeline

GPU_LINE = ("DEBUG 12-02 [pegaflow.connector.trace] step 7: 4 load(s) of 2048 blocks, start_load_kv at "
            "monotonic 812.500000 (ms after start_load_kv): loads_submitted +0.40, loads_accepted +1.50, "
            "wait_for_save +90.10, get_finished +90.30, gpu first_layer_ready +2.50, "
            "gpu last_layer_ready +84.10, gpu forward_done +90.20")


def test_step_timeline_parses_the_lines_step_trace_writes(caplog):
    caplog.set_level(logging.DEBUG, logger=step_timeline.TRACE_LOGGER)
    trace = StepTrace()
    began = time.monotonic()
    for num_loads in (2, 3):  # a step is reported when the next one ends
        trace.begin(num_loads, 10 * num_loads)
        trace.mark("loads_submitted")
        trace.mark("wait_for_save")
        trace.end()
    trace.flush()
    steps = step_timeline.parse(r.getMessage() for r in caplog.records)
    assert [(s["loads"], s["blocks"]) for s in steps] == [(2, 20), (3, 30)]
    assert {"loads_submitted", "wait_for_save", "get_finished"} <= set(steps[0])
    assert began - 1e-3 <= steps[0]["start"] <= time.monotonic()  # the monotonic clock, in the run (ms marks)


def test_step_timeline_reads_gpu_marks_and_summarizes_a_window():
    steps = step_timeline.parse(["noise", GPU_LINE, GPU_LINE.replace("monotonic 812.5", "monotonic 900.5")])
    assert steps[0]["gpu_last_layer_ready"] == 84.1 and steps[0]["loads_accepted"] == 1.5
    inside = step_timeline.summarize(steps, 800.0, 850.0)
    assert inside["steps"] == 1 and inside["blocks"] == 2048 and inside["loads_per_step_max"] == 4
    assert inside["gpu_forward_done"] == {"p50": 90.2, "p90": 90.2, "max": 90.2}
    assert step_timeline.summarize(steps)["steps"] == 2
    assert step_timeline.summarize(steps, 0.0, 0.0)["steps"] == 0


def test_step_timeline_reads_the_hook_the_loads_went_out_from(caplog):
    # 1. One step sent its loads at handle_preemptions (start_load_kv came 2 ms later), the
    #    next at start_load_kv (vLLM wrote their blocks while it prepared the step).
    caplog.set_level(logging.DEBUG, logger=step_timeline.TRACE_LOGGER)
    trace = StepTrace()
    trace.begin(1, 4, "handle_preemptions")
    trace.mark("start_load_kv")
    trace.end()
    trace.begin(1, 4)
    trace.end()
    trace.flush()
    early, late = step_timeline.parse(r.getMessage() for r in caplog.records)
    # 2. Each step says its hook, and start_load_kv is a mark of the early one only.
    assert (early["sent_at"], late["sent_at"]) == ("handle_preemptions", "start_load_kv")
    assert "start_load_kv" in early and "start_load_kv" not in late
    summary = step_timeline.summarize([early, late])
    assert summary["sent_at"] == {"handle_preemptions": 1, "start_load_kv": 1}
    assert summary["start_load_kv"]["max"] >= 0.0 and "sent_at" not in summary["start_load_kv"]


def test_step_timeline_logging_config_sends_the_trace_to_its_file_and_keeps_vllms(tmp_path):
    trace_path = tmp_path / "trace.log"
    code = ("import json, logging, logging.config, sys; "
            "logging.config.dictConfig(json.loads(sys.argv[1])); "
            "logging.getLogger('pegaflow.connector.trace').debug('step 1: traced'); "
            "logging.getLogger('vllm').info('vllm line'); logging.getLogger('vllm').debug('hidden')")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(step_timeline.logging_config(trace_path))],
                          capture_output=True, text=True, check=True)
    assert "step 1: traced" in trace_path.read_text()
    assert "vllm line" in done.stderr and "hidden" not in done.stderr and "traced" not in done.stderr


def test_step_timeline_parses_the_scheduler_lines_and_finds_a_rounds_first_admission(caplog):
    from types import SimpleNamespace

    from pegaflow.connector.trace import log_schedule
    caplog.set_level(logging.DEBUG, logger=step_timeline.TRACE_LOGGER)

    def output(new: int, running: int, tokens: int):
        return SimpleNamespace(scheduled_new_reqs=[object()] * new,
                               scheduled_cached_reqs=SimpleNamespace(req_ids=["r"] * running),
                               total_num_scheduled_tokens=tokens, finished_req_ids={"done"})

    def meta(load_blocks: list[int], save_blocks: list[int]):
        return SimpleNamespace(loads=[SimpleNamespace(block_ids=range(n)) for n in load_blocks],
                               saves=[SimpleNamespace(block_ids=range(n)) for n in save_blocks])
    since = time.monotonic()
    log_schedule(1, output(0, 4, 4), meta([], []))
    log_schedule(2, output(3, 0, 240), meta([504, 504, 504], [10, 5]))
    schedule = step_timeline.parse_schedule(["noise"] + [r.getMessage() for r in caplog.records])
    assert [(s["step"], s["new"], s["running"], s["tokens"], s["finished"]) for s in schedule] == [
        (1, 0, 4, 4, 1), (2, 3, 0, 240, 1)]
    assert (schedule[1]["loads"], schedule[1]["load_blocks"], schedule[1]["save_blocks"]) == (3, 1512, 15)
    delay = step_timeline.first_admission_ms(schedule, since)
    assert delay is not None and 0 <= delay == round((schedule[1]["at"] - since) * 1e3, 3)
    assert step_timeline.first_admission_ms(schedule, schedule[1]["at"] + 1) is None


def test_step_timeline_scheduler_line_costs_nothing_unless_debug(caplog):
    from pegaflow.connector.trace import log_schedule
    caplog.set_level(logging.INFO, logger=step_timeline.TRACE_LOGGER)
    log_schedule(1, object(), object())  # not read at all: no attribute is touched
    assert not caplog.records
