"""pegaflow.connector.layout: every vLLM KV cache layout becomes pages that hold exactly one block.

Each check writes a distinct value into every element of every (layer, block) through the
tensor's logical indices, then reads the raw bytes at ``data_ptr + offset_bytes + block *
block_stride_bytes`` for ``page_bytes`` of every derived sub-layer.  Because no value repeats
anywhere in the buffer (and unused bytes stay zero), "the pages of block b hold exactly the
values written into block b" proves that they hold all of that block's elements and nothing of
another block, another layer or padding.

The per-layer views are built twice: by vLLM 0.33 itself (``get_kv_cache_config_from_groups`` +
``allocate_kv_cache``) and by hand with ``torch.as_strided``, so a change in either is noticed.
"""

from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest
import torch

from pegaflow.connector.layout import TensorInfo, alias_key, derive_sublayers, span_bytes
from pegaflow.platform.errors import LayoutError

# vLLM 0.33 ``KVCacheLayout``: physical order of the logical [L, B, H, N, C] axes.  Copied so
# the hand-built views need no vLLM internals; the first test keeps the copy honest.
LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
NUM_LAYERS = 3
NUM_BLOCKS = 5
BLOCK_SIZE = 4
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_INT_OF_SIZE = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def info_of(name: str, tensor: torch.Tensor) -> TensorInfo:
    """What the connector's worker builds from each tensor of ``register_kv_caches``."""
    return TensorInfo(name, tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()),
                      tensor.element_size())


def hand_built_layers(order: tuple[int, ...], num_heads: int, content: int,
                      dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Per-layer [B, H, N, C] views of one buffer whose physical axis order is ``order``."""
    shape = (NUM_LAYERS, NUM_BLOCKS, num_heads, BLOCK_SIZE, content)
    strides = [0] * 5
    running = 1
    for dim in reversed(order):
        strides[dim] = running
        running *= shape[dim]
    buffer = torch.zeros(running, dtype=dtype)
    view = torch.as_strided(buffer, shape, strides)
    return {f"model.layers.{i}.self_attn.attn": view[i] for i in range(NUM_LAYERS)}


def fill_unique(tensors: dict[str, torch.Tensor], block_dim: int) -> dict[tuple[str, int], np.ndarray]:
    """Write a value used nowhere else into every element of every (layer, block).

    Returns, per (layer name, block), the sorted values written there.
    """
    written, next_value = {}, 1
    for name, tensor in tensors.items():
        as_int = tensor.view(_INT_OF_SIZE[tensor.element_size()])
        for block in range(tensor.shape[block_dim]):
            target = as_int.select(block_dim, block)
            values = torch.arange(next_value, next_value + target.numel(), dtype=torch.int64)
            next_value += target.numel()
            assert next_value <= torch.iinfo(as_int.dtype).max, "test shapes too large for unique values"
            target.copy_(values.reshape(target.shape))
            written[(name, block)] = values.numpy()
    return written


def page_values(tensor: torch.Tensor, info: TensorInfo, subs, block: int) -> np.ndarray:
    """Sorted element values found in the derived pages of ``block`` (raw bytes, all sub-layers)."""
    storage = tensor.untyped_storage()
    storage_start, storage_end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    chunks = []
    for sub in subs:
        address = info.data_ptr + sub.offset_bytes + block * sub.block_stride_bytes
        # A page outside the allocation would be a wild copy: check before reading it.
        assert storage_start <= address and address + sub.page_bytes <= storage_end, (
            f"{info.name} block {block}: page [{address}, +{sub.page_bytes}) outside the storage")
        raw = ctypes.string_at(address, sub.page_bytes)
        chunks.append(np.frombuffer(raw, dtype=_NP_INT_OF_SIZE[info.element_size]))
    return np.sort(np.concatenate(chunks)).astype(np.int64)


def assert_pages_hold_exactly_each_block(tensors: dict[str, torch.Tensor], num_blocks: int,
                                         block_dim: int = 0) -> dict[str, list]:
    """For every layer and block: the derived pages hold that block's values, all and only."""
    written = fill_unique(tensors, block_dim)
    derived = {}
    for name, tensor in tensors.items():
        info = info_of(name, tensor)
        subs = derive_sublayers(info, num_blocks)
        derived[name] = subs
        for block in range(num_blocks):
            np.testing.assert_array_equal(
                page_values(tensor, info, subs, block), written[(name, block)],
                err_msg=f"{name} block {block}: pages {subs}")
    return derived


# -- vLLM's own views ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_views():
    """``vllm_views(layout_name, spec)``: per-layer views and KVCacheConfig as vLLM 0.33 builds them."""
    from vllm.config import CacheConfig, DeviceConfig, VllmConfig
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec
    from vllm.v1.worker.utils import allocate_kv_cache

    vllm_config = VllmConfig(cache_config=CacheConfig(block_size=BLOCK_SIZE),
                             device_config=DeviceConfig("cpu"))

    def build(layout_name: str, spec):
        vllm_config.cache_config.kv_cache_layout = layout_name  # normally resolved by the engine core
        layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
        groups = [KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)], spec)]
        kv_cache_config = get_kv_cache_config_from_groups(
            vllm_config, groups, available_memory=spec.page_size_bytes * NUM_LAYERS * NUM_BLOCKS)
        assert kv_cache_config.num_blocks == NUM_BLOCKS
        return allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout), kv_cache_config

    return build


