"""The remote tier as an engine configures it (or None under ``--remote off``): the store
set up, the pool registered with it once, the threads started, the tier wired to the index."""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from pegaflow.platform.values import format_size

logger = logging.getLogger(__name__)


def open_remote_tier(config, index, pool_segment, stats, wake: Callable[[], None], answer: Callable, store=None):
    """``answer``: how a LOOKUP the store continued is answered (the dispatcher's);
    ``store``: a stand-in for the Mooncake client (tests); else one set up from ``config``."""
    if config.remote == "off" and store is None:
        return None
    from .store import MooncakeStore
    from .tier import RemoteTier
    from .workers import RemoteWorkers
    store = store if store is not None else MooncakeStore(config)
    pool = pool_segment.array(np.uint8, pool_segment.size)
    store.register(pool.ctypes.data, pool.nbytes)  # once: puts and fetches use the pool's pages in place
    workers = RemoteWorkers(store, pool, wake)
    tier = RemoteTier(store, workers, index, stats, answer, config.remote_publish, config.remote_timeout_s)
    logger.info("remote tier: mooncake store at %s (metadata %s, %s), this engine at %s contributes %s; "
                "publishing %s blocks", config.remote_master, config.remote_metadata, config.remote_protocol,
                getattr(store, "host", "?"), format_size(config.remote_segment_bytes), config.remote_publish)
    return tier
