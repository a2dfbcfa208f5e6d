"""Tensor parallelism without GPUs: one vLLM Scheduler, a worker-side connector per TP rank
(each with its own host KV memory), one engine (host backend)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pegaflow.stats.engine_stats import read_stats
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


def _assert_served_from_the_pool(engine_name: str, mla: bool) -> None:
    """A fresh TP=2 vLLM (every rank's memory poisoned) is served the 5 blocks on every
    rank, each rank exactly what it would have computed, each with a lease of its own."""
    second, load = _run(engine_name, mla, "served")
    try:
        assert load is not None and len(load.block_ids) == 5 and len(load.lease_ids) == TP
        assert len(set(load.lease_ids)) == TP
        assert second.external_hits() == 5 * BLOCK
        _assert_each_rank_holds_its_own(second, load)
    finally:
        second.close()


def test_connector_tp2_dense_each_rank_is_served_its_own_kv(engine):
    # 1. A TP=2 vLLM computes the prompt: each rank saves its 5 full blocks.
    first, load = _run(engine.name, False, "warm")
    first.close()
    assert load is None
    stats = read_stats(engine.name)
    # 2. Each rank's blocks are stored under its own namespace (its heads' KV are its own).
    assert stats["blocks_saved"] == 5 * TP and stats["save_dedup_blocks"] == 0
    assert stats["pool_bytes_used"] == 5 * TP * NUM_LAYERS * PAGE_ELEMS * 2
    assert stats["save_votes"] == 0
    # 3. A fresh vLLM is served every rank's own blocks.
    _assert_served_from_the_pool(engine.name, False)


def test_connector_tp2_scheduler_sends_each_rank_its_workers_namespace(engine):
    # The scheduler looks up rank r's blocks under the r-th namespace it sends; each worker
    # saves under its own: they must be the same, in rank order (two per-rank namespaces).
    vllm = VllmInstance(engine.name, tp_size=TP)
    try:
        vllm.add(make_request("r", PROMPT))
        sent = vllm.step().output.kv_connector_metadata.namespaces
        assert sent == tuple(worker._worker.namespace for worker in vllm.workers) and len(set(sent)) == TP
    finally:
        vllm.close()


def test_connector_tp2_mla_stores_one_copy_and_serves_every_rank_from_it(engine):
    # 1. A TP=2 MLA vLLM computes the prompt: both ranks save the same 5 latent blocks
    #    under one shared namespace.
    first, load = _run(engine.name, True, "warm")
    first.close()
    assert load is None
    stats = read_stats(engine.name)
    # 2. The pool holds one copy (one rank's share): the first SAVE copied, the other voted.
    assert stats["blocks_saved"] == 5 and stats["pool_blocks_used"] == 5
    assert stats["pool_bytes_used"] == 5 * NUM_LAYERS * PAGE_ELEMS * 2
    assert stats["save_votes"] == 5 and stats["save_vote_conflicts"] == 0
    # 3. A fresh vLLM is served the one copy on both ranks, byte-exact.
    _assert_served_from_the_pool(engine.name, True)
    assert read_stats(engine.name)["blocks_loaded"] == 5 * TP


def test_connector_tp2_mla_copy_a_rank_withheld_is_never_served(engine):
    # 1. Rank 0 holds back the request's saves (as after a failed load of its: Taint), so
    #    only rank 1's copy, computed from rank 0's garbage, reaches the engine.
    vllm = VllmInstance(engine.name, tp_size=TP, mla=True)
    try:
        vllm.workers[0]._worker._taint.failed_load("warm", [])
        vllm.add(make_request("warm", PROMPT))
        vllm.run_until_done()
        stats = read_stats(engine.name)
        assert stats["pool_blocks_used"] == 5 and stats["blocks_saved"] == 0
        # 2. A second TP=2 vLLM finds nothing: its lookups miss and it computes the prompt;
        #    its saves (another step and request: another tag) do not complete the waiting
        #    copy, on either rank.
        second, load = _run(engine.name, True, "again")
        second.close()
        assert load is None and second.external_hits() == 0
        stats = read_stats(engine.name)
        assert stats["blocks_saved"] == 0 and stats["lookup_hit_blocks"] == 0
        assert stats["save_vote_conflicts"] == 5 * TP and stats["pool_blocks_used"] == 5
    finally:
        vllm.close()
    # 3. The copy that never got its votes leaves with its writer: no page is kept.
    assert read_stats(engine.name)["pool_blocks_used"] == 0