def _full_attention_spec(num_kv_heads: int = 2, head_size: int = 8):
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    return FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=num_kv_heads, head_size=head_size,
                             dtype=torch.bfloat16)


def _mla_spec():
    from vllm.v1.kv_cache_interface import MLAAttentionSpec
    return MLAAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=12, dtype=torch.bfloat16)


@pytest.mark.vllm
def test_layout_table_matches_vllm_kv_cache_layout_enum():
    from vllm.v1.kv_cache_layout import KVCacheLayout

    # 1. The hand-built views below cover every layout vLLM can resolve, no more, no less.
    assert {member.name: member.value for member in KVCacheLayout} == LAYOUTS


@pytest.mark.vllm
@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@pytest.mark.parametrize("spec_kind", ["full_attention", "mla"])
def test_derive_sublayers_vllm_allocated_views_pages_hold_exactly_each_block(vllm_views, layout_name,
                                                                           spec_kind):
    spec = _full_attention_spec() if spec_kind == "full_attention" else _mla_spec()
    # 1. vLLM allocates one buffer and hands out one as_strided [B, H, N, C] view per layer.
    tensors, kv_cache_config = vllm_views(layout_name, spec)
    assert len(tensors) == NUM_LAYERS
    # 2. Every derived page of every layer holds exactly its block's elements.
    derived = assert_pages_hold_exactly_each_block(tensors, kv_cache_config.num_blocks)
    # 3. A layer's sub-layer pages add up to vLLM's own page size, all pages being equal.
    for subs in derived.values():
        assert sum(sub.page_bytes for sub in subs) == spec.page_size_bytes
        assert len({sub.page_bytes for sub in subs}) == 1


@pytest.mark.vllm
def test_derive_sublayers_vllm_default_layout_one_page_per_block_at_vllm_block_stride(vllm_views):
    # 1. LBNHC (vLLM's default): each layer is one sub-layer whose block stride is vLLM's.
    tensors, kv_cache_config = vllm_views("LBNHC", _full_attention_spec())
    (kv_tensor,) = kv_cache_config.kv_cache_tensors
    for name, tensor in tensors.items():
        (sub,) = derive_sublayers(info_of(name, tensor), NUM_BLOCKS)
        # 2. The page is the whole block and starts at the view's first byte.
        assert (sub.offset_bytes, sub.block_stride_bytes, sub.page_bytes) == (
            0, kv_tensor.block_stride, _full_attention_spec().page_size_bytes)


