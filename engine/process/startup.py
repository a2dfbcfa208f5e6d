"""The engine's start, in the order it happens (``EngineServer.__init__``): the pool and
the copy backend over it, its first chunk pinned, the index (a kept pool's blocks taken
in); then the disk and remote tiers; then one log line of what it took."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pegaflow.platform.values import format_size

from ..blocks.index import BlockIndex
from ..copy import make_backend
from ..copy.base import CopyBackend
from ..disk.open import open_disk_tier
from ..memory.fault_in import default_threads
from ..memory.pinning import PoolPinner
from ..memory.pool import PagePool
from ..memory.pool_table import NoTable, PoolTable
from ..remote.open import open_remote_tier

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class OpenPool:
    """What ``open_pool`` built, in the order it built it."""

    pool: PagePool
    backend: CopyBackend
    pinner: PoolPinner
    index: BlockIndex


def open_pool(config, segments, backend: CopyBackend | None, marks: list[float]) -> OpenPool:
    """The pool, the copy backend over it, its first chunk pinned, and the index."""
    table = None  # only a kept pool needs its table (and a slab's entries capped by it)
    if config.keep_pool:
        segment = segments.pool_table
        table = PoolTable(segment.array(np.uint8, segment.size), config.usable_pool_bytes,
                          config.slab_bytes, keep=segments.is_pool_kept)
    pool = PagePool(config.usable_pool_bytes, config.slab_bytes,
                    table.records_per_slab if table else None, ready_bytes=0)
    backend = backend or make_backend(config.backend, config.copy_backend, config.device_staging_bytes,
                                      config.hold_saves, config.load_layer_groups)
    backend.open_pool(segments.pool)
    marks.append(time.perf_counter())
    pinner = PoolPinner(segments.pool, backend, config.pin_chunk, config.pin_threads or default_threads(),
                        config.pin_rate_bytes)
    pinner.pin_first()
    marks.append(time.perf_counter())
    index = BlockIndex(pool, config.lease_ttl_s, table if table is not None else NoTable())
    if segments.is_pool_kept:
        num_blocks = index.adopt_table()
        logger.info("took in %d blocks (%.1f MiB) from the pool an earlier engine kept%s",
                    num_blocks, pool.bytes_used / 2**20, "" if config.pin_chunk >= pool.bytes_total
                    else "; each is served once its part of the pool is pinned")
    return OpenPool(pool, backend, pinner, index)


def open_tiers(config, opened: OpenPool, segments, stats, wake: Callable[[], None],
               answer_remote: Callable) -> tuple:
    """The disk and remote tiers (each None where not configured): their paths checked and
    files taken in before serving.  ``answer_remote`` answers a LOOKUP the remote store continued."""
    disk = None
    try:
        disk = open_disk_tier(config, opened.index, segments.pool, stats, wake)
        remote = open_remote_tier(config, opened.index, segments.pool, stats, wake, answer_remote)
    except BaseException:
        if disk is not None:
            disk.close()
        opened.pinner.stop()
        opened.backend.close()
        segments.unlink_all()
        raise
    return disk, remote


def log_ready(config, backend: CopyBackend, pool: PagePool, marks: list[float]) -> None:
    if config.usable_pool_bytes < config.pool_bytes:
        logger.warning("--pool-size %s is not a whole number of %s slabs: %s allocated",
                       format_size(config.pool_bytes), format_size(config.slab_bytes),
                       format_size(config.usable_pool_bytes))
    steps = [b - a for a, b in zip(marks, marks[1:])]
    logger.info("engine %r ready: %s backend, pool %s (%d %s of %s; the largest block it "
                "stores is one slab; %s of it pinned so far), %d client slots; in %.2f s "
                "(shared memory %.2f s, backend %.2f s, first chunk %.2f s)", config.name,
                backend.name, format_size(config.usable_pool_bytes), pool.num_slabs,
                "slab" if pool.num_slabs == 1 else "slabs", format_size(config.slab_bytes),
                format_size(pool.bytes_ready), config.num_slots,
                time.perf_counter() - marks[0], *steps)
