"""Prefill/decode disaggregation across hosts: a prefill engine and a decode engine on two
hosts (network namespaces, see conftest) joined through one Mooncake Store.  A
``kv_producer`` vLLM saves a prompt through the first engine, which publishes its blocks;
a ``kv_consumer`` vLLM attached to the second engine is served every full block of the
same prompt, fetched through the store, byte for byte (docs/disaggregation.md)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tests.conftest import unique_engine_name
from tests.pegaflow.connector.vllm_harness import BLOCK, NUM_LAYERS, VllmInstance, block_pattern, make_request

pytestmark = pytest.mark.vllm

NUM_BLOCKS = 6


def test_remote_pd_decode_host_is_served_what_prefill_host_published(mooncake_master, two_hosts,
                                                                      engine_factory):
    # 1. A prefill engine on the first host, a decode engine on the second, one store.
    prefill_engine = engine_factory(unique_engine_name("pdp"), prefix=two_hosts.first.prefix,
                                    extra=mooncake_master.engine_flags(two_hosts.first), pool_size="16MiB")
    decode_engine = engine_factory(unique_engine_name("pdd"), prefix=two_hosts.second.prefix,
                                   extra=mooncake_master.engine_flags(two_hosts.second), pool_size="16MiB")
    rng = random.Random(7)
    prompt = [rng.randrange(10, 30000) for _ in range(NUM_BLOCKS * BLOCK + 5)]
    producer = VllmInstance(prefill_engine.name, extra={"kv_role": "kv_producer"})
    consumer = VllmInstance(decode_engine.name, extra={"kv_role": "kv_consumer"})
    try:
        # 2. The prefill vLLM computes the prompt (one token); its engine publishes the blocks.
        producer.add(make_request("p", prompt, max_tokens=1))
        producer.run_until_done()
        prefill_engine.wait_stats(lambda s: s["remote_blocks_put"] >= NUM_BLOCKS, 30.0)
        # 3. The decode vLLM (poisoned KV memory) gets the request: every full block comes
        #    from its own engine, which fetched them from the store; each byte is the prefill's.
        consumer.poison()
        consumer.add(make_request("d", prompt))
        loaded = [(block_id, block_hash) for record in consumer.run_until_done() for load in record.loads
                  for block_id, block_hash in zip(load.block_ids, load.hashes) if block_id not in record.load_errors]
        assert len(loaded) == NUM_BLOCKS and consumer.served_tokens == NUM_BLOCKS * BLOCK
        for block_id, block_hash in loaded:  # (loads may end after their step: checked once all are over)
            for layer in range(NUM_LAYERS):
                assert np.array_equal(consumer.page(layer, block_id), block_pattern(block_hash, layer))
        stats = decode_engine.fresh_stats()
        assert stats["remote_blocks_fetched"] == NUM_BLOCKS and stats["blocks_saved"] == 0
    finally:
        producer.close()
        consumer.close()