@pytest.mark.vllm
def test_derive_sublayers_vllm_head_major_layout_splits_each_layer_per_head(vllm_views):
    # 1. LHBNC puts heads outside blocks: each head of each layer is a sub-layer of its own.
    tensors, _ = vllm_views("LHBNC", _full_attention_spec(num_kv_heads=2))
    for name, tensor in tensors.items():
        subs = derive_sublayers(info_of(name, tensor), NUM_BLOCKS)
        # 2. Two sub-layers, one head's plane apart, each page one head's [N, C] of a block.
        head_plane_bytes = NUM_BLOCKS * BLOCK_SIZE * 16 * 2
        assert [sub.offset_bytes for sub in subs] == [0, head_plane_bytes]
        assert {sub.page_bytes for sub in subs} == {BLOCK_SIZE * 16 * 2}


# -- hand-built views ------------------------------------------------------------------------

# (num_heads, content, dtype): FlashAttention-like (C = 2 * head_size), MLA (one head), fp32, fp8-like.
_GEOMETRIES = {
    "fa_bf16": (2, 16, torch.bfloat16),
    "mla_bf16": (1, 12, torch.bfloat16),
    "fa_fp32": (4, 6, torch.float32),
    "fa_1byte": (2, 1, torch.uint8),
}


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@pytest.mark.parametrize("geometry", sorted(_GEOMETRIES))
def test_derive_sublayers_hand_built_layout_pages_hold_exactly_each_block(layout_name, geometry):
    num_heads, content, dtype = _GEOMETRIES[geometry]
    # 1. One buffer, three layers, physical axis order of the layout.
    tensors = hand_built_layers(LAYOUTS[layout_name], num_heads, content, dtype)
    # 2. Every derived page of every layer holds exactly its block's elements.
    assert_pages_hold_exactly_each_block(tensors, NUM_BLOCKS)


@pytest.mark.parametrize("shape", [(NUM_BLOCKS, BLOCK_SIZE, 24), (NUM_BLOCKS, 1, BLOCK_SIZE, 24)])
def test_derive_sublayers_mla_shapes_one_sublayer_of_whole_blocks(shape):
    # 1. MLA caches: [num_blocks, block_size, head] or [num_blocks, 1, block_size, head], contiguous.
    tensors = {f"mla.{i}": torch.zeros(shape, dtype=torch.bfloat16) for i in range(2)}
    derived = assert_pages_hold_exactly_each_block(tensors, NUM_BLOCKS)
    # 2. One sub-layer per layer; its pages are whole blocks laid end to end.
    page_bytes = BLOCK_SIZE * 24 * 2
    for subs in derived.values():
        assert [(s.offset_bytes, s.block_stride_bytes, s.page_bytes) for s in subs] == [
            (0, page_bytes, page_bytes)]


def test_derive_sublayers_kv_split_plane_gives_two_sublayers():
    # 1. [2, num_blocks, block_size, num_heads, head_size]: K plane, then V plane.
    heads, head_size = 2, 8
    tensors = {f"kv.{i}": torch.zeros((2, NUM_BLOCKS, BLOCK_SIZE, heads, head_size), dtype=torch.float16)
               for i in range(2)}
    # 2. Block b's K and V pages together hold exactly block b's elements.
    derived = assert_pages_hold_exactly_each_block(tensors, NUM_BLOCKS, block_dim=1)
    # 3. Two sub-layers: K at 0, V one plane further; each page one block of one plane.
    page_bytes = BLOCK_SIZE * heads * head_size * 2
    for subs in derived.values():
        assert [(s.offset_bytes, s.block_stride_bytes, s.page_bytes) for s in subs] == [
            (0, page_bytes, page_bytes), (NUM_BLOCKS * page_bytes, page_bytes, page_bytes)]


def test_derive_sublayers_kv_inside_block_one_sublayer():
    # 1. [num_blocks, 2, block_size, num_heads, head_size] (FlashInfer): K and V inside each block.
    tensors = {"kv": torch.zeros((NUM_BLOCKS, 2, BLOCK_SIZE, 2, 8), dtype=torch.float16)}
    derived = assert_pages_hold_exactly_each_block(tensors, NUM_BLOCKS)
    # 2. One page holds the whole block, K and V.
    assert [s.page_bytes for s in derived["kv"]] == [2 * BLOCK_SIZE * 2 * 8 * 2]


