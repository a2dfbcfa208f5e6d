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
from dataclasses import dataclass

from pegaflow.platform.errors import LayoutError


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
    """The dimension of ``num_blocks`` entries; on a tie, dim 0 (vLLM's per-layer views
    put blocks first) unless dim 0 could be a K/V plane, which is ambiguous and refused."""
    candidates = [d for d, size in enumerate(info.shape) if size == num_blocks]
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        raise LayoutError(f"{info.name}: shape {info.shape} has no dimension of {num_blocks} blocks")
    is_kv_plane = info.shape[0] == 2 and 1 in candidates
    if candidates[0] == 0 and not is_kv_plane:
        return 0
    raise LayoutError(f"{info.name}: shape {info.shape}: several dimensions have {num_blocks} "
                      f"entries; cannot tell which one is the block dimension")


def _split_page(info: TensorInfo, inner: list[int]) -> tuple[int, list[int]]:
    """(elements of one contiguous page, the inner dims left over as sub-layer dims).

    The page is the longest run of inner dims, from stride 1 up, that tile memory without
    gaps; the inner dims beyond it (e.g. heads in a BHLNC layout) split the layer."""
    page, rest = 1, []
    for d in sorted(inner, key=lambda d: info.strides[d]):
        if not rest and info.strides[d] == page:
            page *= info.shape[d]
        else:
            rest.append(d)
    if page == 1 and inner:
        raise LayoutError(f"{info.name}: shape {info.shape} strides {info.strides}: no dimension "
                          f"is contiguous (stride 1)")
    for d in rest:
        if info.strides[d] < page:
            raise LayoutError(
                f"{info.name}: shape {info.shape} strides {info.strides}: a block's elements "
                f"interleave (dimension {d} has stride {info.strides[d]} inside a "
                f"{page}-element run)")
    return page, rest


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
    page, split_inner = _split_page(info, inner)
    outer = [d for d in rest if info.strides[d] >= block_stride] + split_inner
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
