"""The step timeline: logged at DEBUG only, one line per traced step, CPU marks in order."""

import logging

from pegaflow.connector.trace import StepTrace


def test_trace_logs_the_previous_step_when_the_next_one_ends(caplog):
    caplog.set_level(logging.DEBUG, logger="pegaflow.connector.trace")
    trace = StepTrace()
    # 1. A step with loads is traced; its line appears once the next traced step ends.
    trace.begin(num_loads=1, num_blocks=624)
    trace.mark("loads_submitted")
    trace.mark("loads_accepted")
    trace.end()
    assert caplog.records == []
    trace.begin(num_loads=2, num_blocks=8)
    trace.end()
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("step 1: 1 load(s) of 624 blocks")
    assert line.index("loads_submitted +") < line.index("loads_accepted +") < line.index("get_finished +")
    # 2. flush() reports the last step.
    trace.flush()
    assert caplog.records[-1].getMessage().startswith("step 2: 2 load(s) of 8 blocks")


def test_trace_is_off_without_debug_or_without_loads(caplog):
    caplog.set_level(logging.INFO, logger="pegaflow.connector.trace")
    trace = StepTrace()
    trace.begin(num_loads=1, num_blocks=4)
    assert not trace.is_on
    caplog.set_level(logging.DEBUG, logger="pegaflow.connector.trace")
    trace.begin(num_loads=0, num_blocks=0)
    assert not trace.is_on
    trace.end()
    trace.flush()
    assert caplog.records == []


def test_trace_of_loads_sent_at_handle_preemptions_times_from_there(caplog):
    # Loads sent at handle_preemptions: the line starts there, and start_load_kv is a mark
    # after it (how far ahead of it the loads went out).
    caplog.set_level(logging.DEBUG, logger="pegaflow.connector.trace")
    trace = StepTrace()
    trace.begin(num_loads=1, num_blocks=4, hook="handle_preemptions")
    trace.mark("start_load_kv")
    trace.end()
    trace.flush()
    (line,) = [r.getMessage() for r in caplog.records]
    assert "4 blocks, handle_preemptions at monotonic" in line
    assert "(ms after handle_preemptions): start_load_kv +" in line
