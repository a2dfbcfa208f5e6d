"""PegaKVConnector with vLLM's real Scheduler against an engine with a disk tier (host
backend): a prefix evicted from the engine's pool is served from disk byte for byte, through
an asynchronous load even in layer-wise mode, or in the step under disk_load_mode layerwise."""

from __future__ import annotations

import os
import time

import pytest

from pegaflow.stats.engine_stats import read_stats
from tests.pegaflow.connector.test_connector_scheduler import PROMPT, _assert_loaded_bytes, _warm
from tests.pegaflow.connector.vllm_harness import BLOCK, VllmInstance, make_request
from tools.engine_process import EngineProcess

pytestmark = pytest.mark.vllm


def _wait(engine_name: str, predicate, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while not predicate(stats := read_stats(engine_name)):
        assert time.monotonic() < deadline, f"engine stats never got there: {stats}"
        time.sleep(0.01)
    return stats


def _run_until_done(vllm: VllmInstance, timeout_s: float = 30.0) -> None:
    """Step until every request ends; a step that schedules nothing (vLLM waiting for an
    asynchronous load from disk) is followed by a short pause, not by the next at once."""
    deadline = time.monotonic() + timeout_s
    while vllm.scheduler.requests:
        assert time.monotonic() < deadline, f"requests still running: {list(vllm.scheduler.requests)}"
        if not vllm.step().output.total_num_scheduled_tokens:
            time.sleep(0.005)


def _step_until_admitted(vllm: VllmInstance, req_id: str, timeout_s: float = 30.0):
    """``VllmInstance.step_until_admitted`` by the clock (a loaded machine is slow to answer)."""
    deadline = time.monotonic() + timeout_s
    while True:
        record = vllm.step()
        if record.loads or any(r.req_id == req_id for r in record.output.scheduled_new_reqs):
            return record
        assert time.monotonic() < deadline, f"{req_id} not admitted within {timeout_s} s"
        time.sleep(0.002)


@pytest.mark.parametrize("disk_load_mode", ["async", "layerwise"])
def test_connector_prefix_evicted_to_disk_is_served_from_it_exactly(tmp_path, disk_load_mode):
    # A pool of 10 blocks (24 KiB each: 3 layers of 8 KiB pages), a disk tier beside it.
    name = f"cdisk{os.getpid()}_{os.urandom(2).hex()}"
    with EngineProcess(name, "--slab-size", "128KiB", "--disk-path", str(tmp_path / "d"),
                       pool_size="256KiB") as engine:
        # 1. A first vLLM computes the prompt: its 5 blocks are saved and written to disk.
        _warm(engine.name, PROMPT)
        _wait(engine.name, lambda s: s["disk_blocks_written"] >= 5)
        # 2. Two other prompts (10 blocks) push it out of the pool.
        for i, base in enumerate((5000, 9000)):
            _warm(engine.name, list(range(base, base + 5 * BLOCK + 3)), req_id=f"other{i}")
        _wait(engine.name, lambda s: s["evictions"] >= 5)
        # 3. A fresh vLLM (layer-wise loading, poisoned KV memory) asks for the prompt: the
        #    engine finds it on disk; the connector loads it between steps, or under
        #    disk_load_mode layerwise in the step (which waits for the engine's reads).
        second = VllmInstance(engine.name, extra={"disk_load_mode": disk_load_mode})
        try:
            second.poison()
            second.add(make_request("again", PROMPT))
            (load,) = _step_until_admitted(second, "again").loads
            assert load.is_async == (disk_load_mode == "async") and len(load.block_ids) == 5
            _run_until_done(second)
            assert second.external_hits() == 5 * BLOCK
            # 4. Every byte is what the first vLLM saved.
            _assert_loaded_bytes(second, load)
        finally:
            second.close()
        stats = read_stats(engine.name)
        assert stats["lookup_disk_blocks"] >= 5 and stats["disk_blocks_read"] >= 5
        assert stats["disk_checksum_failures"] == 0
