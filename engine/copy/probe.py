"""Timing the two copy paths on the real pool, for ``--copy-backend auto``.

Up to 64 MiB of random pool pages, in address order as the backend issues an op's
pages, are read into device scratch (LOAD), then the same bytes are written back (SAVE):
the pool's contents do not change, and the pool's own pinning and spread are what is
timed.  The caller drains its copies first.
"""

from __future__ import annotations

import numpy as np

from engine.copy.base import COPY_ENGINE, KERNEL, CopyOp, Direction
from pegaflow.cuda import driver

PROBE_BYTES = 64 << 20
PROBE_MAX_PAGES = 8192
PROBE_RUNS = 3


def measure_paths(dev, pool_bytes: int, page_bytes: int, copy, stage,
                  unstage) -> dict[Direction, tuple[float, float]]:
    """GB/s of (kernel, copy engine) each way on ``dev`` (a ``cuda_device.Device``);
    ``copy``, ``stage`` and ``unstage`` are the backend's (its ``_copy``, ``_stage`` and
    staging ring's ``free``).  Empty if the pool holds no page of this size."""
    num_pages = min(PROBE_MAX_PAGES, PROBE_BYTES // page_bytes, pool_bytes // page_bytes)
    if num_pages == 0:
        return {}
    driver.use_device(dev.device)
    rng = np.random.default_rng(0)
    slots = np.sort(rng.choice(pool_bytes // page_bytes, num_pages, replace=False))  # as ops
    op = CopyOp(-1, Direction.LOAD, -1, [], page_bytes, rng.permutation(num_pages),
                slots.astype(np.int64) * page_bytes)
    gpu = driver.device_alloc(num_pages * page_bytes)
    stream = driver.create_stream(low_priority=True)
    timers = (driver.create_event(timing=True), driver.create_event(timing=True))
    staging = stage(op)
    try:
        return {d: tuple(_time_copy(copy, dev, path, stream, op, gpu, d, staging, timers)
                         for path in (KERNEL, COPY_ENGINE))
                for d in (Direction.LOAD, Direction.SAVE)}  # LOAD first: it fills scratch
    finally:
        driver.synchronize_stream(stream)
        if staging is not None:
            unstage(staging)
        for event in timers:
            driver.destroy_event(event)
        driver.destroy_stream(stream)
        driver.device_free(gpu)


def _time_copy(copy, dev, path: str, stream, op: CopyOp, gpu: int, direction: Direction,
               staging: list | None, timers: tuple) -> float:
    if path == KERNEL and staging is None:
        return 0.0  # the kernel reads its page lists from the staging ring: none free
    args = (dev, path, stream, op, gpu, op.page_bytes, dev.pool_base,
            direction == Direction.SAVE, staging)
    copy(*args)  # warm-up
    driver.record(timers[0], stream)
    for _ in range(PROBE_RUNS):
        copy(*args)
    driver.record(timers[1], stream)
    driver.synchronize_event(timers[1])
    num_bytes = PROBE_RUNS * len(op.block_ids) * op.page_bytes
    return num_bytes / driver.elapsed_ms(*timers) / 1e6
