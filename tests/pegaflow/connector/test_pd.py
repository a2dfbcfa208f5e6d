"""Prefill/decode disaggregation through one engine: a ``kv_producer`` vLLM saves, a
``kv_consumer`` vLLM loads (docs/disaggregation.md).

Each vLLM is a real ``Scheduler`` with the connector on both sides over the host backend
(``vllm_harness``).  The engine runs with its copies held back while a file exists
(``held_copies.py``), so a producer's SAVE stays in flight exactly as long as a test says:
the race of store-based P/D, where the decode server looks up before the prefill server's
saves have landed, made to happen every time.
"""

from __future__ import annotations

import os
import random
import sys
import time

import numpy as np
import pytest

from pegaflow.stats.engine_stats import read_stats
from tests.pegaflow.connector.vllm_harness import BLOCK, NUM_LAYERS, VllmInstance, block_pattern, make_request
from tools.engine_process import EngineProcess

pytestmark = pytest.mark.vllm

PRODUCER, CONSUMER = {"kv_role": "kv_producer"}, {"kv_role": "kv_consumer"}
WAIT_DEADLINE_S = 60.0  # how long a test waits for what it is owed (generous)


@pytest.fixture
def held_engine(tmp_path):
    """(engine name, hold file): an engine whose copies end only while the file is absent."""
    name, hold = f"pd{os.getpid()}_{os.urandom(3).hex()}", tmp_path / "hold"
    engine = EngineProcess(name, "--lookup-wait-ms", "10000", "--lease-ttl", "30",
                           prefix=(sys.executable, "-m", "tests.pegaflow.connector.held_copies", str(hold)))
    yield name, hold
    hold.unlink(missing_ok=True)  # (a test that failed while holding: its copies end before the stop)
    engine.stop()


def _prompt(seed: int, num_blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 30000) for _ in range(num_blocks * BLOCK + 5)]


def _scheduler_client(vllm: VllmInstance):
    return vllm.scheduler.connector._scheduler.link.client()


def _step_until_read(vllm: VllmInstance) -> None:
    """One step (its LOOKUP goes out), then until the engine has read all the scheduler sent."""
    vllm.step()
    ring = _scheduler_client(vllm)._producer
    deadline = time.monotonic() + WAIT_DEADLINE_S
    while ring.position and not ring.is_consumed(ring.position - 1):
        assert time.monotonic() < deadline, "the engine never read the consumer's commands"
        time.sleep(1e-3)


def _run_consumer(consumer: VllmInstance):
    """The consumer (poisoned KV memory) serves its request (bounded in steps and time): its
    load plans, each load's bytes checked in the step it landed."""
    loads = []

    def check_landed(record) -> None:
        for load in record.landed:
            for block_id, block_hash in zip(load.block_ids, load.hashes):
                for layer in range(NUM_LAYERS):
                    assert np.array_equal(consumer.page(layer, block_id), block_pattern(block_hash, layer))

    for record in consumer.run_until_done(after_step=check_landed):
        loads += record.loads
    return loads


def test_pd_consumer_lookup_during_producer_save_is_served_whole_prefix(held_engine):
    name, hold = held_engine
    producer, consumer = VllmInstance(name, extra=PRODUCER), VllmInstance(name, extra=CONSUMER)
    try:
        prompt = _prompt(1, 5)
        # 1. The prefill server computes the prompt (one token); its SAVE goes out, and its
        #    copies are held: the five blocks stay WRITING.
        hold.touch()
        producer.add(make_request("p", prompt, max_tokens=1))
        producer.step()
        # 2. The decode server gets the same request; its LOOKUP reaches the engine while
        #    the saves are in flight (a LOOKUP answered at once would find nothing READY).
        consumer.poison()
        consumer.add(make_request("d", prompt))
        _step_until_read(consumer)
        _step_until_read(consumer)
        assert "d" in consumer.scheduler.requests and not consumer.scheduler.running
        # 3. The saves land: the decode server is served all five blocks, byte for byte.
        hold.unlink()
        loads = _run_consumer(consumer)
        assert sum(len(load.block_ids) for load in loads) == 5
        assert consumer.served_tokens == 5 * BLOCK
        producer.run_until_done()
        stats = read_stats(name)
        assert stats["lookup_waits"] >= 1 and stats["lookup_wait_blocks"] >= 5
        assert stats["lookup_wait_timeouts"] == 0
        # 4. Roles: the producer never looked up, the consumer never saved; the engine's
        #    client list says who is who.
        by_role = {(c["role"], c["kv_role"]) for c in stats["clients"]}
        assert by_role == {("scheduler", "kv_producer"), ("worker", "kv_producer"),
                           ("scheduler", "kv_consumer"), ("worker", "kv_consumer")}
        for client in stats["clients"]:
            if client["kv_role"] == "kv_producer":
                assert client["lookups"] == 0 and client["blocks_loaded"] == 0
            else:
                assert client["blocks_saved"] == 0
    finally:
        producer.close()
        consumer.close()


def test_pd_consumer_lookup_past_its_deadline_is_served_ready_part(held_engine):
    name, hold = held_engine
    producer = VllmInstance(name, extra=PRODUCER)
    consumer = VllmInstance(name, extra={**CONSUMER, "lookup_wait_ms": 100})
    try:
        prompt = _prompt(2, 5)
        # 1. The first two blocks are READY (an earlier prompt that shares them).
        producer.add(make_request("p0", prompt[:2 * BLOCK + 3], max_tokens=1))
        producer.run_until_done()
        # 2. The whole prompt's SAVE stays in flight (its last three blocks WRITING).
        hold.touch()
        producer.add(make_request("p1", prompt, max_tokens=1))
        producer.step()
        # 3. The consumer's LOOKUP waits its 100 ms, then is answered with the READY part.
        consumer.poison()
        consumer.add(make_request("d", prompt))
        loads = _run_consumer(consumer)
        assert sum(len(load.block_ids) for load in loads) == 2
        assert consumer.served_tokens == 2 * BLOCK
        stats = read_stats(name)
        assert stats["lookup_wait_timeouts"] == 1 and stats["lookup_wait_blocks"] == 0
        hold.unlink()
        producer.run_until_done()
    finally:
        hold.unlink(missing_ok=True)
        producer.close()
        consumer.close()


def test_pd_roles_set_what_the_connector_does():
    from pegaflow.connector.config import ConnectorConfig
    from pegaflow.platform.errors import ConfigError
    producer = ConnectorConfig.from_sources({}, environ={}, kv_role="kv_producer")
    consumer = ConnectorConfig.from_sources({}, environ={}, kv_role="kv_consumer")
    assert (producer.enable_load, producer.enable_save) == (False, True)
    assert (consumer.enable_load, consumer.enable_save) == (True, False)
    # A consumer may save too when asked; a producer never loads.
    assert ConnectorConfig.from_sources({"enable_save": True}, environ={}, kv_role="kv_consumer").enable_save
    assert not ConnectorConfig.from_sources({"enable_load": True}, environ={}, kv_role="kv_producer").enable_load
    with pytest.raises(ConfigError, match="kv_role"):
        ConnectorConfig.from_sources({}, environ={}, kv_role="kv_decoder")
    with pytest.raises(ConfigError, match="lookup_wait_ms"):
        ConnectorConfig.from_sources({"lookup_wait_ms": 600}, environ={})
