"""Timing the two copy paths on the real pool, for ``--copy-backend auto``, and the path
each page size takes from it (``choose_path``, at a registration of a new page size).

Up to 64 MiB of random pool pages, in address order as the backend issues an op's
pages, are read into device scratch (LOAD), then the same bytes are written back (SAVE):
the pool's contents do not change, and the pool's own pinning and spread are what is
timed.  The caller drains its copies first.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from pegaflow.platform.cuda import driver
from pegaflow.platform.errors import CudaError

from .base import COPY_ENGINE, KERNEL, CopyOp, Direction
from .paths import path_from_rates

logger = logging.getLogger(__name__)

PROBE_BYTES = 64 << 20
PROBE_MAX_PAGES = 8192
PROBE_RUNS = 3
PROBE_DRAIN_S = 0.1  # copies in flight before auto's measurement (a REGISTER waits for it)


def choose_path(dev, page_bytes: int, pool_bytes: int, inflight: list, copy, stage, unstage,
                probes: list) -> None:
    """Set ``dev.paths`` for ``page_bytes`` both ways, measured on the pool's first
    ``pool_bytes`` (pinned pages only) once the backend's copies ``inflight`` have ended;
    each choice is appended to ``probes``.  ``copy``, ``stage``, ``unstage``: as for
    ``measure_paths``."""
    if (page_bytes, Direction.SAVE) in dev.paths:
        return
    if page_bytes % 16:
        for direction in Direction:
            dev.paths[(page_bytes, direction)] = COPY_ENGINE
        return
    # The probe's copies must not share the bus with real ones; copies that do not end
    # (they wait on a client's stuck GPU work) must not stall the engine either: such a
    # page size takes the copy engine until a registration finds nothing in flight.
    if page_bytes in dev.unmeasured and inflight:
        return
    if pool_bytes >= page_bytes and not drain_all(inflight, PROBE_DRAIN_S):
        if page_bytes not in dev.unmeasured:
            logger.warning("auto: %d copies still running after %.1f s; %d-byte pages take "
                           "the copy engine until a registration finds none in flight",
                           len(inflight), PROBE_DRAIN_S, page_bytes)
        dev.unmeasured.add(page_bytes)
        return
    dev.unmeasured.discard(page_bytes)
    for direction, (kernel_gbps, dma_gbps) in measure_paths(dev, pool_bytes, page_bytes, copy, stage,
                                                            unstage).items():
        path = path_from_rates(direction, kernel_gbps, dma_gbps)
        dev.paths[(page_bytes, direction)] = path
        probes.append({"device": dev.device, "page_bytes": page_bytes, "direction": direction.name,
                       "kernel_gbps": kernel_gbps, "copy_engine_gbps": dma_gbps, "path": path})
        logger.info("auto: %d-byte pages %s: kernel %.1f GB/s, copy engine %.1f GB/s -> %s",
                    page_bytes, direction.name, kernel_gbps, dma_gbps, path)


def drain_all(inflight: list, wait_s: float) -> bool:
    """Whether every copy in ``inflight`` (``cuda_layers.Inflight``) ended within ``wait_s``
    (polled, never blocking)."""
    deadline = time.monotonic() + wait_s
    try:
        for f in inflight:
            driver.use_device(f.device)
            while not driver.event_done(f.done):
                if time.monotonic() >= deadline:
                    return False
                time.sleep(1e-4)
    except CudaError as exc:  # the failed copy is reported by the next poll
        logger.warning("auto: a copy in flight failed (%s); not measuring now", exc)
        return False
    return True


def measure_paths(dev, pool_bytes: int, page_bytes: int, copy, stage,
                  unstage) -> dict[Direction, tuple[float, float]]:
    """GB/s of (kernel, copy engine) each way on ``dev`` (a ``cuda_device.Device``);
    ``copy``, ``stage`` and ``unstage`` are the backend's (its ``LayerCopier``'s ``copy_layer``
    and ``stage_ids``, and its staging ring's ``free``).  Empty if the pool
    holds no page of this size."""
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
