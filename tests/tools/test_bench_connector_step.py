"""tools/bench_connector_step.py runs the real worker and scheduler sides' hooks."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench_connector_step import _Noop, _pegaflow, _step_us  # noqa: E402


def test_bench_connector_step_drives_the_real_hooks_through_decode_steps():
    # 1. The timed loop runs pegaflow's hooks: the worker sees every step bound and its
    #    loads waited for, the scheduler plans no save (the request's blocks are saved).
    worker, scheduler, names = _pegaflow(4)
    assert _step_us(worker, scheduler, names, 50) > 0
    assert worker._meta is not None and worker._loads_waited and worker._save_cmds == {}
    assert scheduler.requests["r"].num_saved_blocks == 78
    # 2. The baseline runs the same calls on hooks that do nothing.
    noop = _Noop()
    assert _step_us(noop, noop, names, 50) > 0
