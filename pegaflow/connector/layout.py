"""From a KV cache tensor's shape and strides to pages the engine can copy.

vLLM hands ``register_kv_caches`` one view per layer whose physical order depends on
the attention backend and ``KVCacheLayout`` (LBNHC, LBHNC, BLHNC, ...; MLA has one head).
Nothing is assumed about the shape: the block dimension is the one of ``num_blocks``
entries; the dimensions whose stride is below the block stride must tile one contiguous
run (the page); a dimension whose stride is above it (e.g. a separate K/V plane) splits
the layer into several sub-layers, each with its own contiguous pages.  The engine sees
every sub-layer as a layer of its own.  What cannot be described so is refused with a
``LayoutError`` naming the tensor.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from pegaflow.errors import LayoutError


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """What layout derivation needs of a tensor (no torch here, so CI can test every layout)."""

    name: str
    data_ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    element_size: int


@dataclass(frozen=True, slots=True)
class SubLayer:
    """Pages of ``page_bytes`` at ``data_ptr + offset_bytes + block * block_stride_bytes``."""

    offset_bytes: int
    block_stride_bytes: int
    page_bytes: int


def _block_dim(info: TensorInfo, num_blocks: int) -> int:
    candidates = [d for d, size in enumerate(info.shape) if size == num_blocks]
    if not candidates:
        raise LayoutError(f"{info.name}: shape {info.shape} has no dimension of {num_blocks} blocks")
    return max(candidates, key=lambda d: info.strides[d])


def _page_elements(info: TensorInfo, inner: list[int]) -> int:
    """Elements of one page if ``inner`` dims tile a contiguous run, else LayoutError."""
    expected = 1
    for d in sorted(inner, key=lambda d: info.strides[d]):
        if info.strides[d] != expected:
            raise LayoutError(
                f"{info.name}: shape {info.shape} strides {info.strides}: a block's elements are "
                f"not one contiguous run (dimension {d} has stride {info.strides[d]}, "
                f"expected {expected})")
        expected *= info.shape[d]
    return expected


def derive_sublayers(info: TensorInfo, num_blocks: int) -> list[SubLayer]:
    """The sub-layers of one layer's KV tensor, in a stable order."""
    if len(info.shape) != len(info.strides) or info.element_size <= 0:
        raise LayoutError(f"{info.name}: malformed tensor description")
    if any(s < 0 for s in info.strides):
        raise LayoutError(f"{info.name}: negative strides are not supported")
    block = _block_dim(info, num_blocks)
    rest = [d for d in range(len(info.shape)) if d != block and info.shape[d] > 1]
    block_stride = info.strides[block]
    inner = [d for d in rest if info.strides[d] < block_stride]
    outer = [d for d in rest if info.strides[d] >= block_stride]
    page = _page_elements(info, inner)
    if page > block_stride and num_blocks > 1:
        raise LayoutError(f"{info.name}: pages of {page} elements overlap (block stride {block_stride})")
    sublayers = []
    for index in itertools.product(*(range(info.shape[d]) for d in outer)):
        offset = sum(i * info.strides[d] for i, d in zip(index, outer))
        sublayers.append(SubLayer(offset * info.element_size, block_stride * info.element_size,
                                  page * info.element_size))
    return sublayers


def alias_key(info: TensorInfo) -> tuple:
    """Layers with the same key are one memory (aliased layers): register them once."""
    return (info.data_ptr, info.shape, info.strides, info.element_size)


def span_bytes(info: TensorInfo) -> int:
    """Bytes from ``data_ptr`` to the end of the last element."""
    if any(size == 0 for size in info.shape):
        return 0
    last = sum((size - 1) * stride for size, stride in zip(info.shape, info.strides))
    return (last + 1) * info.element_size


def describe(info: TensorInfo) -> str:
    return f"{info.name} shape={info.shape} strides={info.strides} x{info.element_size}B"


def num_elements(info: TensorInfo) -> int:
    return math.prod(info.shape)
