"""PegaKVConnector pieces that need no running vLLM."""

import pytest

from pegaflow.connector.connector import _rank
from pegaflow.platform.errors import ConfigError


def test_connector_rank_without_distributed_state_is_0_only_for_a_group_of_one():
    # vLLM is installed but no process group exists (a plain CPU test process).
    assert _rank("tp", 1) == 0 and _rank("pp", 1) == 0
    # Two ranks sharing namespace 0 would be served each other's KV: refuse instead.
    with pytest.raises(ConfigError, match="tp rank"):
        _rank("tp", 2)
    with pytest.raises(ConfigError, match="pp rank"):
        _rank("pp", 4)


def test_connector_keeps_vllms_full_cuda_graphs():
    # vLLM turns FULL_AND_PIECEWISE into PIECEWISE for a connector that asks for it.
    from pegaflow.connector import PegaKVConnector
    assert PegaKVConnector.requires_piecewise_for_cudagraph({}) is False


@pytest.mark.parametrize("mode, has_metadata, expected", [
    ("FULL", True, False),       # V1 model runner replaying a full graph
    ("PIECEWISE", True, True),   # attention runs eagerly between graph pieces
    ("NONE", True, True),        # eager
    ("NONE", False, False),      # V2 model runner before a full-graph replay; no-forward steps
])
def test_connector_knows_when_vllm_runs_no_layer_hooks(mode, has_metadata, expected):
    from types import SimpleNamespace

    from vllm.config import CUDAGraphMode

    from pegaflow.connector.connector import runs_layer_hooks
    context = SimpleNamespace(cudagraph_runtime_mode=CUDAGraphMode[mode],
                              attn_metadata={"layer": object()} if has_metadata else None)
    assert runs_layer_hooks(context) is expected
    assert runs_layer_hooks(None) is True  # a caller that drives the hooks itself
