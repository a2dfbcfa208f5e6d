"""The per-step metadata's derived values (``metadata.py``)."""

from __future__ import annotations

import pytest

from pegaflow.connector.metadata import save_tag

pytestmark = pytest.mark.vllm


def test_save_tag_same_for_step_and_request_else_differs():
    # Every rank derives it from the same metadata: equal for the same (step, request),
    # another for a later step (a recomputation) or another request.
    assert save_tag(7, "req-a") == save_tag(7, "req-a")
    assert len({save_tag(7, "req-a"), save_tag(8, "req-a"), save_tag(7, "req-b")}) == 3
    assert 0 <= save_tag(7, "req-a") < 1 << 64
