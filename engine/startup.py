"""The engine's start, in the order it happens (``EngineServer.__init__``): the pool and
the copy backend over it, its first chunk pinned, the index (a kept pool's blocks taken
in); then the disk and remote tiers; then one log line of what it took."""

from __future__ import annotations

import logging
import time

import numpy as np

from pegaflow.platform.errors import CudaError
from pegaflow.platform.ring import ring_segment_bytes
from pegaflow.platform.values import format_size

from . import copy
from .config import EngineConfig
from .copy.base import CopyBackend
from .disk.open import open_disk_tier
from .fault_in import default_threads
from .index import BlockIndex
from .pinning import PoolPinner
from .pool import PagePool, slab_advice
from .pool_table import NoTable, PoolTable
from .remote.open import open_remote_tier

logger = logging.getLogger(__name__)

# Below the KV block (every layer of 16 tokens) of the smallest models vLLM serves: Qwen2.5-0.5B's
# is 192 KiB in bf16 (24 layers x 2 heads x 64 dims x K and V), 48 KiB a rank at TP 2 in fp8.
SMALLEST_MODEL_BLOCK_BYTES = 32 << 10


def backend_kind(config: EngineConfig) -> str:
    """``--backend`` resolved: ``auto`` is cuda where a GPU is usable, else host with a
    WARNING saying why; ``cuda`` without a usable GPU refuses to start."""
    if config.backend == "host":
        return "host"
    why = copy.cuda_unusable_reason()
    if why is None:
        return "cuda"
    if config.backend == "cuda":
        raise CudaError(f"--backend cuda, but no GPU is usable here: {why}; give the engine the "
                        f"GPUs (in a container: --gpus all, or the NVIDIA runtime), or start it with "
                        f"--backend host (no vLLM on a GPU can use that one)")
    logger.warning("--backend auto: no usable GPU here, so the engine copies with the CPU (the host "
                   "backend): a vLLM on a GPU cannot register its KV cache with it and serves "
                   "without the cache; give the engine the GPUs (in a container: --gpus all, or the "
                   "NVIDIA runtime), or say --backend host to mean it. Why: %s", why)
    return "host"


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
    server.backend = backend or copy.make_backend(backend_kind(config), config.copy_backend,
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


def warn_pool_geometry(config: EngineConfig) -> None:
    """A pool whose slab (the largest block it stores) no model's block fits, and a pool
    that is not a whole number of slabs."""
    if config.slab_bytes < SMALLEST_MODEL_BLOCK_BYTES:
        logger.warning("the largest block this pool stores is %s (one slab), smaller than a vLLM "
                       "KV block (every layer of 16 tokens: 192 KiB for Qwen2.5-0.5B, 2 MiB for "
                       "Llama-3.1-8B in bf16): every vLLM's REGISTER will be refused; %s",
                       format_size(config.slab_bytes),
                       slab_advice(config.pool_bytes // config.slab_bytes))
    if config.usable_pool_bytes < config.pool_bytes:
        logger.warning("--pool-size %s is not a whole number of %s slabs: %s allocated",
                       format_size(config.pool_bytes), format_size(config.slab_bytes),
                       format_size(config.usable_pool_bytes))


def log_shm_use(server) -> None:
    """One line of what the engine holds in /dev/shm: the pool, the client rings, the rest."""
    config, segments = server.config, server.segments
    ring_bytes = ring_segment_bytes(config.ring_slots, config.arena_bytes)
    rings = config.num_slots * ring_bytes
    rest = segments.control.size + segments.stats.size + (
        segments.pool_table.size if segments.pool_table is not None else 0)
    logger.info("/dev/shm: %s for engine %r: pool %s, %d client rings of %s (%s; --max-clients, "
                "--arena-size), %s %s", format_size(segments.pool.size + rings + rest),
                config.name, format_size(segments.pool.size), config.num_slots,
                format_size(ring_bytes), format_size(rings), "control, stats and pool table"
                if segments.pool_table is not None else "control and stats", format_size(rest))


def log_ready(server, pool: PagePool, marks: list[float]) -> None:
    config = server.config
    warn_pool_geometry(config)
    log_shm_use(server)
    steps = [b - a for a, b in zip(marks, marks[1:])]
    logger.info("engine %r ready: %s backend, pool %s (%d %s of %s; the largest block it "
                "stores is one slab; %s of it pinned so far), %d client slots; in %.2f s "
                "(shared memory %.2f s, backend %.2f s, first chunk %.2f s)", config.name,
                server.backend.name, format_size(config.usable_pool_bytes), pool.num_slabs,
                "slab" if pool.num_slabs == 1 else "slabs", format_size(config.slab_bytes),
                format_size(pool.bytes_ready), config.num_slots,
                time.perf_counter() - marks[0], *steps)
