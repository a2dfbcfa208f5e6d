"""The engine's start, in the order it happens (``EngineServer.__init__``): the pool and
the copy backend over it, its first chunk pinned, the index (a kept pool's blocks taken
in); then the disk and remote tiers; then one log line of what it took."""

from __future__ import annotations

import logging
import time

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


def open_pool(server, backend: CopyBackend | None, marks: list[float]) -> PagePool:
    """The pool, the copy backend over it, its first chunk pinned, and the index."""
    config = server.config
    table = None  # only a kept pool needs its table (and a slab's entries capped by it)
    if config.keep_pool:
        segment = server.segments.pool_table
        table = PoolTable(segment.array(np.uint8, segment.size), config.usable_pool_bytes,
                          config.slab_bytes, keep=server.segments.is_pool_kept)
    pool = PagePool(config.usable_pool_bytes, config.slab_bytes,
                    table.records_per_slab if table else None, ready_bytes=0)
    server.backend = backend or make_backend(config.backend, config.copy_backend,
                                           config.device_staging_bytes, config.hold_saves,
                                           config.load_layer_groups)
    server.backend.open_pool(server.segments.pool)
    marks.append(time.perf_counter())
    server.pinner = PoolPinner(server.segments.pool, server.backend, config.pin_chunk,
                             config.pin_threads or default_threads(), config.pin_rate_bytes)
    server.pinner.pin_first()
    marks.append(time.perf_counter())
    server.index = BlockIndex(pool, config.lease_ttl_s, table if table is not None else NoTable())
    if server.segments.is_pool_kept:
        num_blocks = server.index.adopt_table()
        logger.info("took in %d blocks (%.1f MiB) from the pool an earlier engine kept%s",
                    num_blocks, pool.bytes_used / 2**20, "" if config.pin_chunk >= pool.bytes_total
                    else "; each is served once its part of the pool is pinned")
    return pool


def open_tiers(server) -> None:
    """The disk and remote tiers: their paths checked and files taken in before serving."""
    config = server.config
    server.disk = server.remote = None
    try:
        server.disk = open_disk_tier(config, server.index, server.segments.pool, server.stats,
                                   server.doorbell.ring)
        server.remote = open_remote_tier(config, server.index, server.segments.pool, server.stats,
                                       server.doorbell.ring)
    except BaseException:
        if server.disk is not None:
            server.disk.close()
        server.pinner.stop()
        server.backend.close()
        server.segments.unlink_all()
        raise
    server.dispatcher.disk = server.disk
    server.dispatcher.remote = server.remote
    if server.remote is not None:
        server.remote.lookups.answer = server.dispatcher.lookups.answer_remote


def log_ready(server, pool: PagePool, marks: list[float]) -> None:
    config = server.config
    if config.usable_pool_bytes < config.pool_bytes:
        logger.warning("--pool-size %s is not a whole number of %s slabs: %s allocated",
                       format_size(config.pool_bytes), format_size(config.slab_bytes),
                       format_size(config.usable_pool_bytes))
    steps = [b - a for a, b in zip(marks, marks[1:])]
    logger.info("engine %r ready: %s backend, pool %s (%d %s of %s; the largest block it "
                "stores is one slab; %s of it pinned so far), %d client slots; in %.2f s "
                "(shared memory %.2f s, backend %.2f s, first chunk %.2f s)", config.name,
                server.backend.name, format_size(config.usable_pool_bytes), pool.num_slabs,
                "slab" if pool.num_slabs == 1 else "slabs", format_size(config.slab_bytes),
                format_size(pool.bytes_ready), config.num_slots,
                time.perf_counter() - marks[0], *steps)
