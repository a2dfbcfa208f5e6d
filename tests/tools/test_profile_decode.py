"""profile_decode's reading of a profile and its comparison of phases (no GPU)."""

from __future__ import annotations

import cProfile
import pstats

from tools import profile_decode


def _fake_vllm_step_loop(steps: int):
    """Functions compiled under vLLM-like and pegaflow-like file names, so the profile
    names them as it would in a real run."""
    namespace: dict = {}
    exec(compile("def schedule():\n    return 1\n", "/venv/lib/site-packages/vllm/v1/core/sched/scheduler.py",
                 "exec"), namespace)
    exec(compile("def wait_for_layer_load(n):\n    return sum(range(n))\n",
                 f"{profile_decode.ROOT}/pegaflow/connector/worker.py", "exec"), namespace)
    for _ in range(steps):
        namespace["schedule"]()
        for _ in range(4):
            namespace["wait_for_layer_load"](10)


def test_profile_rows_count_steps_and_name_functions_the_same_in_every_process():
    profiler = cProfile.Profile()
    profiler.enable()
    _fake_vllm_step_loop(7)
    profiler.disable()
    steps, rows = profile_decode.profile_rows(pstats.Stats(profiler))
    assert steps == 7
    by_name = {r["function"]: r for r in rows}
    assert by_name["vllm/v1/core/sched/scheduler.py:1(schedule)"]["calls"] == 7
    assert by_name["pegaflow/connector/worker.py:1(wait_for_layer_load)"]["calls"] == 28


def _phase(steps: int, **functions) -> dict:
    return {"steps": steps, "functions": [{"function": name, "calls": calls, "own_us": own, "cum_us": own}
                                          for name, (calls, own) in functions.items()]}


def test_compare_lists_what_a_connector_phase_adds_per_step():
    # 1. No connector: two phases of 10 steps; a connector phase of 20 steps that runs a
    #    shared function longer and one of its own 32 times a step.
    none = profile_decode.per_step([_phase(10, model=(10, 1000.0), sample=(10, 50.0)),
                                    _phase(10, model=(10, 1200.0), sample=(10, 50.0))])
    idle = profile_decode.per_step([_phase(20, model=(20, 2600.0), sample=(20, 100.0), hook=(640, 320.0))])
    report = profile_decode.compare(none, idle)
    # 2. Per step: model 130 us against none's median of 110; the hook 32 calls and 16 us.
    grown = {r["function"]: r for r in report["grown"]}
    assert abs(grown["model"]["extra_own_us_per_step"] - 20.0) < 1e-9
    assert abs(grown["sample"]["extra_own_us_per_step"]) < 1e-9
    assert report["only_here"] == [{"function": "hook", "calls_per_step": 32.0, "own_us_per_step": 16.0}]
    assert report["grown"][0]["function"] == "model" and abs(report["extra_own_us_per_step_total"] - 36.0) < 1e-9
    # 3. A function a repeat did not run counts as none there.
    mixed = profile_decode.per_step([_phase(10, hook=(10, 100.0)), _phase(10)])
    assert mixed["hook"]["own_us_per_step_each"] == [10.0, 0.0]
