"""A timeline of one worker step that loads, logged at DEBUG by ``pegaflow.connector.trace``.

CPU marks (``time.perf_counter``) of the connector's calls, after the hook the step's loads
went out from (``handle_preemptions``, or ``start_load_kv`` where vLLM writes their blocks
while it prepares the step), and on CUDA events on vLLM's compute stream: where the loads
were submitted, where ``start_load_kv`` found it (loads sent earlier: how far ahead of it
they went out), where it had the first and last layer's pages (after their waits), and the
end of the forward.  The GPU intervals are read at the next step (by then the events have
completed), so tracing adds no synchronization.  Off (one boolean test per call) unless
DEBUG is enabled.

The scheduler side logs one line per step it plans (``log_schedule``): what vLLM scheduled
and what the connector planned, on the same monotonic clock, so a step that loads can be
placed among the decode steps around it.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)

GPU_MARKS = ("loads_submitted", "start_load_kv", "first_layer_ready", "last_layer_ready", "forward_done")


class StepTrace:
    def __init__(self) -> None:
        self.is_on = False
        self._cpu: list[tuple[str, float]] = []
        self._gpu: dict[str, object] = {}
        self._previous: tuple[list, dict, str] | None = None
        self._label = ""
        self._step = 0

    def begin(self, num_loads: int, num_blocks: int, hook: str = "start_load_kv") -> None:
        """A step with loads starts: ``hook`` is vLLM's call they go out from."""
        self.is_on = num_loads > 0 and logger.isEnabledFor(logging.DEBUG)
        if not self.is_on:
            return
        self._step += 1
        self._cpu, self._gpu = [(hook, time.perf_counter())], {}
        # time.monotonic is vLLM's clock for a request's scheduled_ts / first_token_ts
        self._label = (f"step {self._step}: {num_loads} load(s) of {num_blocks} blocks, "
                       f"{hook} at monotonic {time.monotonic():.6f}")

    def mark(self, name: str) -> None:
        if self.is_on:
            self._cpu.append((name, time.perf_counter()))

    def gpu_mark(self, name: str, stream: int) -> None:
        """Record (or record again: the latest record counts) a timing event on ``stream``,
        vLLM's compute stream."""
        if not self.is_on:
            return
        import torch
        try:
            event = self._gpu.get(name)
            if event is None:
                event = self._gpu[name] = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.ExternalStream(stream))
        except RuntimeError as exc:  # a diagnostic must never fail vLLM's step
            logger.warning("step timeline: CUDA marks off (%s)", exc)
            self.is_on, self._gpu = False, {}

    def layer_ready(self, stream: int) -> None:
        """The compute stream now waits for a layer's pages (after its wait)."""
        if self.is_on:
            if "first_layer_ready" not in self._gpu:
                self.gpu_mark("first_layer_ready", stream)
            self.gpu_mark("last_layer_ready", stream)

    def end(self) -> None:
        """The step's forward is over (get_finished): report the previous step, keep this one."""
        if not self.is_on:
            return
        self.mark("get_finished")
        self.flush()
        self._previous = (self._cpu, self._gpu, self._label)
        self.is_on = False

    def flush(self) -> None:
        if self._previous is None:
            return
        cpu, gpu, label = self._previous
        self._previous = None
        t0 = cpu[0][1]
        parts = [f"{name} +{(t - t0) * 1e3:.2f}" for name, t in cpu[1:]]
        first = gpu.get(GPU_MARKS[0])
        try:
            for name in GPU_MARKS[1:] if first is not None else ():
                if name in gpu:
                    gpu[name].synchronize()  # recorded a step ago: normally long complete
                    parts.append(f"gpu {name} +{first.elapsed_time(gpu[name]):.2f}")
        except RuntimeError as exc:
            parts.append(f"gpu marks unreadable ({exc})")
        logger.debug("%s (ms after %s): %s", label, cpu[0][0], ", ".join(parts))


def log_schedule(step: int, scheduler_output, meta) -> None:
    """One line per scheduler step (DEBUG): new and running requests, tokens, and the loads
    and saves ``meta`` (the step's ``PegaConnectorMetadata``) plans; nothing is counted
    unless DEBUG is on."""
    if not logger.isEnabledFor(logging.DEBUG):
        return
    logger.debug("sched step %d at monotonic %.6f: %d new, %d running, %d tokens, %d finished, "
                 "%d load(s) of %d blocks, %d blocks to save", step, time.monotonic(),
                 len(scheduler_output.scheduled_new_reqs), len(scheduler_output.scheduled_cached_reqs.req_ids),
                 getattr(scheduler_output, "total_num_scheduled_tokens", 0),
                 len(getattr(scheduler_output, "finished_req_ids", None) or ()),
                 len(meta.loads), sum(len(s.block_ids) for s in meta.loads),
                 sum(len(s.block_ids) for s in meta.saves))
