"""PegaKVConnector pieces that need no running vLLM."""

import pytest

from pegaflow.connector.connector import _rank
from pegaflow.errors import ConfigError


def test_connector_rank_without_distributed_state_is_0_only_for_a_group_of_one():
    # vLLM is installed but no process group exists (a plain CPU test process).
    assert _rank("tp", 1) == 0 and _rank("pp", 1) == 0
    # Two ranks sharing namespace 0 would be served each other's KV: refuse instead.
    with pytest.raises(ConfigError, match="tp rank"):
        _rank("tp", 2)
    with pytest.raises(ConfigError, match="pp rank"):
        _rank("pp", 4)
