"""A hybrid model (several KV cache groups: full attention and sliding window) under vLLM's
hybrid KV cache manager, driven by vLLM's real Scheduler against a real engine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from pegaflow.connector.connector import HAS_FAILED_RECVING
from pegaflow.stats.engine_stats import read_stats
from tests.pegaflow.connector.vllm_harness import (
    BLOCK,
    NUM_LAYERS,
    THREE_GROUPS,
    TWO_GROUPS,
    WINDOW,
    VllmInstance,
    block_pattern,
    group_of,
    make_request,
)

pytestmark = pytest.mark.vllm
# Serving several groups needs a vLLM that can take a failed load of them (failed_recving);
# on one that cannot (0.26) the cache is off for such a model (the tests below it).
needs_failed_recving = pytest.mark.skipif(not HAS_FAILED_RECVING, reason="this vLLM cannot take a failed "
                                          "load of several groups: pegaflow's cache is off for them")

PROMPT = list(range(300, 300 + 6 * BLOCK + 5))  # 6 full blocks and 5 tokens
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def engine(vllm_engine):
    return vllm_engine


def _warm(engine_name: str, groups, prompt=PROMPT, **kwargs) -> None:
    first = VllmInstance(engine_name, groups=groups, **kwargs)
    try:
        first.add(make_request("warm", prompt))
        first.run_until_done()
    finally:
        first.close()


@pytest.mark.parametrize("groups", [TWO_GROUPS, THREE_GROUPS], ids=["two-groups", "three-groups"])
@needs_failed_recving
def test_connector_hybrid_each_group_is_served_its_own_blocks_exactly(engine, groups):
    # 1. A first vLLM computes the prompt: every group saves its own blocks.
    _warm(engine.name, groups)
    # 2. A fresh vLLM (memory poisoned) keeps the hybrid manager on and is served the prefix.
    second = VllmInstance(engine.name, groups=groups)
    try:
        # (the harness turns the manager on; vLLM keeps it on only for a connector it
        # finds supporting it, and builds no connector that does not when it is on)
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        assert KVConnectorFactory.supports_hma_config(second.config.kv_transfer_config)
        assert type(second.scheduler.kv_cache_manager.coordinator).__name__ == "HybridKVCacheCoordinator"
        second.poison()
        second.add(make_request("b", PROMPT))
        load = next(load for record in second.run_until_done() for load in record.loads)
        # 3. One part per group: full attention every position, a sliding window its last.
        parts = {part.group: part for part in load.groups}
        assert sorted(parts) == list(range(len(groups)))
        for g, (kind, _) in enumerate(groups):
            assert len(parts[g].block_ids) == (6 if kind == "full" else WINDOW // BLOCK)
        assert second.external_hits() == 6 * BLOCK
        # 4. Each layer got its own group's bytes (a group served another's ids would not).
        #    The request is gone; its blocks still hold the bytes, so check the last load.
        for g, part in parts.items():
            for layer in (i for i in range(NUM_LAYERS) if second.group_of[i] == g):
                for block_id, block_hash in zip(part.block_ids, part.hashes):
                    assert np.array_equal(second.page(layer, block_id), block_pattern(block_hash, layer)), \
                        f"group {g} layer {layer} block {block_id} differs from what was saved"
    finally:
        second.close()


@needs_failed_recving
def test_connector_hybrid_failed_load_fails_the_request_and_vllm_recomputes_it(engine):
    # 1. The prefix is stored; a fresh vLLM looks it up and plans its load.
    _warm(engine.name, TWO_GROUPS)
    second = VllmInstance(engine.name, groups=TWO_GROUPS)
    try:
        second.poison()
        second.add(make_request("b", PROMPT))
        # 2. The engine dies between the plan and the load: the load fails.  vLLM can take
        #    that only as a failed request (failed block ids of several groups raise).
        start_load = second.worker.start_load_kv

        def kill_then_load(context):
            if second.worker._get_connector_metadata().loads:
                os.kill(engine.pid, signal.SIGKILL)
                engine.proc.wait(10)
            start_load(context)

        transfer_results, failed = second.worker.get_transfer_results, []

        def noting_failures(finished_req_ids):
            results = transfer_results(finished_req_ids)
            failed.extend(results.failed_recving)
            return results

        second.worker.start_load_kv = kill_then_load
        second.worker.get_transfer_results = noting_failures
        records = second.run_until_done()
        # 3. The request was reported failed, no failed block ids went to vLLM, and vLLM
        #    computed the whole prompt itself and finished the request.
        assert failed == ["b"]
        assert any(record.loads for record in records)
        assert not any(record.load_errors for record in records)
        assert sum(record.output.num_scheduled_tokens.get("b", 0) for record in records) >= len(PROMPT)
        assert "b" not in second.scheduler.requests
    finally:
        second.close()


@needs_failed_recving
def test_connector_hybrid_block_a_window_let_go_waits_for_its_save_before_reuse(engine):
    # A long prompt in 64-token chunks on a small GPU cache: the sliding window gives blocks
    # back inside schedule() and vLLM hands them out again at once.  The engine is stopped,
    # so earlier steps' SAVEs are still queued when a later step would overwrite their blocks.
    prompt = list(range(500, 500 + 20 * BLOCK + 3))
    first = VllmInstance(engine.name, groups=TWO_GROUPS, num_blocks=34, max_batched_tokens=64)
    waited = []
    try:
        first.add(make_request("a", prompt))
        first.step()  # step 1 saved and answered
        os.kill(engine.pid, signal.SIGSTOP)
        try:
            for _ in range(3):  # steps 2-4: SAVEs queued, unanswered
                first.step()
            resume = threading.Timer(0.3, os.kill, (engine.pid, signal.SIGCONT))
            resume.start()

            def note(meta):
                waited.append((meta.wait_saves_through, first.worker._worker.saves.done_through()))

            first.step(before_forward=note)  # step 5 reuses blocks steps 2-3 saved
        finally:
            os.kill(engine.pid, signal.SIGCONT)
        first.run_until_done()
    finally:
        first.close()
    # 1. Step 5's metadata made the worker wait for those SAVEs, and it did, before the forward.
    wait_through, done_through = waited[0]
    assert wait_through >= 2 and done_through >= wait_through
    # 2. What those SAVEs stored is what the blocks held when saved: a fresh vLLM served a
    #    6-block prefix (its window's blocks were saved in step 2 and reused in step 5).
    short = prompt[:6 * BLOCK + 3]
    second = VllmInstance(engine.name, groups=TWO_GROUPS)
    try:
        second.poison()
        second.add(make_request("b", short))
        load = next(load for record in second.run_until_done() for load in record.loads)
        sliding = next(part for part in load.groups if part.group == 1)
        for block_id, block_hash in zip(sliding.block_ids, sliding.hashes):
            assert np.array_equal(second.page(1, block_id), block_pattern(block_hash, 1)), \
                f"sliding-window block {block_id} was overwritten before its save read it"
    finally:
        second.close()


def test_connector_claims_hybrid_support_on_every_vllm():
    # vLLM turns its hybrid manager off for a connector that does not claim it, and a hybrid
    # SSM model then fails to start: pegaflow claims it whatever vLLM can take, a vLLM
    # without failed_recving (0.26, or played here by removing it before the import) included.
    probe = ("from vllm.distributed.kv_transfer.kv_connector.v1 import base\n"
             "for has in (True, False):\n"
             "    if not has:\n"
             "        vars(base).pop('KVConnectorTransferResults', None)\n"
             "        import importlib, pegaflow.connector.connector as c; importlib.reload(c)\n"
             "    from pegaflow.connector import connector as c\n"
             "    print(c.HAS_FAILED_RECVING, base.supports_hma(c.PegaKVConnector))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                             p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(HAS_FAILED_RECVING), "True", "False", "True"], out.stdout


def test_connector_hybrid_model_with_a_mamba_group_starts_with_the_cache_off(vllm_engine):
    # A worker of such a model registers nothing (its state's layout need not parse), and
    # its scheduler side offers no hit, plans no save and holds no slot of the engine:
    # vLLM computes every prompt.
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from pegaflow.connector import PegaKVConnector
    from tests.pegaflow.connector.vllm_harness import TINY_MODEL

    kv_cache_config = SimpleNamespace(num_blocks=8, kv_cache_groups=[group_of("attn", "FullAttentionSpec"),
                                                                     group_of("ssm", "MambaSpec")])
    config = VllmInstance._vllm_config(vllm_engine.name, {}, TINY_MODEL, 256, "bfloat16", 1)
    worker = PegaKVConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    worker.register_kv_caches({"attn": torch.zeros(8, 2, 16, 128), "ssm": torch.zeros(8, 3, 5)})
    assert worker._worker.memory is None
    scheduler = PegaKVConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
    assert not scheduler.pega_config.enable_load and not scheduler.pega_config.enable_save
    request = make_request("r", PROMPT)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    assert scheduler._scheduler.link.client() is None  # (what every step's metadata asks)
    assert read_stats(vllm_engine.name)["clients"] == []
    worker.shutdown()
    scheduler.shutdown()


def test_connector_sliding_window_groups_on_a_vllm_without_failed_requests_start_with_the_cache_off(
        monkeypatch, caplog):
    # vLLM 0.26 keeps its hybrid manager on for pegaflow but cannot take a failed load of
    # several groups: the cache is off for such a model, and one ERROR says how to be served.
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from pegaflow.connector import connector as connector_module
    from tests.pegaflow.connector.vllm_harness import TINY_MODEL

    monkeypatch.setattr(connector_module, "HAS_FAILED_RECVING", False)

    kv_cache_config = SimpleNamespace(num_blocks=8, kv_cache_groups=[group_of("full", "FullAttentionSpec"),
                                                                     group_of("swa", "SlidingWindowSpec")])
    config = VllmInstance._vllm_config("nosuchengine", {}, TINY_MODEL, 256, "bfloat16", 1)
    with caplog.at_level("ERROR", logger="pegaflow.connector.connector"):
        scheduler = connector_module.PegaKVConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
        worker = connector_module.PegaKVConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    worker.register_kv_caches({"full": torch.zeros(8, 2, 16, 128), "swa": torch.zeros(8, 2, 16, 128)})
    assert worker._worker.memory is None
    assert not scheduler.pega_config.enable_load and not scheduler.pega_config.enable_save
    assert scheduler.get_num_new_matched_tokens(make_request("r", PROMPT), 0) == (0, False)
    assert "--disable-hybrid-kv-cache-manager" in caplog.text
    worker.shutdown()
    scheduler.shutdown()
