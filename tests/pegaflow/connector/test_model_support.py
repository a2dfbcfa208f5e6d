"""pegaflow/connector/model_support.py: which models' caches pegaflow serves, group by group,
and why one stays off (state that is not blocks of positions, blocks of another size, a hash
finer than a block, a vLLM that cannot take a failed load of several groups)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pegaflow.connector.model_support import kv_cache_groups
from tests.pegaflow.connector.vllm_harness import BLOCK, group_of

pytestmark = pytest.mark.vllm


def test_connector_hybrid_group_whose_state_is_not_blocks_turns_the_cache_off():
    # A group of Mamba state (or any spec whose blocks are not positions' KV) cannot be
    # served from stored blocks: the cache is off for that model, vLLM keeps working.
    config = SimpleNamespace(kv_cache_groups=[group_of("a", "FullAttentionSpec"), group_of("m", "MambaSpec")])
    names, why = kv_cache_groups(config, BLOCK)
    assert names == [["a"], ["m"]] and "MambaSpec" in why
    config.kv_cache_groups = [group_of("a", "FullAttentionSpec"), group_of("s", "SlidingWindowSpec", 32)]
    assert "32-token" in kv_cache_groups(config, BLOCK)[1]
    config.kv_cache_groups = [group_of("a", "FullAttentionSpec"), group_of("s", "SlidingWindowSpec")]
    assert kv_cache_groups(config, BLOCK)[1] is None
    # A vLLM that cannot take a failed load of several groups (0.26): off, saying how to be
    # served (one group, the hybrid manager off); one group needs no such word.
    assert "--disable-hybrid-kv-cache-manager" in kv_cache_groups(config, BLOCK, can_fail_requests=False)[1]
    config.kv_cache_groups = config.kv_cache_groups[:1]
    assert kv_cache_groups(config, BLOCK, can_fail_requests=False)[1] is None


def test_connector_hybrid_groups_hashed_finer_than_a_block_turn_the_cache_off():
    # vLLM hashes a prefix every prefix_match_unit tokens where it has several groups: a
    # block stored under such a hash would be served to a prompt sharing only its first
    # unit of tokens.  Off, unless the unit is the block.
    config = SimpleNamespace(kv_cache_groups=[group_of("a", "FullAttentionSpec"), group_of("s", "SlidingWindowSpec")])
    assert "every 8 tokens" in kv_cache_groups(config, BLOCK, hash_unit=8)[1]
    assert kv_cache_groups(config, BLOCK, hash_unit=BLOCK)[1] is None


def test_connector_one_group_is_served_only_where_it_keeps_a_block_per_position():
    # One group of full attention (MLA, a sink: its subclasses) keeps every position's block,
    # so a failed load is recomputed from the failed block.  Of a window on every layer vLLM
    # keeps no blocks before the window, and Mamba state is not positions: off for both.
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    def one(spec):
        return kv_cache_groups(SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=["l"],
                                                                                kv_cache_spec=spec)]), BLOCK)[1]

    assert one(FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)) is None
    assert one(MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)) is None
    window = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                               sliding_window=4 * BLOCK)
    assert "could not be recomputed" in one(window)
    assert "could not be recomputed" in one(type("RSWASpec", (FullAttentionSpec,), {})(
        block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16))
    assert "MambaSpec" in one(type("MambaSpec", (), {"block_size": BLOCK})())
