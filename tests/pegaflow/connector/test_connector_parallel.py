"""Tensor parallelism without GPUs: one vLLM Scheduler, a worker-side connector per TP rank
(each with its own host KV memory), one engine (host backend)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pegaflow.engine_stats import read_stats
from tests.pegaflow.connector.vllm_harness import BLOCK, NUM_LAYERS, PAGE_ELEMS, VllmInstance, make_request
from tools.engine_process import EngineProcess

pytestmark = pytest.mark.vllm

PROMPT = list(range(100, 100 + 5 * BLOCK + 7))  # 5 full blocks and 7 tokens
TP = 2


@pytest.fixture
def engine():
    with EngineProcess(f"tp{os.getpid()}_{os.urandom(3).hex()}", "--lease-ttl", "30") as proc:
        yield proc


def _run(engine_name: str, mla: bool, req_id: str) -> tuple[VllmInstance, object]:
    """A TP=2 vLLM runs PROMPT; returns it (open) and its load, if any."""
    vllm = VllmInstance(engine_name, tp_size=TP, mla=mla)
    vllm.poison()
    vllm.add(make_request(req_id, PROMPT))
    loads = [load for record in vllm.run_until_done() for load in record.loads]
    return vllm, (loads[0] if loads else None)


def _assert_each_rank_holds_its_own(vllm: VllmInstance, load) -> None:
    for rank in range(TP):
        for block_id, block_hash in zip(load.block_ids, load.hashes):
            for layer in range(NUM_LAYERS):
                assert np.array_equal(vllm.page(layer, block_id, rank), vllm.pattern(block_hash, layer, rank)), \
                    f"rank {rank} block {block_id} layer {layer} differs from what that rank saved"


@pytest.mark.parametrize("mla", [False, True], ids=["dense", "mla"])
def test_connector_tp2_each_rank_is_served_its_own_kv(engine, mla):
    # 1. A TP=2 vLLM computes the prompt: each rank saves its 5 full blocks.
    first, load = _run(engine.name, mla, "warm")
    first.close()
    assert load is None
    stats = read_stats(engine.name)
    # 2. Each rank's blocks are stored under its own namespace (MLA too, whose ranks hold
    #    the same latent: README, tensor parallelism).
    assert stats["blocks_saved"] == 5 * TP and stats["save_dedup_blocks"] == 0
    assert stats["pool_bytes_used"] == 5 * TP * NUM_LAYERS * PAGE_ELEMS * 2
    # 3. A fresh TP=2 vLLM (every rank's memory poisoned) is served the 5 blocks on every
    #    rank, each rank exactly what that rank computed.
    second, load = _run(engine.name, mla, "served")
    try:
        assert load is not None and len(load.block_ids) == 5 and len(load.lease_ids) == TP
        assert second.external_hits() == 5 * BLOCK
        _assert_each_rank_holds_its_own(second, load)
    finally:
        second.close()
