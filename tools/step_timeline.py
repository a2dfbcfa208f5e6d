"""The connector's step timeline in a server's log: turned on, read back, summarized.

The worker side logs, at DEBUG on ``pegaflow.connector.trace``, one line per step that
loads (``pegaflow/connector/trace.py``): how many loads of how many blocks, the step's
start on ``time.monotonic`` (the clock every process of the host shares: where the loads
went out, ``handle_preemptions`` or ``start_load_kv``), and the marks after it in ms, CPU
and GPU (``start_load_kv +2.1``: the loads went out 2.1 ms before vLLM's ``start_load_kv``)::

    step 3: 4 load(s) of 2048 blocks, handle_preemptions at monotonic 812.5 (ms after
    handle_preemptions): loads_submitted +0.4, start_load_kv +2.1, ..., gpu start_load_kv +1.8,
    gpu last_layer_ready +84.1, gpu forward_done +90.2

and the scheduler side one line per step it plans (what vLLM scheduled, what the connector
planned), which places each loading step among the decode steps around it::

    sched step 109 at monotonic 812.4: 4 new, 0 running, 320 tokens, 0 finished, 4 load(s)
    of 2036 blocks, 20 blocks to save

``logging_config`` is a ``VLLM_LOGGING_CONFIG_PATH`` file that keeps vLLM's own logging and
sends those lines to a file of their own; ``parse`` and ``summarize`` read them back (no
GPU, unit-tested in CI).
"""

from __future__ import annotations

import re
from pathlib import Path

from tools.serving_workload import percentile

TRACE_LOGGER = "pegaflow.connector.trace"
_LINE = re.compile(r"step \d+: (\d+) load\(s\) of (\d+) blocks, (\w+) at monotonic "
                   r"([\d.]+) \(ms after \w+\): (.*)$")
_SCHED = re.compile(r"sched step (\d+) at monotonic ([\d.]+): (\d+) new, (\d+) running, (\d+) tokens, "
                    r"(\d+) finished, (\d+) load\(s\) of (\d+) blocks, (\d+) blocks to save")
_SCHED_KEYS = ("step", "at", "new", "running", "tokens", "finished", "loads", "load_blocks", "save_blocks")
_MARK = re.compile(r"(gpu )?(\w+) \+([\d.]+)")


def logging_config(trace_path: Path) -> dict:
    """vLLM's loggers at INFO on stderr, as by default, and the step timeline into ``trace_path``."""
    return {"version": 1, "disable_existing_loggers": False,
            "formatters": {"plain": {"format": "%(levelname)s %(asctime)s [%(name)s] %(message)s"}},
            "handlers": {"vllm": {"class": "logging.StreamHandler", "formatter": "plain",
                                  "level": "INFO", "stream": "ext://sys.stderr"},
                         "trace": {"class": "logging.FileHandler", "formatter": "plain",
                                   "level": "DEBUG", "filename": str(trace_path)}},
            "loggers": {"vllm": {"handlers": ["vllm"], "level": "INFO", "propagate": False},
                        TRACE_LOGGER: {"handlers": ["trace"], "level": "DEBUG", "propagate": False}}}


def parse(lines) -> list[dict]:
    """One dict per traced step: ``loads``, ``blocks``, ``start`` (monotonic s), ``sent_at``
    (the hook the loads went out from) and each mark in ms (GPU marks named ``gpu_<mark>``)."""
    steps = []
    for line in lines:
        if (m := _LINE.search(line)) is None:
            continue
        step = {"loads": int(m[1]), "blocks": int(m[2]), "sent_at": m[3], "start": float(m[4])}
        for mark in _MARK.finditer(m[5]):
            step[("gpu_" if mark[1] else "") + mark[2]] = float(mark[3])
        steps.append(step)
    return steps


def parse_schedule(lines) -> list[dict]:
    """One dict per scheduler step: ``step``, ``at`` (monotonic s), ``new``, ``running``,
    ``tokens``, ``finished``, ``loads``, ``load_blocks``, ``save_blocks``."""
    out = []
    for line in lines:
        if (m := _SCHED.search(line)) is not None:
            out.append({k: (float(v) if k == "at" else int(v)) for k, v in zip(_SCHED_KEYS, m.groups())})
    return out


def first_admission_ms(schedule: list[dict], since: float) -> float | None:
    """ms from ``since`` (monotonic s: a round's first request sent) to the first scheduler
    step after it that took a new request (None: no such step)."""
    admits = [s["at"] for s in schedule if s["new"] and s["at"] >= since]
    return round((min(admits) - since) * 1e3, 3) if admits else None


def summarize(steps: list[dict], start: float = float("-inf"), end: float = float("inf")) -> dict:
    """Of the steps that began in ``[start, end)``: how many, their loads and blocks, and
    p50/p90/max of every mark (ms after the step's loads went out), and how many steps sent
    them from each hook (``sent_at``)."""
    mine = [s for s in steps if start <= s["start"] < end]
    marks = sorted({k for s in mine for k in s} - {"loads", "blocks", "start", "sent_at"})
    out: dict = {"steps": len(mine), "loads": sum(s["loads"] for s in mine),
                 "blocks": sum(s["blocks"] for s in mine),
                 "sent_at": {hook: sum(s.get("sent_at") == hook for s in mine)
                             for hook in sorted({s.get("sent_at", "start_load_kv") for s in mine})}}
    for key in ("loads", "blocks"):
        values = [s[key] for s in mine]
        out[f"{key}_per_step_p50"] = percentile(values, 50)
        out[f"{key}_per_step_max"] = max(values, default=0)
    for mark in marks:
        values = [s[mark] for s in mine if mark in s]
        out[mark] = {"p50": round(percentile(values, 50), 3), "p90": round(percentile(values, 90), 3),
                     "max": round(max(values), 3)}
    return out
