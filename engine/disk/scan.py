"""A disk tier's files taken in at start: every block file under each path indexed (the
LRU rebuilt in write order from their mtimes), leftovers and a second copy of a block
removed, and each path shrunk to its size."""

from __future__ import annotations

import logging

from . import blockfile

logger = logging.getLogger(__name__)


def scan(store) -> int:
    """``DiskStore.scan``, into its emptied index: the number of blocks indexed."""
    found: list[tuple[blockfile.FoundBlock, int]] = []
    num_leftovers = [0] * len(store._paths)
    for path_index, path in enumerate(store._paths):
        blocks, leftovers = blockfile.list_blocks(path)
        found.extend((block, path_index) for block in blocks)
        num_leftovers[path_index] = sum(store._unlink(leftover) for leftover in leftovers)
    found.sort(key=lambda item: item[0].mtime_ns)
    for block, path_index in found:
        if block.key in store._blocks:  # the same block on two paths: keep the older
            num_leftovers[path_index] += store._unlink(store._path_of(path_index, block.key))
            continue
        store.take_in(block, path_index)
    for path_index, path in enumerate(store._paths):
        num_evicted = store._shrink(path_index)
        num_kept = sum(block.path_index == path_index for block in store._blocks.values())
        logger.info("disk tier %s: %d blocks (%d of %d bytes) taken in, %d leftover files removed, "
                    "%d blocks evicted to fit", path, num_kept, store._used_bytes[path_index],
                    store._size_bytes, num_leftovers[path_index], num_evicted)
    return len(store._blocks)