def test_derive_sublayers_transposed_view_interleaving_blocks_splits_into_sublayers():
    # 1. A [block_size, num_blocks, content] buffer seen as [num_blocks, block_size, content]:
    #    each token row of a block sits in another stretch of memory.
    base = torch.zeros((BLOCK_SIZE, NUM_BLOCKS, 8), dtype=torch.int16)
    tensors = {"interleaved": base.transpose(0, 1)}
    # 2. It is described as one sub-layer per token row, each page one row of one block.
    derived = assert_pages_hold_exactly_each_block(tensors, NUM_BLOCKS)
    assert len(derived["interleaved"]) == BLOCK_SIZE
    assert {s.page_bytes for s in derived["interleaved"]} == {8 * 2}


# -- what cannot be described ----------------------------------------------------------------


def _fa_layer(name: str = "model.layers.7.self_attn.attn") -> tuple[str, torch.Tensor]:
    """A FlashAttention LBNHC layer view [B, H, N, 2*head_size] (physically [B, N, H, 2*head_size])."""
    return name, torch.zeros((NUM_BLOCKS, BLOCK_SIZE, 2, 16), dtype=torch.bfloat16).transpose(1, 2)


def test_derive_sublayers_key_half_of_each_head_splits_into_exact_pages():
    # 1. Only K of a FlashAttention layer: each token row has a V gap after its K half.
    name, tensor = _fa_layer()
    k_only = tensor[..., :8]
    # 2. The K runs become sub-layers of their own: every page holds exactly its block's K.
    assert len(derive_sublayers(info_of(name, k_only), NUM_BLOCKS)) > 1
    assert_pages_hold_exactly_each_block({name: k_only}, NUM_BLOCKS, 0)


def test_derive_sublayers_every_other_head_splits_into_exact_pages():
    # 1. Every other head of an HND layer: gaps between the heads inside each block.
    name = "model.layers.3.self_attn.attn"
    tensor = torch.zeros((NUM_BLOCKS, 4, BLOCK_SIZE, 16), dtype=torch.bfloat16)[:, ::2]
    # 2. One sub-layer per kept head, each page exactly that head's part of the block.
    assert len(derive_sublayers(info_of(name, tensor), NUM_BLOCKS)) == 2
    assert_pages_hold_exactly_each_block({name: tensor}, NUM_BLOCKS, 0)


def test_derive_sublayers_overlapping_blocks_raise_layout_error_naming_tensor():
    # 1. A view whose blocks overlap: a block of 4 x 8 elements every 16 elements.
    name = "overlapping"
    info = TensorInfo(name, 4096, (NUM_BLOCKS, 4, 8), (16, 8, 1), 2)
    # 2. Pages larger than the block stride cannot be copied independently: refused.
    with pytest.raises(LayoutError, match=re.escape(name)):
        derive_sublayers(info, NUM_BLOCKS)


def test_derive_sublayers_no_block_dimension_raises_layout_error_naming_tensor():
    # 1. A layer view built for 6 blocks while vLLM's config says 5.
    name = "model.layers.0.self_attn.attn"
    tensor = torch.zeros((NUM_BLOCKS + 1, 2, BLOCK_SIZE, 16), dtype=torch.bfloat16)
    # 2. No dimension has num_blocks entries: refused, naming the tensor and the count.
    with pytest.raises(LayoutError, match=re.escape(name) + r".*\b5 blocks"):
        derive_sublayers(info_of(name, tensor), NUM_BLOCKS)


@pytest.mark.parametrize("shape,strides,element_size", [
    ((NUM_BLOCKS, 8), (8,), 2),          # strides shorter than the shape
    ((NUM_BLOCKS, 8), (8, 1), 0),        # no element size
    ((NUM_BLOCKS, 8), (-8, 1), 2),       # negative block stride
])
def test_derive_sublayers_malformed_description_raises_layout_error_naming_tensor(shape, strides,
                                                                                 element_size):
    # 1. A description no tensor can have is refused, naming the tensor.
    with pytest.raises(LayoutError, match="bad_tensor"):
        derive_sublayers(TensorInfo("bad_tensor", 4096, shape, strides, element_size), NUM_BLOCKS)


