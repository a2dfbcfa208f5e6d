"""What the platform vLLM runs on cannot take: MLA after a served prefix on vLLM's CPU build."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.pegaflow.connector.vllm_harness import BLOCK, TINY_MODEL, VllmInstance

pytestmark = pytest.mark.vllm


def _connector(engine_name: str, spec):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from pegaflow.connector import PegaKVConnector

    kv_cache_config = SimpleNamespace(num_blocks=8, kv_cache_groups=[SimpleNamespace(layer_names=["l"],
                                                                                     kv_cache_spec=spec)])
    config = VllmInstance._vllm_config(engine_name, {}, TINY_MODEL, 256, "bfloat16", 1)
    return PegaKVConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config)


@pytest.mark.parametrize("is_cpu", [True, False], ids=["cpu-build", "other-platform"])
def test_connector_platform_mla_on_vllms_cpu_build_starts_with_the_cache_off(vllm_engine, monkeypatch, is_cpu):
    # vLLM's CPU build turns its own prefix caching off for MLA: its MLA attention takes no
    # cached context, so a prefix served from the engine would give other tokens.  There
    # (and only there) an MLA model's cache is off; full attention is served on it.
    import torch
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: is_cpu)
    mla = _connector(vllm_engine.name, MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576,
                                                        dtype=torch.bfloat16))
    dense = _connector(vllm_engine.name, FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64,
                                                           dtype=torch.bfloat16))
    try:
        assert mla.pega_config.enable_load is not is_cpu and mla.pega_config.enable_save is not is_cpu
        assert dense.pega_config.enable_load and dense.pega_config.enable_save
    finally:
        mla.shutdown()
        dense.shutdown()
