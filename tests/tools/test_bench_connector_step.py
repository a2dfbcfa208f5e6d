"""tools/bench_connector_step.py runs the real worker and scheduler sides' hooks."""

from collections import Counter

import pytest

pytest.importorskip("vllm")  # the connector's metadata is vLLM's  # noqa: E402
from tools.bench_connector_step import _Noop, _pegaflow, _step_us  # noqa: E402

HOOKS = ("bind", "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
         "get_finished", "build_connector_meta", "update_connector_output")


def _counted(calls: Counter, *sides) -> None:
    """Count every hook call on ``sides`` (their own methods still run)."""
    for side in sides:
        for hook in HOOKS:
            if hasattr(side, hook):
                method = getattr(side, hook)
                setattr(side, hook, lambda *a, _m=method, _h=hook, **k: (calls.update([_h]), _m(*a, **k))[1])


def test_bench_connector_step_drives_the_real_hooks_through_decode_steps():
    # 1. The timed loop runs pegaflow's hooks: the worker sees every step bound and its
    #    loads waited for, the scheduler plans no save (the request's blocks are saved).
    worker, scheduler, names = _pegaflow(4)
    calls = Counter()
    _counted(calls, worker, scheduler)
    _step_us(worker, scheduler, names, 50)
    per_layer = {"wait_for_layer_load", "save_kv_layer"}
    assert calls == Counter({h: 50 * (len(names) if h in per_layer else 1) for h in HOOKS})
    assert worker._meta is not None and worker.loads.is_waited and worker.saves.commands == {}
    assert scheduler.requests["r"].num_saved_blocks == 78
    # 2. The baseline runs the same calls on hooks that do nothing.
    noop, noop_calls = _Noop(), Counter()
    _counted(noop_calls, noop)
    _step_us(noop, noop, names, 50)
    assert noop_calls == calls
