"""Which copy path an op takes on the CUDA backend: policy only (``cuda.py`` measures and
issues; this decides).

- ``staged`` wherever it can be (``staged.can_stage``, aligned for the gather kernel, under
  ``auto`` only for pages up to ``staged.AUTO_MAX_PAGE_BYTES``), a fenced LOAD (the client
  waits on our events layer by layer) included: its layers all land with the last
  sub-chunk, copied by DMA instead of by SMs shared with vLLM's kernels (faster than the
  kernel layer by layer for warm prompts: docs/benchmarks.md, "Copy path of the layer-wise
  loads");
- else a fenced LOAD takes the kernel: it issues a layer in one launch, where the copy
  engine takes a descriptor per page;
- else what ``auto`` measured for the op's page size and direction (``path_from_rates``),
  the copy engine where nothing was measured (it takes no SMs from vLLM);
- the kernel only where every address, stride and size suits its 16-byte words.
"""

from __future__ import annotations

import numpy as np

from . import staged
from .base import AUTO, COPY_ENGINE, KERNEL, STAGED, CopyOp, Direction
from .checks import Region
from .kernels import is_aligned

# The copy engine wins where it reaches this share of the kernel's measured rate: loads
# wait on the critical path (the faster one, nearly); saves overlap vLLM's compute, whose
# SMs the kernel would take (the copy engine unless it is below half the kernel's rate).
COPY_ENGINE_MARGIN = {Direction.LOAD: 0.97, Direction.SAVE: 0.5}


def op_path(configured: str, dev, op: CopyOp, regions: list[Region]) -> str:
    """The path of ``op`` on device ``dev`` (its ``staging``, ``pool_base`` and measured
    ``paths``) under ``--copy-backend configured``."""
    path = configured
    if (path == STAGED or path == AUTO and op.page_bytes <= staged.AUTO_MAX_PAGE_BYTES) and \
            dev.staging is not None and staged.can_stage(op, dev.staging.buffer_bytes, allow_fenced=True) and \
            is_aligned_op(dev, op, regions):
        return STAGED
    if path == STAGED:
        path = AUTO  # what cannot be staged goes as under auto (not measured: the copy engine)
    if path == AUTO and op.record_events is not None:
        path = KERNEL  # issued in one launch per layer: the client's wait starts sooner
    if path == AUTO:
        path = dev.paths.get((op.page_bytes, op.direction), COPY_ENGINE)
    if path == KERNEL and not is_aligned_op(dev, op, regions):
        return COPY_ENGINE
    return path


def is_aligned_op(dev, op: CopyOp, regions: list[Region]) -> bool:
    """Whether the kernel can move ``op``: every address, stride and size a multiple of 16."""
    values = [op.page_bytes, dev.pool_base, int(np.bitwise_or.reduce(op.entry_offsets))]
    for layer, region in zip(op.layers, regions):
        values += [region.base + layer.offset_bytes, layer.block_stride_bytes]
    return is_aligned(*values)


def path_from_rates(direction: Direction, kernel_gbps: float, dma_gbps: float) -> str:
    return COPY_ENGINE if dma_gbps >= COPY_ENGINE_MARGIN[direction] * kernel_gbps else KERNEL