def test_derive_sublayers_num_heads_equal_num_blocks_derives_exact_pages():
    # 1. LHBNC with as many heads as blocks: two dimensions of num_blocks entries, and the
    #    head dimension has the larger stride.
    num_heads = NUM_BLOCKS
    tensors = hand_built_layers(LAYOUTS["LHBNC"], num_heads, 8, torch.int16)
    # 2. The block dimension is told apart (it is the one vLLM's layout puts blocks in): every
    #    page holds exactly its block, not one head of all blocks.  A refusal fails too.
    assert_pages_hold_exactly_each_block(tensors, NUM_BLOCKS, block_dim=0)


def test_derive_sublayers_kv_split_with_two_blocks_is_refused_as_ambiguous():
    # 1. [2, num_blocks, ...] with num_blocks == 2: the K/V plane dimension also has 2 entries,
    #    and nothing in the shape or strides tells which of the two holds the blocks.
    tensor = torch.zeros((2, 2, BLOCK_SIZE, 2, 8), dtype=torch.int16)
    # 2. Refused, naming why (never pages of all of K or all of V as if they were a block).
    with pytest.raises(LayoutError, match="several dimensions have 2 entries; cannot tell which one "
                                          "is the block dimension"):
        derive_sublayers(info_of("kv", tensor), 2)


# -- aliases and spans -----------------------------------------------------------------------


@pytest.mark.vllm
def test_alias_key_shared_layer_equal_other_layers_differ(vllm_views):
    # 1. vLLM's KV sharing: a layer reuses another layer's tensor object.
    tensors, _ = vllm_views("LBNHC", _full_attention_spec())
    names = list(tensors)
    tensors["model.layers.9.self_attn.attn"] = tensors[names[0]]
    keys = {name: alias_key(info_of(name, t)) for name, t in tensors.items()}
    # 2. The sharing layer has the key of its target; the three real layers have three keys.
    assert keys["model.layers.9.self_attn.attn"] == keys[names[0]]
    assert len({keys[name] for name in names}) == NUM_LAYERS


def test_alias_key_same_pointer_other_strides_or_shape_differ():
    # 1. Two views starting at the same byte: LBNHC and LBHNC readings of one layer, and a
    #    view of fewer blocks.
    buffer = torch.zeros(NUM_BLOCKS * 2 * BLOCK_SIZE * 16, dtype=torch.bfloat16)
    nhd = buffer.view(NUM_BLOCKS, BLOCK_SIZE, 2, 16).transpose(1, 2)
    hnd = buffer.view(NUM_BLOCKS, 2, BLOCK_SIZE, 16)
    fewer = hnd[:NUM_BLOCKS - 1]
    infos = [info_of("a", nhd), info_of("b", hnd), info_of("c", fewer)]
    assert len({info.data_ptr for info in infos}) == 1
    # 2. Same pointer is not enough to be one memory: all three keys differ.
    assert len({alias_key(info) for info in infos}) == 3
    # 3. The same view under another name is the same memory.
    assert alias_key(info_of("d", hnd)) == alias_key(infos[1])


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_span_bytes_every_layout_covers_every_page(layout_name):
    # 1. Hand-built layers of the layout.
    tensors = hand_built_layers(LAYOUTS[layout_name], 1, 16, torch.bfloat16)
    for name, tensor in tensors.items():
        info = info_of(name, tensor)
        # 2. The span ends exactly at the last element of the view...
        last = tensor[(-1,) * tensor.dim()].data_ptr()
        assert span_bytes(info) == last + tensor.element_size() - info.data_ptr
        # 3. ...so every derived page lies inside [data_ptr, data_ptr + span).
        for sub in derive_sublayers(info, NUM_BLOCKS):
            assert sub.offset_bytes + (NUM_BLOCKS - 1) * sub.block_stride_bytes + sub.page_bytes \
                <= span_bytes(info)


def test_span_bytes_empty_tensor_is_zero():
    # 1. A view with no element spans no byte.
    assert span_bytes(TensorInfo("empty", 4096, (0, 8), (8, 1), 2)) == 0
