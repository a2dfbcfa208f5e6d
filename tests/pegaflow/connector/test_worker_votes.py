"""A voter's SAVEs (``worker.py`` with ``voters``, MLA under TP): each block tagged with its
step and request, alike on every rank."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pegaflow.connector.config import ConnectorConfig
from pegaflow.connector.metadata import PegaConnectorMetadata, SaveSpec, save_tag
from pegaflow.connector.worker import WorkerSide
from tests.pegaflow.connector.test_worker import StuckClient

pytestmark = pytest.mark.vllm


class TagsClient(StuckClient):
    """Records each SAVE's block ids and tags; never answers."""

    def __init__(self):
        super().__init__()
        self.saved = []

    def submit_save(self, namespace, ids, records, event_index, one_event=False, tags=None):
        self.saved.append(([int(i) for i in ids], tags))
        return 41


def _saves_of_one_step(voters, step: int = 12):
    worker = WorkerSide(ConnectorConfig(), namespace=5, rank=voters[1] if voters else 0, num_blocks=16,
                        num_ranks=2, voters=voters)
    worker.memory = SimpleNamespace(has_events=False)
    worker.layers.save_layers = {"layer"}
    client = TagsClient()
    worker.link.use(client)
    meta = PegaConnectorMetadata(step=step)
    meta.saves.extend([SaveSpec("a", (1, 2), (b"x" * 32, b"y" * 32)), SaveSpec("b", (3,), (b"z" * 32,))])
    worker.bind(meta)
    worker.start_load_kv()
    worker.save_kv_layer("layer")
    worker.wait_for_save()
    return client.saved


def test_worker_voters_tag_each_block_with_its_step_and_request_alike_on_every_rank():
    # 1. Two ranks sharing a namespace send one SAVE each for the same step's two requests.
    rank0, rank1 = _saves_of_one_step((2, 0)), _saves_of_one_step((2, 1))
    # 2. Each block carries its own request's tag, the same on both ranks.
    expected = [save_tag(12, "a"), save_tag(12, "a"), save_tag(12, "b")]
    assert rank0 == rank1 == [([1, 2, 3], expected)]
    # 3. The same request in another step (a recomputation) gets other tags.
    assert _saves_of_one_step((2, 0), step=13)[0][1][0] != expected[0]


def test_worker_non_voter_sends_no_tags():
    assert _saves_of_one_step(None) == [([1, 2, 3], None)]
